"""The smoke check of a running namespace cluster (also the demo of docs/cluster.md): a long shared document
published at site a is asked for at site b, and the subscriber's ABR, on its own, fetches it over the
emulated WAN (edge-b -> origin -> edge-a) rather than recompute it, and its output is verified (the loaded
K/V is the publisher's, the output what this node computes from it: docs/nodes.md, "What `verified`
means"). The same request is then recomputed; both reports are returned, so the figure (time to first token
fetched vs recomputed) is measured. Equal outputs of the two are reported, not required: a CPU with AMX
rounds bfloat16 prefill by batch shape, so there a cold recompute may differ in the last bits.

The trained SmolLM2 model (``--model smollm2``) in its own dtype, bfloat16: on a CPU without bfloat16
matrix units it prefills slowly enough (tens of ms per token) that fetching its KV over a WAN wins for a
long prefix; the compose nodes' small preset (or SmolLM2 in float32) prefills faster than the WAN fetch,
so the ABR rightly recomputes for them.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from .runner import ClusterError, NetnsCluster, stop_process

logger = logging.getLogger(__name__)

DEMO_MODEL = ("--model", "smollm2")
# Over a WAN the first block (about 1 MB of SmolLM2 KV) needs several round trips through three relays while
# QUIC's window opens; the default 1 s margin would abandon it before it lands (docs/cluster.md).
DEMO_FETCH_MARGIN_S = "5"
DEMO_DOCUMENT = "Shared document for every user of this deployment.\n" + (
    "kvnet moves the KV cache of long shared prompts between inference nodes. A node that has computed a "
    "prompt publishes its blocks through a relay; a node at another site that receives a prompt with the "
    "same prefix locates those blocks, fetches them over the wide-area link, checks their signatures and "
    "digests, and loads them into its paged cache instead of running the prefill again. "
) * 8
DEMO_QUESTION = "\nQuestion: what does a node at another site do with a shared prefix?"
PUBLISHER_READY_S = 600.0


@dataclass(frozen=True)
class WanDemo:
    """What the smoke measured: the ABR's request and the same request recomputed."""

    fetched: dict[str, Any]
    recomputed: dict[str, Any]

    @property
    def speedup(self) -> float:
        return float(self.recomputed["timings"]["ttft_s"]) / float(self.fetched["timings"]["ttft_s"])

    def summary(self) -> str:
        f, r = self.fetched, self.recomputed
        return (
            f"remote hit {f['remote_hit_tokens']} of {f['prompt_tokens']} tokens fetched over the WAN "
            f"({f['bytes_fetched'] / 1e6:.1f} MB), time to first token {f['timings']['ttft_s']:.1f} s; "
            f"recomputed {r['timings']['ttft_s']:.1f} s ({self.speedup:.1f}x); output verified, "
            f"{'equal to' if f.get('equals_recompute') else 'differs from'} a cold recompute"
        )


def subscriber_argv(edge: str, prompt: str, *extra: str) -> list[str]:
    """The one-shot subscriber command run inside a subscriber service (``docker compose exec sub-b ...``):
    the ABR decides (``--abr auto``, the default) whether to fetch or recompute."""
    return [
        "kvnet-subscriber", "--relay", f"moqt://{edge}:4443", "--ca", "/certs/ca.pem",
        "--trust", "/keys/pub-a", "--trust", "/keys/pub-b", "--prompt", prompt, "--json", *extra,
    ]


def publisher_argv(edge: str, key_dir: str, prompt: str, *extra: str) -> list[str]:
    """A long-running one-shot publisher (``docker compose exec -d pub-a ...``): prefills ``prompt``,
    publishes its blocks and keeps serving them."""
    return [
        "kvnet-publisher", "--relay", f"moqt://{edge}:4443", "--ca", "/certs/ca.pem", "--key-dir", key_dir,
        "--prompt", prompt, *extra,
    ]


def _subscribe(cluster: NetnsCluster, prompt: str, *extra: str) -> dict[str, Any]:
    proc = cluster.exec("sub-b", subscriber_argv("edge-b", prompt, *extra), timeout_s=900)
    if proc.returncode != 0:
        raise ClusterError(f"subscriber failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


def run_smoke(cluster: NetnsCluster, tag: str = "smoke") -> WanDemo:
    """Publish the demo document at pub-a (site a), ask for it plus a question at sub-b (site b) with the
    ABR deciding, then recompute the same request; raise ``ClusterError`` unless the ABR fetched the
    prefix, nothing was abandoned and the fetched request's output is verified. ``tag`` keeps runs'
    documents apart."""
    document = f"[{tag} {time.time_ns()}] {DEMO_DOCUMENT}"
    log_name = f"{tag}-publisher"
    argv = publisher_argv("edge-a", "/keys/pub-a", document, *DEMO_MODEL)
    publisher = cluster.spawn("pub-a", argv, log_name)
    try:
        log = cluster.run_dir / "logs" / f"{log_name}.log"
        deadline = time.monotonic() + PUBLISHER_READY_S
        while "READY" not in log.read_text(errors="replace"):
            if publisher.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"demo publisher not serving:\n{cluster.diagnostics([log_name])}")
            time.sleep(0.5)
        logger.info("pub-a published the demo document; asking for it at sub-b")
        prompt = document + DEMO_QUESTION
        fetched = _subscribe(cluster, prompt, *DEMO_MODEL, "--fetch-margin", DEMO_FETCH_MARGIN_S, "--verify")
        logger.info("fetched: %s", json.dumps({k: fetched[k] for k in ("remote_hit_tokens", "timings")}))
        recomputed = _subscribe(cluster, prompt, *DEMO_MODEL, "--abr", "recompute")
    finally:
        stop_process(publisher)
    demo = WanDemo(fetched, recomputed)
    context = f"\nfetched: {json.dumps(fetched)}\nrecomputed: {json.dumps(recomputed)}"
    if fetched["abr"].get("fetch_blocks", 0) <= 0 or fetched["remote_hit_tokens"] <= 0:
        raise ClusterError("the ABR did not fetch the shared prefix" + context)
    if fetched["abandoned"] is not None or fetched["fallback"]:
        raise ClusterError("the fetch fell back to recomputing" + context)
    if fetched.get("verified") is not True:
        raise ClusterError("the fetched request's output is not verified" + context)
    return demo
