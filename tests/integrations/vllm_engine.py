"""One offline vLLM engine process running a list of steps: ``python vllm_engine.py SPEC.json``.

Runs in the vLLM environment with the checkout on ``PYTHONPATH``. SPEC::

    {"model": DIR, "kv_transfer_config": {...} | null, "out": RESULT.json,
     "max_tokens": 4, "logprobs": 5, "max_model_len": 4096, "tensor_parallel_size": 1,
     "dtype": "bfloat16", "block_size": 128, "attention_backend": null,
     "steps": [{"name": "a", "prompt_token_ids": [...]}, {"wait_for_file": PATH},
               {"batch": {"b": [...], "c": [...]}}, ...]}

A ``batch`` step submits its prompts together, so the engine schedules them as concurrent requests.

Each generation step records the generated token ids, the top-k logprobs of every generated position (as
``float.hex`` strings, so comparisons are bit for bit), vLLM's ``num_cached_tokens`` and the time to first
token. The result file is rewritten after every step, so a test can follow a running engine; ``done`` is
set once the engine has shut down cleanly (the connector drained its pushes).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def record(output: Any, elapsed: float) -> dict[str, Any]:
    completion = output.outputs[0]
    metrics = output.metrics
    ttft = None
    if metrics is not None and getattr(metrics, "first_token_latency", None) is not None:
        ttft = metrics.first_token_latency
    return {
        "token_ids": list(completion.token_ids),
        "logprobs": [
            sorted((int(t), float(lp.logprob).hex()) for t, lp in position.items())
            for position in completion.logprobs or []
        ],
        "num_cached_tokens": output.num_cached_tokens,
        "ttft": ttft,
        "seconds": elapsed,
    }


def run(spec: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = Path(spec["out"])
    result: dict[str, Any] = {"steps": {}, "done": False}

    def save() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)

    llm = LLM(
        model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True,
        block_size=spec.get("block_size", 128), attention_backend=spec.get("attention_backend"),
        max_model_len=spec.get("max_model_len", 4096), seed=0,
        kv_transfer_config=spec.get("kv_transfer_config"), disable_log_stats=False,
        enable_prefix_caching=True, tensor_parallel_size=spec.get("tensor_parallel_size", 1),
        distributed_executor_backend="mp" if spec.get("tensor_parallel_size", 1) > 1 else None,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 4), logprobs=spec.get("logprobs", 5)
    )
    # The first request asking for logprobs pays a one-off set-up: keep it out of the measured steps.
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)
    result["ready"] = True
    save()
    for step in spec["steps"]:
        if "wait_for_file" in step:
            flag = Path(step["wait_for_file"])
            deadline = time.monotonic() + step.get("timeout", 120)
            while not flag.exists():
                if time.monotonic() > deadline:
                    raise SystemExit(f"gave up waiting for {flag}")
                time.sleep(0.05)
            continue
        batch = step["batch"] if "batch" in step else {step["name"]: step["prompt_token_ids"]}
        started = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in batch.values()]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        for name, output in zip(batch, outputs, strict=True):
            result["steps"][name] = record(output, elapsed)
        save()
    # A clean shutdown: the engine process stops its scheduler and worker, and the connector drains its
    # pending pushes first.
    llm.llm_engine.engine_core.shutdown(timeout=60)
    result["done"] = True
    save()


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()))
