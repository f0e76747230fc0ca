"""Tests for kvnet/node/node.py that need no relay: the node's calibration of its prefill speed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from kvnet.model.batching import SequenceRequest
from kvnet.model.transformer import Transformer
from kvnet.node.node import CALIBRATION_MAX_TOKENS, Node, NodeConfig


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    built = Node(NodeConfig(model="tiny", block_size=16, cache_blocks=64),
                 Transformer.from_name("tiny", device=torch.device("cpu")))
    try:
        yield built
    finally:
        await built.close()


async def test_calibration_measures_two_sizes_at_the_first_that_runs_long_enough(node: Node) -> None:
    # Every run is long enough: the sizes asked for, an eighth, half and whole.
    node.calibrate(tokens=16, min_run_s=0.0)
    assert [(size, context) for size, context, _ in node.abr.prefill.samples] == [(2, 0), (8, 0), (16, 0)]
    assert node.abr.prefill.per_token_s > 0


async def test_calibration_keeps_the_faster_of_two_runs_of_each_size(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A warm-up run, the run that is long enough, then two runs of each measured size; one sample a size.
    handles: list[Any] = []
    submit = node.engine.submit

    def counted(request: SequenceRequest, *args: Any) -> Any:
        handles.append((len(request.prompt_ids), submit(request, *args)))
        return handles[-1][1]

    monkeypatch.setattr(node.engine, "submit", counted)
    node.calibrate(tokens=16, min_run_s=0.0)
    assert [size for size, _ in handles] == [16, 16, 2, 2, 8, 8, 16, 16]
    took = [handle.future.result().prefill_compute_seconds for _, handle in handles]
    assert node.abr.prefill.samples == (
        (2, 0, min(took[2:4])), (8, 0, min(took[4:6])), (16, 0, min(took[6:8]))
    )


async def test_calibration_doubles_short_runs_up_to_its_limit(node: Node) -> None:
    # No run is long enough: doubled up to the longest run allowed (the cap, or the model's context), which
    # is the engine's step here, so a run of two forwards follows (attention to cached keys).
    node.calibrate(tokens=16, min_run_s=1e9)
    limit = min(CALIBRATION_MAX_TOKENS, node.model.args.max_seq_len - 1)
    longest = 16
    while 2 * longest <= limit:
        longest *= 2
    prefill = node.abr.prefill
    assert prefill.max_step_tokens == longest
    assert [size for size, _, _ in prefill.samples] == [longest // 8, longest // 2, longest, 2 * longest]
    assert prefill.forwards(2 * longest) == 2 and prefill.pairs(2 * longest) == longest * longest


async def test_calibration_runs_only_what_the_cache_pool_holds() -> None:
    # The runs go through the engine and its cache: a node started with two 16-token blocks measures
    # runs of 4, 16 and 32 tokens (it would fail at start-up asking for more).
    small = Node(NodeConfig(model="tiny", block_size=16, cache_blocks=2),
                 Transformer.from_name("tiny", device=torch.device("cpu")))
    try:
        small.calibrate(tokens=64, min_run_s=1e9)
        assert [size for size, _, _ in small.abr.prefill.samples] == [4, 16, 32]
    finally:
        await small.close()
