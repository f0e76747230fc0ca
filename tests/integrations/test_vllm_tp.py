"""The vLLM connector under tensor parallelism: TP = 2 engines (two worker ranks each) through a real relay.

Each rank holds half of the KV heads and publishes its slice as block tracks of its own fingerprint (the
fingerprint names the tensor-parallel size and rank; the block chain is rank 0's, so every rank names a
prompt's blocks alike). The scheduler offers a remote prefix only where every rank's slice is located, and
each rank loads its own slice.

Engine A (TP = 2) computes a prefix, publishing both ranks' slices, and then the prefix plus a suffix:
vLLM's own local prefix-cache hit, the reference. The test then pushes, signed by A's key, rank 0's slice
alone of another prompt's prefix. Engine B (TP = 2), a new process, runs both prompts: the first loads its
prefix through the relay on both ranks, with tokens and top-5 logprobs equal to A's local hit bit for bit;
the second, whose rank-1 slice exists nowhere, is not offered as a hit at all (nothing located, nothing
loaded) and is computed.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from kvnet.security.signing import load_signer
from tests.integrations.test_vllm import (
    BLOCK,
    counters,
    make_setup,
    push_forged,
    require_cores,
    start_engine,
    step,
    stop_engines,
    vllm_cpu_kernel,
    vllm_python,
    wait_engine,
)

pytestmark = pytest.mark.slow  # two vLLM engines of two worker processes each

RANKS = 2
PREFIX_BLOCKS = 3
_rng = random.Random(52)
SHARED = [_rng.randrange(3, 1000) for _ in range(PREFIX_BLOCKS * BLOCK + 20)]
SUFFIX = [_rng.randrange(3, 1000) for _ in range(16)]
HALF_PUBLISHED = [_rng.randrange(3, 1000) for _ in range(PREFIX_BLOCKS * BLOCK + 20)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_cores(RANKS)
    vllm_cpu_kernel(vllm_python(), head_size=64)  # skips where kvnet cannot map the kernel vLLM picks
    setup = make_setup(tmp_path_factory, "vllm-tp")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        a_steps = [step("prefix", SHARED), step("local_hit", SHARED + SUFFIX)]
        procs.append(a := start_engine(setup, "A", setup.r1.url, a_steps, tensor_parallel=RANKS))
        result_a = wait_engine(setup, "A", a)
        rank0 = counters(setup, "A", "worker")
        signer = load_signer(setup.home / "keys" / "publisher.key")
        pushed = asyncio.run(push_forged(setup, setup.r1, rank0, HALF_PUBLISHED, signer, tamper=False))
        b_steps = [step("remote_hit", SHARED + SUFFIX), step("half_published", HALF_PUBLISHED + SUFFIX)]
        procs.append(b := start_engine(setup, "B", setup.r1.url, b_steps, tensor_parallel=RANKS))
        yield {"setup": setup, "A": result_a, "B": wait_engine(setup, "B", b), "half_pushed": pushed}
    finally:
        stop_engines(procs)
        setup.r1.stop()


def test_each_rank_publishes_its_slice_under_its_own_fingerprint(runs: dict[str, Any]) -> None:
    setup = runs["setup"]
    ranks = [counters(setup, "A", "worker"), counters(setup, "A", "worker-1")]
    assert ranks[0]["fingerprint"] != ranks[1]["fingerprint"]
    assert ranks[0]["namespace_id"] == ranks[1]["namespace_id"]
    for worker in ranks:
        # Half of the model's two KV heads each (vllm_model.py: hidden 256, 2 KV heads of 64).
        assert worker["block_shape"] == [4, BLOCK, 1, 64]
        assert worker["blocks_published"] == worker["blocks_pushed"] == PREFIX_BLOCKS
        assert worker["push_failures_refused"] == worker["push_failures_transfer"] == 0


def test_a_tp2_remote_hit_loads_every_ranks_slice_and_equals_vllms_local_hit(runs: dict[str, Any]) -> None:
    local = runs["A"]["steps"]["local_hit"]
    remote = runs["B"]["steps"]["remote_hit"]
    assert local["num_cached_tokens"] == remote["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
    assert remote["token_ids"] == local["token_ids"]
    assert remote["logprobs"] == local["logprobs"]  # every top-5 logprob, bit for bit (float.hex)
    setup = runs["setup"]
    for side in ("worker", "worker-1"):
        worker = counters(setup, "B", side)
        assert worker["blocks_loaded"] == PREFIX_BLOCKS and worker["blocks_load_failed"] == 0


def test_one_rank_times_the_forwards_for_the_prefill_estimate(runs: dict[str, Any]) -> None:
    """Every rank runs the same forward; only rank 0's timings reach the scheduler, so each step is one
    prefill sample, not one per rank."""
    setup = runs["setup"]
    rank0, rank1 = counters(setup, "B", "worker"), counters(setup, "B", "worker-1")
    assert rank0["forwards_timed"] >= 1 and rank1["forwards_timed"] == 0
    samples = counters(setup, "B", "scheduler")["abr"]["prefill_samples"]
    assert 1 <= samples <= rank0["forwards_timed"]


def test_a_prefix_missing_on_one_rank_is_not_offered(runs: dict[str, Any]) -> None:
    assert runs["half_pushed"] == PREFIX_BLOCKS  # rank 0's slice of the prefix is in the relay
    half = runs["B"]["steps"]["half_published"]
    assert half["num_cached_tokens"] == 0
    setup = runs["setup"]
    scheduler = counters(setup, "B", "scheduler")
    assert scheduler["locates"] == 2
    assert scheduler["blocks_located"] == PREFIX_BLOCKS  # the shared prefix only: rank 1 lacks the other
    for side in ("worker", "worker-1"):
        assert counters(setup, "B", side)["loads"] == 1
