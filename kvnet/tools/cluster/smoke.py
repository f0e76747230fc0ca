"""The smoke check of a running namespace cluster (also the demo of docs/cluster.md): a long shared document
published at site a is asked for at site b, with the subscriber's ABR deciding on its own whether to fetch
its KV over the emulated WAN (edge-b -> origin -> edge-a), recompute it, or compute its head while
fetching its tail. The same request is then timed on the rungs the ABR did not take (fetched whole with
``--abr fetch``, on a second copy of the document so that it crosses the WAN as the ABR's request did;
recomputed with ``--abr recompute``), so the demo says what the ABR chose, why (its
estimates), and how its time to first token compares with the faster of fetching and recomputing (the
target: within 10%). That comparison is reported, never a failure: it is a measurement, and on a loaded
machine a measurement. What fails the smoke is a broken path: the whole-prefix fetch (the ABR's, or the
forced one) must load the prefix without falling back, and its output must be verified (the loaded K/V
is the publisher's, the output what this node computes from it: docs/nodes.md, "What `verified`
means"). Equal outputs with the recompute are reported, not required: a CPU with AMX rounds bfloat16
prefill by batch shape, so there a cold recompute may differ in the last bits.

The subscriber first asks for a shorter document of its own (``WARMUP_DOCUMENT``, also published at site
a), the way a long-running node has fetched over its path before: that first contact plans with the
throughput prior (nothing measured yet) and is re-planned mid-fetch by the rate it achieves
(``kvnet.exchange.abr.FetchDeadline.overtaken``); its report is kept (``WanDemo.first_contact``) and
printed, and the demo request that follows plans with what it measured.

The trained SmolLM2 model (``--model smollm2``) in its own dtype, bfloat16: on a CPU without bfloat16
matrix units it prefills slowly enough (tens of ms per token) that fetching its KV over a WAN wins for a
long prefix; on a CPU with them (AMX) it prefills fast enough that recomputing wins, and the ABR should
say so.
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
DEMO_DOCUMENT = "Shared document for every user of this deployment.\n" + (
    "kvnet moves the KV cache of long shared prompts between inference nodes. A node that has computed a "
    "prompt publishes its blocks through a relay; a node at another site that receives a prompt with the "
    "same prefix locates those blocks, fetches them over the wide-area link, checks their signatures and "
    "digests, and loads them into its paged cache instead of running the prefill again. "
) * 8
DEMO_QUESTION = "\nQuestion: what does a node at another site do with a shared prefix?"
WARMUP_DOCUMENT = "Release notes of this deployment.\n" + (
    "Relays cache the blocks they forward, nodes verify every block they fetch, and a node that finds "
    "fetching slower than computing recomputes instead. "
) * 16
"""About nine blocks of SmolLM2 KV: long enough that a plan at the throughput prior fetches it even where
prefill is fast (AMX), so the first contact measures the path."""
PUBLISHER_READY_S = 600.0


WITHIN = 1.10
"""The ABR's time to first token should be at most this factor of the faster rung's."""


@dataclass(frozen=True)
class WanDemo:
    """What the smoke measured: the request with the ABR deciding, the same request with its prefix fetched
    whole over the WAN (the ABR's own request when that is what it did) and recomputed."""

    chosen: dict[str, Any]
    fetched: dict[str, Any]
    recomputed: dict[str, Any]
    first_contact: dict[str, Any]
    """The same subscriber's earlier request (``WARMUP_DOCUMENT``), planned before anything was measured."""

    @staticmethod
    def ttft(report: dict[str, Any]) -> float:
        return float(report["timings"]["ttft_s"])

    @property
    def speedup(self) -> float:
        """Recomputed over fetched time to first token."""
        return self.ttft(self.recomputed) / self.ttft(self.fetched)

    @property
    def choice(self) -> str:
        """"fetch", "recompute" or "fetch and compute" (the head computed while the tail is fetched)."""
        abr = self.chosen["abr"]
        if abr.get("compute_blocks", 0) > 0:
            return "fetch and compute"
        return "fetch" if abr.get("fetch_blocks", 0) > 0 else "recompute"

    @property
    def against_best(self) -> float:
        """The ABR's time to first token over the faster of fetching whole and recomputing."""
        return self.ttft(self.chosen) / min(self.ttft(self.fetched), self.ttft(self.recomputed))

    def reason(self) -> str:
        """The ABR's estimates behind its choice, in one phrase."""
        abr = self.chosen["abr"]
        inputs = abr.get("inputs", {})
        if "locate_skipped" in abr:
            measured = inputs.get("throughput_bps", 0.0) / 1e6
            return f"at the {measured:.1f} MB/s it measured, {abr['locate_skipped']}"
        plan, everything = abr.get("est_total_s", 0.0), abr.get("est_recompute_all_s", 0.0)
        return (
            f"estimated {plan:.1f} s against {everything:.1f} s recomputing everything, at "
            f"{inputs.get('throughput_bps', 0.0) / 1e6:.1f} MB/s and "
            f"{1000 * inputs.get('prefill_per_token_s', 0.0):.1f} ms of prefill per token"
        )

    def first_contact_summary(self) -> str:
        """What the first request over the path (nothing measured yet) planned and how it ended."""
        w = self.first_contact
        inputs = w["abr"].get("inputs", {})
        ended = (f"re-planned mid-fetch ({w['abandoned']})" if w.get("abandoned")
                 else f"fetched {w['remote_hit_tokens']} tokens" if w["remote_hit_tokens"] > 0
                 else "recomputed")
        return (
            f"first contact ({w['prompt_tokens']} tokens, nothing measured yet): planned at "
            f"{inputs.get('throughput_bps', 0.0) / 1e6:.1f} MB/s, {ended}; time to first token "
            f"{self.ttft(w):.1f} s"
        )

    def summary(self) -> str:
        c, f, r = self.chosen, self.fetched, self.recomputed
        verdict = "within" if self.against_best <= WITHIN else "NOT within"
        same = "equal to" if f.get("equals_recompute") else "differs from"
        return (
            f"{self.first_contact_summary()}. Then the ABR chose to {self.choice} ({self.reason()}): "
            f"time to first token {self.ttft(c):.1f} s; "
            f"fetched whole {self.ttft(f):.1f} s ({f['remote_hit_tokens']} of {f['prompt_tokens']} tokens, "
            f"{f['bytes_fetched'] / 1e6:.1f} MB over the WAN), recomputed {self.ttft(r):.1f} s; the choice "
            f"took {self.against_best:.2f}x the faster rung ({verdict} {round(100 * (WITHIN - 1))}%); "
            f"fetched output verified, {same} a cold recompute"
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


def _subscribe(cluster: NetnsCluster, prompts: list[str], *extra: str) -> list[dict[str, Any]]:
    """Ask for ``prompts`` in turn in one subscriber process (one node, one ABR); their reports."""
    argv = subscriber_argv("edge-b", prompts[0], *extra)
    for prompt in prompts[1:]:
        argv += ["--prompt", prompt]
    proc = cluster.exec("sub-b", argv, timeout_s=900)
    if proc.returncode != 0:
        raise ClusterError(f"subscriber failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    lines = proc.stdout.strip().splitlines()[-len(prompts):]
    reports: list[dict[str, Any]] = [json.loads(line) for line in lines]
    return reports


def fetched_whole(report: dict[str, Any]) -> bool:
    """The request fetched every located block (no head computed, nothing recomputed instead)."""
    abr = report["abr"]
    return (
        abr.get("fetch_blocks", 0) > 0 and abr.get("compute_blocks", 0) == 0
        and report["remote_hit_tokens"] > 0 and report["abandoned"] is None and not report["fallback"]
        and abr.get("fetch_blocks", 0) >= report["located_blocks"]
    )


def run_smoke(cluster: NetnsCluster, tag: str = "smoke") -> WanDemo:
    """Publish the warm-up and demo documents at pub-a (site a) and ask for each plus a question at sub-b
    (site b) in one subscriber with the ABR deciding; then the demo request in new subscribers fetched
    whole with ``--abr fetch`` (unless the ABR did exactly that) and recomputed (after the warm-up
    document, recomputed too: its process's second request, as the ABR's is). The forced fetch asks for a
    second copy of the document (its own chain hashes, published beside it), so it crosses the WAN with
    the edges' caches as cold as the ABR's request found them: after a split or a partial fetch the same
    document would come mostly from edge-b's cache and make fetching look faster than it is. Raise
    ``ClusterError`` unless the whole-prefix fetch loaded the prefix without falling back and its output is
    verified. ``tag`` keeps runs' documents apart."""
    stamp = f"[{tag} {time.time_ns()}]"
    document, warmup = f"{stamp} {DEMO_DOCUMENT}", f"{stamp} {WARMUP_DOCUMENT}"
    twin = f"{stamp} (second copy) {DEMO_DOCUMENT}"
    log_name = f"{tag}-publisher"
    log = cluster.run_dir / "logs" / f"{log_name}.log"
    # The log is appended to by every run in this run directory: only this publisher's READY counts (an
    # earlier run's sent the subscriber off before the document was published, and it located nothing).
    earlier = log.stat().st_size if log.exists() else 0
    argv = publisher_argv("edge-a", "/keys/pub-a", warmup, "--prompt", document, "--prompt", twin,
                          *DEMO_MODEL)
    publisher = cluster.spawn("pub-a", argv, log_name)
    try:
        deadline = time.monotonic() + PUBLISHER_READY_S
        while b"READY" not in log.read_bytes()[earlier:]:
            if publisher.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"demo publisher not serving:\n{cluster.diagnostics([log_name])}")
            time.sleep(0.5)
        logger.info("pub-a published the documents; asking for them at sub-b")
        prompt = document + DEMO_QUESTION
        first_contact, chosen = _subscribe(cluster, [warmup + DEMO_QUESTION, prompt], *DEMO_MODEL, "--verify")
        for name, report in (("first contact", first_contact), ("ABR", chosen)):
            shown = {k: report[k] for k in ("remote_hit_tokens", "abr", "abandoned", "timings")}
            logger.info("%s: %s", name, json.dumps(shown))
        fetched = chosen
        if not fetched_whole(chosen):
            [fetched] = _subscribe(cluster, [twin + DEMO_QUESTION], *DEMO_MODEL, "--verify", "--abr", "fetch")
        # Second in its process, as the ABR's request was: both nodes have answered one request before.
        _, recomputed = _subscribe(cluster, [warmup + DEMO_QUESTION, prompt], *DEMO_MODEL,
                                   "--abr", "recompute")
    finally:
        stop_process(publisher)
    demo = WanDemo(chosen, fetched, recomputed, first_contact)
    context = (f"\nchosen: {json.dumps(chosen)}\nfetched: {json.dumps(fetched)}"
               f"\nrecomputed: {json.dumps(recomputed)}")
    if fetched["remote_hit_tokens"] <= 0:
        raise ClusterError("the shared prefix was not fetched" + context)
    if fetched["abandoned"] is not None or fetched["fallback"]:
        raise ClusterError("the fetch fell back to recomputing" + context)
    if fetched.get("verified") is not True:
        raise ClusterError("the fetched request's output is not verified" + context)
    if chosen["remote_hit_tokens"] > 0 and chosen.get("verified") is not True:
        raise ClusterError("the ABR's request loaded a prefix but its output is not verified" + context)
    return demo
