"""Load test of one ``kvnet-node``: N concurrent OpenAI clients with shared-prefix prompts.

Starts ``kvnet-node`` (no relay) on loopback, then for each N in ``--clients`` (default 1, 4, 16) sends N
streaming completions at once, ``--rounds`` times, each prompt a shared system prefix plus its own question.
Reports per N the median over rounds of p50 and p99 time to first token (first streamed text), aggregate
generated tokens/s, and checks every answer against a greedy recompute of the same prompt on the same
model in this process (no cache at all): a mismatch fails the run. The load average is printed with each
figure, and the aggregate tokens/s of the largest N over the smallest (the node batches concurrent requests,
``--max-running-sequences``, default 16).

    python benchmarks/bench_serving.py [--model small] [--clients 1 4 16] [--rounds 3] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import openai
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import free_port, load_average  # noqa: E402
from kvnet.model.generate import generate_reference  # noqa: E402
from kvnet.model.tokenizer import ByteTokenizer  # noqa: E402
from kvnet.model.transformer import Transformer  # noqa: E402

SYSTEM = (
    "System: you are a careful assistant for an inference fleet. Answer in one short sentence and cite the "
    "document you were given. Document: relays cache, fan out and route named immutable objects; a KV block "
    "is exactly that, named by its prefix hash and fetched by many subscribers at once.\n"
)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one_request(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[float, str]:
    """(seconds to the first streamed text, the whole text) of one greedy streaming completion."""
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    async for chunk in stream:
        text = chunk.choices[0].text if chunk.choices else ""
        if text and first is None:
            first = time.perf_counter() - started
        parts.append(text)
    return (first if first is not None else time.perf_counter() - started), "".join(parts)


async def run(args: argparse.Namespace) -> int:
    port = free_port()
    node = subprocess.Popen(
        [sys.executable, "-m", "kvnet.node.serve", "--model", args.model, "--http", f"127.0.0.1:{port}",
         "--served-model-name", "bench", "--cache-blocks", "4096", "--log-level", "warning"],
        cwd=REPO, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        assert node.stderr is not None
        for line in node.stderr:
            if line.startswith("READY "):
                break
        else:
            print("kvnet-node did not start", file=sys.stderr)
            return 1
        model = Transformer.from_name(args.model, device=torch.device("cpu"))
        tokenizer = ByteTokenizer()
        expected: dict[str, tuple[str, int]] = {}
        """Prompt -> (greedy text, tokens) from a full recompute."""
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                                    timeout=600)
        print(f"model {args.model}, {args.max_tokens} tokens per answer, shared prefix {len(SYSTEM)} bytes")
        print("clients  ttft_p50_ms  ttft_p99_ms  tokens_per_s  load")
        mismatches = 0
        rate_of: dict[int, float] = {}
        for n in args.clients:
            p50s, p99s, rates = [], [], []
            for r in range(args.rounds):
                prompts = [f"{SYSTEM}Question {r}-{i}: what does a relay do with it?" for i in range(n)]
                started = time.perf_counter()
                results = await asyncio.gather(*(one_request(client, p, args.max_tokens) for p in prompts))
                elapsed = time.perf_counter() - started
                ttfts = [t for t, _ in results]
                tokens = 0
                for prompt, (_, text) in zip(prompts, results, strict=True):
                    if prompt not in expected:
                        ids = generate_reference(model, tokenizer.tokenize(prompt), args.max_tokens,
                                                 stop_token_ids=(tokenizer.eos_id,))
                        expected[prompt] = (tokenizer.detokenize(ids), len(ids))
                    want, count = expected[prompt]
                    tokens += count
                    if text != want:
                        mismatches += 1
                        print(f"MISMATCH for {prompt[-40:]!r}: {text!r} != {want!r}")
                p50s.append(percentile(ttfts, 0.5))
                p99s.append(percentile(ttfts, 0.99))
                rates.append(tokens / elapsed)
            rate_of[n] = statistics.median(rates)
            print(f"{n:7d}  {statistics.median(p50s) * 1e3:11.1f}  {statistics.median(p99s) * 1e3:11.1f}  "
                  f"{rate_of[n]:12.1f}  {load_average()}")
        low, high = min(rate_of), max(rate_of)
        if high != low:
            print(f"aggregate tokens/s, {high} clients vs {low}: {rate_of[high] / rate_of[low]:.2f}x")
        print("outputs equal to recompute:", "all" if mismatches == 0 else f"{mismatches} MISMATCHES")
        return 0 if mismatches == 0 else 1
    finally:
        node.terminate()
        node.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="built-in preset the node serves")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per client count (medians)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
