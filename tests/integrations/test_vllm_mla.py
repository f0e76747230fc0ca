"""The vLLM connector on an MLA model: a small DeepSeek-V2 (vllm_model.py ``--mla``) on vLLM's ``CPU_MLA``
backend, two TP = 2 engines through a real relay.

An MLA layer caches one latent per token (compressed KV and rotary key, 576 elements) and every
tensor-parallel rank holds the whole of it. So the engine has one fingerprint for all ranks, rank 0 alone
publishes, and every rank loads rank 0's blocks.

vLLM's CPU platform turns its own prefix caching off for MLA models, so there is no local hit to compare
with; the reference is a decode step, which reads the cache through the same kernel. Engine A runs a
three-block prompt and generates; its second generated token is computed by one decode step over the
prompt's cached latent. Engine B, a new process, runs the prompt plus A's first generated token: it loads
the three blocks from the relay on both ranks and computes that one token, also a one-token step over the
cache. B's tokens and top-5 logprobs must equal A's from the second on, bit for bit.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integrations.test_vllm import (
    counters,
    make_setup,
    require_cores,
    start_engine,
    step,
    stop_engines,
    wait_engine,
)

pytestmark = pytest.mark.slow  # two vLLM engines of two worker processes each

RANKS = 2
BLOCK = 16  # vLLM's CPU_MLA backend takes 16-token blocks only
PREFIX_BLOCKS = 3
LAYERS = 2
ENGINE = {"block_size": BLOCK, "attention_backend": "CPU_MLA"}
_rng = random.Random(53)
PREFIX = [_rng.randrange(3, 1000) for _ in range(PREFIX_BLOCKS * BLOCK)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_cores(RANKS)
    setup = make_setup(tmp_path_factory, "vllm-mla", "--mla", "--layers", str(LAYERS))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(a := start_engine(setup, "A", setup.r1.url, [step("cold", PREFIX)],
                                       tensor_parallel=RANKS, engine=ENGINE))
        result_a = wait_engine(setup, "A", a)
        first = result_a["steps"]["cold"]["token_ids"][0]
        procs.append(b := start_engine(setup, "B", setup.r1.url, [step("remote_hit", [*PREFIX, first])],
                                       tensor_parallel=RANKS, engine=ENGINE))
        yield {"setup": setup, "A": result_a, "B": wait_engine(setup, "B", b)}
    finally:
        stop_engines(procs)
        setup.r1.stop()


def test_rank_0_alone_publishes_the_latent_under_one_fingerprint(runs: dict[str, Any]) -> None:
    setup = runs["setup"]
    rank0, rank1 = counters(setup, "A", "worker"), counters(setup, "A", "worker-1")
    assert rank0["fingerprint"] == rank1["fingerprint"]
    # One "head" whose K and V are the two halves of the 576-element latent.
    assert rank0["block_shape"] == rank1["block_shape"] == [LAYERS, BLOCK, 1, 288]
    assert rank0["blocks_published"] == rank0["blocks_pushed"] == PREFIX_BLOCKS
    assert rank0["push_failures_refused"] == rank0["push_failures_transfer"] == 0
    assert rank1["blocks_published"] == rank1["blocks_pushed"] == 0


def test_every_rank_loads_the_latent_and_decodes_as_the_engine_that_computed_it(runs: dict[str, Any]) -> None:
    cold = runs["A"]["steps"]["cold"]
    remote = runs["B"]["steps"]["remote_hit"]
    assert cold["num_cached_tokens"] == 0
    assert remote["num_cached_tokens"] == PREFIX_BLOCKS * BLOCK
    setup = runs["setup"]
    for side in ("worker", "worker-1"):
        worker = counters(setup, "B", side)
        assert worker["blocks_loaded"] == PREFIX_BLOCKS and worker["blocks_load_failed"] == 0
    assert remote["token_ids"][:-1] == cold["token_ids"][1:]
    assert remote["logprobs"][:-1] == cold["logprobs"][1:]  # every top-5 logprob, bit for bit (float.hex)
