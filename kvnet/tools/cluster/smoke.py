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
import statistics
import time
from collections.abc import Sequence
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
TIMED_REQUESTS = 3
"""Requests timed on each rung, each on its own copy of the document; the comparison is of their medians.
One request says little: on 2 cores the same 700-token prefill took 0.46-0.64 s from one request to the
next, more than the 10% the comparison is about."""


def median_ttft(reports: Sequence[dict[str, Any]]) -> float:
    """The median time to first token of ``reports`` (the middle one of an odd count)."""
    return statistics.median(float(r["timings"]["ttft_s"]) for r in reports)


def choice_of(report: dict[str, Any]) -> str:
    """"fetch", "recompute" or "fetch and compute" (the head computed while the tail is fetched)."""
    abr = report["abr"]
    if abr.get("compute_blocks", 0) > 0:
        return "fetch and compute"
    return "fetch" if abr.get("fetch_blocks", 0) > 0 else "recompute"


@dataclass(frozen=True)
class WanDemo:
    """What the smoke measured: the timed copies of the shared request with the ABR deciding, and
    the same with the prefix fetched whole over the WAN (the ABR's own requests when that is what it did
    every time) and recomputed."""

    chosen: list[dict[str, Any]]
    fetched: list[dict[str, Any]]
    recomputed: list[dict[str, Any]]
    first_contact: dict[str, Any]
    """The same subscriber's earlier request (``WARMUP_DOCUMENT``), planned before anything was measured."""

    @staticmethod
    def ttft(report: dict[str, Any]) -> float:
        return float(report["timings"]["ttft_s"])

    @property
    def speedup(self) -> float:
        """Recomputed over fetched time to first token (medians)."""
        return median_ttft(self.recomputed) / median_ttft(self.fetched)

    @property
    def choices(self) -> list[str]:
        """What the ABR chose for each timed request, in order."""
        return [choice_of(report) for report in self.chosen]

    @property
    def against_best(self) -> float:
        """The ABR's median time to first token over the faster rung's (fetched whole or recomputed)."""
        return median_ttft(self.chosen) / min(median_ttft(self.fetched), median_ttft(self.recomputed))

    @staticmethod
    def reason(report: dict[str, Any]) -> str:
        """The ABR's estimates behind its choice for ``report``, in one phrase."""
        abr = report["abr"]
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
        head_blocks = (w.get("overlap") or {}).get("head_blocks", 0)
        ended = (f"re-planned mid-fetch ({w['abandoned']})" if w.get("abandoned")
                 else f"fetched {w['remote_hit_tokens']} tokens" if w["remote_hit_tokens"] > 0
                 else f"split, and its head computed all {head_blocks} blocks before the tail came"
                 if head_blocks else "recomputed")
        return (
            f"first contact ({w['prompt_tokens']} tokens, nothing measured yet): planned at "
            f"{inputs.get('throughput_bps', 0.0) / 1e6:.1f} MB/s, {ended}; time to first token "
            f"{self.ttft(w):.1f} s"
        )

    def summary(self) -> str:
        c, f, r = self.chosen, self.fetched, self.recomputed
        verdict = "within" if self.against_best <= WITHIN else "NOT within"
        copies = "one copy of the shared request" if len(c) == 1 else f"{len(c)} copies of the shared request"
        same = "equal to" if all(report.get("equals_recompute") for report in f) else "differs from"
        choices = self.choices
        chose = (choices[0] if len(choices) == 1
                 else f"{choices[0]} all {len(choices)} times" if len(set(choices)) == 1
                 else ", ".join(choices))

        def times(reports: list[dict[str, Any]]) -> str:
            each = "/".join(f"{self.ttft(report):.2f}" for report in reports)
            return f"median {median_ttft(reports):.2f} s ({each})"

        return (
            f"{self.first_contact_summary()}. Then, over {copies}, the ABR "
            f"chose to {chose} (first: {self.reason(c[0])}): time to first token {times(c)}; fetched whole "
            f"{times(f)} ({f[0]['remote_hit_tokens']} of {f[0]['prompt_tokens']} tokens, "
            f"{f[0]['bytes_fetched'] / 1e6:.1f} MB over the WAN each), recomputed {times(r)}; the choice "
            f"took {self.against_best:.2f}x the faster rung ({verdict} {round(100 * (WITHIN - 1))}%); "
            f"fetched outputs verified, {same} a cold recompute"
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


def run_smoke(cluster: NetnsCluster, tag: str = "smoke", timed_requests: int = TIMED_REQUESTS) -> WanDemo:
    """Publish the warm-up document and copies of the demo document at pub-a (site a); at sub-b (site b),
    one subscriber with the ABR deciding asks for the warm-up and then ``timed_requests`` copies, each
    plus a question; then the same copies in new subscribers fetched whole with ``--abr fetch`` (unless
    the ABR did exactly that every time) and recomputed (after the warm-up document, recomputed too, so
    each rung's timed requests follow one earlier request in their process, as the ABR's do). Every timed
    request asks for a copy of its own (its own chain hashes), so each crosses the WAN with the edges'
    caches cold: after a split or a partial fetch the same document would come mostly from edge-b's cache
    and make fetching look faster than it is; the forced fetches have copies of their own for the same
    reason. Raise ``ClusterError`` unless every whole-prefix fetch loaded the prefix without falling back
    and its output is verified. ``tag`` keeps runs' documents apart. Fewer ``timed_requests`` check the
    same path in less time (each copy costs at least three prefills of the document: the publisher's, the
    verification's cold recompute and the recompute rung's); their medians then say little."""
    if timed_requests < 1:
        raise ValueError(f"the demo times at least one request, not {timed_requests}")
    stamp = f"[{tag} {time.time_ns()}]"
    warmup = f"{stamp} {WARMUP_DOCUMENT}"
    copies = [f"{stamp} (copy {i}) {DEMO_DOCUMENT}" for i in range(timed_requests)]
    twins = [f"{stamp} (fetched copy {i}) {DEMO_DOCUMENT}" for i in range(timed_requests)]
    log_name = f"{tag}-publisher"
    log = cluster.run_dir / "logs" / f"{log_name}.log"
    # The log is appended to by every run in this run directory: only this publisher's READY counts (an
    # earlier run's sent the subscriber off before the document was published, and it located nothing).
    earlier = log.stat().st_size if log.exists() else 0
    argv = publisher_argv("edge-a", "/keys/pub-a", warmup, *DEMO_MODEL)
    for document in copies + twins:
        argv += ["--prompt", document]
    publisher = cluster.spawn("pub-a", argv, log_name)
    try:
        deadline = time.monotonic() + PUBLISHER_READY_S
        while b"READY" not in log.read_bytes()[earlier:]:
            if publisher.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"demo publisher not serving:\n{cluster.diagnostics([log_name])}")
            time.sleep(0.5)
        logger.info("pub-a published the documents; asking for them at sub-b")
        prompts = [warmup + DEMO_QUESTION] + [copy + DEMO_QUESTION for copy in copies]
        first_contact, *chosen = _subscribe(cluster, prompts, *DEMO_MODEL, "--verify")
        named = [("first contact", first_contact)] + [(f"ABR, copy {i}", r) for i, r in enumerate(chosen)]
        for name, report in named:
            shown = {k: report[k] for k in ("remote_hit_tokens", "abr", "abandoned", "timings")}
            logger.info("%s: %s", name, json.dumps(shown))
        fetched = chosen
        if not all(fetched_whole(report) for report in chosen):
            fetched = _subscribe(cluster, [twin + DEMO_QUESTION for twin in twins], *DEMO_MODEL, "--verify",
                                 "--abr", "fetch")
        _, *recomputed = _subscribe(cluster, prompts, *DEMO_MODEL, "--abr", "recompute")
    finally:
        stop_process(publisher)
    demo = WanDemo(chosen, fetched, recomputed, first_contact)
    context = (f"\nchosen: {json.dumps(chosen)}\nfetched: {json.dumps(fetched)}"
               f"\nrecomputed: {json.dumps(recomputed)}")
    for report in fetched:
        if report["remote_hit_tokens"] <= 0:
            raise ClusterError("the shared prefix was not fetched" + context)
        if report["abandoned"] is not None or report["fallback"]:
            raise ClusterError("the fetch fell back to recomputing" + context)
        if report.get("verified") is not True:
            raise ClusterError("a fetched request's output is not verified" + context)
    for report in chosen:
        if report["remote_hit_tokens"] > 0 and report.get("verified") is not True:
            raise ClusterError("the ABR's request loaded a prefix but its output is not verified" + context)
    return demo
