"""Concurrent requests sharing a remote prefix fetch it once: a real vLLM engine, a real relay, real QUIC.

Engine A (the publisher) computes a 3-block prefix alone (publishing its blocks to the relay), then four
prompts made of that prefix and different suffixes, submitted together: vLLM's own local prefix-cache hits,
the reference. Engine B, a new process on the same relay, gets the same four prompts together: vLLM plans
a load of the 3 remote blocks for each request into blocks of its own, and the connector must fetch each
block once (one FETCH per block hash in flight; the other loads wait for it and copy it into their blocks),
so 3 blocks cross the relay, not 12. Run alone afterwards, each prompt's output in B (its prefix the loaded
blocks) equals A's (its prefix computed), the same batch shape on the same kernel.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.test_vllm import (
    BLOCK,
    ENGINE_TIMEOUT,
    counters,
    make_setup,
    start_engine,
    step,
    stop_engines,
    tokens,
    vllm_cpu_kernel,
    vllm_python,
    wait_engine,
)

pytestmark = pytest.mark.slow  # two vLLM engine processes

PREFIX_BLOCKS = 3
REQUESTS = 4
SUFFIX = 40
PREFIX = tokens(11, PREFIX_BLOCKS * BLOCK)
PROMPTS = {f"r{i}": PREFIX + tokens(200 + i, SUFFIX) for i in range(REQUESTS)}
"""Each prompt's full blocks are exactly the shared prefix: its suffix only fills a partial block."""


def relay_fetches(metrics: dict[str, float]) -> float:
    """FETCH requests the relay answered, whatever their outcome (block fetches and manifest probes)."""
    return sum(v for k, v in metrics.items() if k.startswith("kvnet_relay_requests_total{") and
               'type="fetch"' in k)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    kernel = vllm_cpu_kernel(vllm_python(), head_size=64)  # vllm_model.py's head size
    setup = make_setup(tmp_path_factory, "vllm-coalesce")
    tmp, relay = setup.tmp, setup.r1
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # After the batch, each prompt once more alone in both engines: the prefix is then a local hit in
        # both (B's holds the blocks it loaded), in the same batch shape, the reference that holds on every
        # CPU kernel. The batch's own outputs depend on how vLLM groups the requests after their loads,
        # which differs from A's grouping, and bf16 kernels such as `amx` differ with the grouping.
        alone = [step(f"{name}/alone", prompt) for name, prompt in PROMPTS.items()]
        a_steps: list[dict[str, Any]] = [step("prefix", PREFIX), {"batch": PROMPTS}, *alone]
        procs.append(a := start_engine(setup, "A", relay.url, a_steps))
        # B starts alongside A (vLLM's start-up is most of the time) and waits for A's blocks.
        published = tmp / "a-done"
        b_steps: list[dict[str, Any]] = [
            {"wait_for_file": str(published), "timeout": ENGINE_TIMEOUT}, {"batch": PROMPTS}, *alone,
        ]
        procs.append(b := start_engine(setup, "B", relay.url, b_steps))
        result_a = wait_engine(setup, "A", a)
        before = relay_fetches(relay.metrics())
        published.touch()
        result_b = wait_engine(setup, "B", b)
        yield {
            "kernel": kernel, "setup": setup, "A": result_a, "B": result_b,
            "relay_fetches": relay_fetches(relay.metrics()) - before,
        }
    finally:
        stop_engines(procs)
        relay.stop()


def test_concurrent_requests_fetch_a_shared_remote_prefix_once(runs: dict[str, Any]) -> None:
    # The relay's FETCHes: the 3 blocks, plus at most one manifest probe per locate (a session's first
    # locates also FETCH block 0's manifest, ``BlockFetcher.locate``); a fetch per request would be 12.
    assert runs["relay_fetches"] <= PREFIX_BLOCKS + REQUESTS
    b_worker = counters(runs["setup"], "B", "worker")
    assert b_worker["kv_layout"] == f"cpu_attn/{runs['kernel']}"
    assert b_worker["blocks_loaded"] == REQUESTS * PREFIX_BLOCKS  # every request has the prefix...
    assert b_worker["blocks_fetched"] == PREFIX_BLOCKS  # ...fetched once
    assert b_worker["blocks_shared"] == (REQUESTS - 1) * PREFIX_BLOCKS
    assert b_worker["blocks_load_failed"] == 0


def test_every_request_equals_vllms_local_prefix_hit(runs: dict[str, Any]) -> None:
    for name in PROMPTS:
        local, remote = runs["A"]["steps"][name], runs["B"]["steps"][name]
        assert local["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
        assert remote["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
        # Alone, B's prefix is the blocks it loaded, A's the blocks it computed: same shape, same kernel.
        local, remote = runs["A"]["steps"][f"{name}/alone"], runs["B"]["steps"][f"{name}/alone"]
        assert remote["num_cached_tokens"] >= PREFIX_BLOCKS * BLOCK, name
        assert remote["num_cached_tokens"] == local["num_cached_tokens"], name
        assert remote["token_ids"] == local["token_ids"], name
        assert remote["logprobs"] == local["logprobs"], name  # every top-5 logprob, bit for bit
