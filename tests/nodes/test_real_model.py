"""Cross-node reuse on a trained model: publisher and subscriber processes on SmolLM2 (bf16, its own
tokenizer) through a real relay; the remote hit is lossless, its K/V exactly the publisher's, and its output
equals the subscriber's own with that prefix held locally (``verified``). Equality with a cold recompute is
not asserted: on a CPU with AMX, bf16 prefill rounds by batch shape (docs/nodes.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.helpers.processes import REPO, free_port, wait_for_output
from tests.nodes import cluster as cluster_module
from tests.nodes.cluster import TEST_BLOCK_SIZE, cluster

DOCUMENT = Path(__file__).resolve().parents[2] / "benchmarks" / "documents" / "sourdough.txt"
# A real model loads, hashes its weights and calibrates before it serves: allow for a loaded machine.
REAL_MODEL_START_TIMEOUT = 600.0


@pytest.mark.slow
def test_remote_hit_on_smollm2_is_verified(
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
    assert remote["verified"] is True and remote["kv_exact"] is True, remote
    assert isinstance(remote["equals_recompute"], bool), remote  # reported, its value depends on the CPU
    assert remote["remote_hit_tokens"] >= 4 * TEST_BLOCK_SIZE and remote["local_hit_tokens"] == 0
    assert remote["renditions"] == {"lossless": remote["remote_hit_tokens"] // TEST_BLOCK_SIZE}
    assert remote["fallback"] == [] and remote["security_events"] == []
    # Real text from the model's own tokenizer, not bytes of a 259-token vocabulary.
    assert remote["output_text"].strip() and max(remote["output_token_ids"]) >= 259
    assert remote["prompt_tokens"] < len(ask) // 2


@pytest.mark.slow
def test_a_default_node_answers_with_the_trained_model(smollm2_dir: Path, tmp_path: Path) -> None:
    # kvnet-node as a new user starts it: no --model (SmolLM2, not random weights), no relay.
    port = free_port()
    log = tmp_path / "node.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVNET_")}
    env["KVNET_HOME"] = str(tmp_path / "home")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvnet.node.serve", "--http", f"127.0.0.1:{port}"], cwd=REPO, env=env,
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        wait_for_output(proc, lambda: log.read_text(errors="replace"), "READY http://", "kvnet-node",
                        timeout=REAL_MODEL_START_TIMEOUT)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        (model,) = [m.id for m in client.models.list()]
        answer = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=4, temperature=0
        )
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert "smollm2" in model.lower(), model
    assert answer.choices[0].text.strip().startswith("Paris"), answer.choices[0].text
