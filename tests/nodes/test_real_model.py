"""Cross-node reuse on a trained model: publisher and subscriber processes on SmolLM2 (bf16, its own
tokenizer) through a real relay; the remote hit is lossless and its output equals a full local recompute."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nodes import cluster as cluster_module
from tests.nodes.cluster import TEST_BLOCK_SIZE, cluster

DOCUMENT = Path(__file__).resolve().parents[2] / "benchmarks" / "documents" / "sourdough.txt"
# A real model loads, hashes its weights and calibrates before it serves: allow for a loaded machine.
REAL_MODEL_START_TIMEOUT = 600.0


@pytest.mark.slow
def test_remote_hit_on_smollm2_equals_recompute(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cluster_module, "START_TIMEOUT", REAL_MODEL_START_TIMEOUT)
    paragraph = DOCUMENT.read_text().split("\n\n")[1]
    prefix = f"<|im_start|>system\nAnswer from this text.\n\n{paragraph}<|im_end|>\n"
    ask = prefix + "<|im_start|>user\nHow long does a starter take?<|im_end|>\n<|im_start|>assistant\n"
    model = ("--model", "smollm2")
    with cluster(tmp_path) as c:
        c.start_relay()
        c.start_publisher([prefix], *model)
        flags = ("--abr", "fetch", "--verify", "--max-tokens", "12")
        (remote,) = c.subscribe([ask], *model, *flags, timeout=REAL_MODEL_START_TIMEOUT)
    assert remote["verified"] is True, remote
    assert remote["remote_hit_tokens"] >= 4 * TEST_BLOCK_SIZE and remote["local_hit_tokens"] == 0
    assert remote["renditions"] == {"lossless": remote["remote_hit_tokens"] // TEST_BLOCK_SIZE}
    assert remote["fallback"] == [] and remote["security_events"] == []
    # Real text from the model's own tokenizer, not bytes of a 259-token vocabulary.
    assert remote["output_text"].strip() and max(remote["output_token_ids"]) >= 259
    assert remote["prompt_tokens"] < len(ask) // 2
