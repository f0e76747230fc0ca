"""KV ABR: per block, fetch which rendition, or recompute locally.

Owns: the estimators (network throughput, round-trip time, local prefill speed, per-rendition size ratio and
decode speed) and the decision function. It knows nothing about QUIC, MoQT or torch: callers feed it
measurements (bytes and seconds) and ask for a plan; the plan records its inputs so they can be reported.

The decision. Blocks form a chain, and a fetched block is only useful if every block before it is present, so
the plan is "fetch blocks [0, k) and recompute the rest". For each block the cheapest acceptable rendition is
the one with the smallest estimated ``bytes / throughput + decode time`` (ties go to the higher quality), so a
fast link takes ``plain`` (every byte, decoded by a copy) and a slow one ``lossless`` (fewer bytes, zstd to
undo), each weighed with the throughput and decode speeds this node measured. The cut ``k`` minimises::

    T(k) = (rtt + first_byte if k > 0) + sum(fetch_i for i < k) + prefill(tokens_total - k * block_size)

with ``prefill(n) = overhead + n * per_token`` measured on this machine and ``first_byte`` the relay's
learned delay before a FETCH's first object beyond the round trip (``FirstByteEstimator``: a relay that
answers a FETCH only once it has the whole block from upstream delivers it late but whole; that wait is a
fixed cost per fetch, not the link's throughput, which is timed from the first object on). This is an
exact argmin over every cut, O(n), so uneven block sizes are handled. While a fetch runs it is re-planned
with its own measured rate (``FetchDeadline.overtaken``, below), which is what video ABR does per segment.

The estimates age: every sample takes at least a fixed share of an average (``Ewma.min_share``) and
older samples lose weight with time (``Ewma.time_half_life_s``), so what was measured recently counts
most. Only clean transfers are samples (``kvnet.exchange.fetching``: blocks loaded before any retry or
failure). An estimate can still be wrong in the direction that stops it being measured: a pessimistic
throughput declines every hit and so fetches nothing that would correct it. So a plan that declines
located blocks is counted (``declined_streak``), and after ``probe_after`` declining plans in a row (or
``probe_after_s`` without a throughput sample) the next one fetches ``probe_blocks`` blocks anyway, a
probe whose measurement replaces the throughput estimate (``KvAbr.fetch_measured``). A probe costs at
most the fetch of a few blocks more than recomputing them, and bounds how long a wrong estimate lasts.

Fetch and compute at once (Cake, ICML 2025). The engine can compute the head of the located prefix while the
tail is fetched, the two meeting in the middle; the suffix after the prefix is prefilled once both are done.
With the head ``[0, k)`` computed and ``[k, f)`` fetched, the plan's estimate is::

    T_split(k) = max(prefill(k * block_size), rtt + first_byte + sum(fetch_i for k <= i < f)) + prefill(rest)

``f`` is every located block with an acceptable rendition: moving a block out of the serial ``rest`` into
the parallel part never costs more than computing it there (give the head one more block instead). ``k``
balances the two sides (``best_split``; an O(f) scan with prefix sums) and the split is chosen only where
it beats both the fetch cut above and recomputing everything by ``SPLIT_MIN_GAIN``. Both sides are costed
as they run beside each other, measured apart from plain fetches and prefills (``head_prefill``,
``tail_throughput``): on a CPU node they share the cores. A node whose only throughput samples are a split's
tails costs a whole fetch at their rate too, not at the prior: a rate measured beside compute is at most
the path's, but it is a measurement and the prior a guess (a node's first request split, its tail came at
4 MB/s over a WAN, and its second planned a whole fetch at the 100 MB/s prior and took 2.1x recomputing);
if the head's forwards were what slowed the tail, the plans it declines lead to a probe, which measures
the path alone. A plan that splits declines nothing, so such a node whose split beats that whole fetch
by less than ``WHOLE_PROBE_GAIN`` fetches everything once instead (a probe, ``AbrPlan.probe``): the gain
may be no more than the tail's rate standing for the path's (SmolLM2 on 2 AMX cores, 300 MB/s link:
tails came at 57-73 MB/s, whole fetches at 84-97, and the splits planned against the tails' rate took
1.03x fetching everything). A tail measured faster than the whole fetches were also raises their
estimate to its rate: a node whose only whole fetch was its first, on a fresh connection (the ``bench``
preset, 300 MB/s link: 62-67 MB/s), and whose splits' tails came faster kept costing a whole fetch at the
first rate and kept splitting, 1.11x fetching everything. Before the first split was measured, a node whose
forwards leave no core for decoding (``decode_beside_compute``) charges the head what the tail's decoding
takes (``decode_i``, raw bytes over the rendition's decode rate) while the tail's bytes still cross the
network beside it: ``max(prefill(k * block_size) + sum(decode_i for k <= i < f), ...)``. That is next to
nothing for lossless, and most of kvtc's cost. The split is a starting point, not a commitment: the node
moves the meeting point as the two sides actually progress (``kvnet.node.overlap``).

Whatever the estimates said, a fetch also has one deadline (``FetchDeadline``): it may take at most
``deadline_margin_s`` plus the relay's learned first-byte delay plus the estimated recompute time of the
blocks it has already delivered. Past that, finishing it can only be slower than recomputing the rest, so
it is abandoned, however the relay paces its objects (a relay trickling one object just inside the
per-object timeout cannot hold a request). The first-byte delay is capped (``FIRST_BYTE_CAP_S``, or the
session's fetch timeout), and a fetch abandoned before any object arrived teaches the estimator that the
delay is at least what it waited, so a late relay is learned within a few requests and a silent one costs
the cap at most, after which the plan recomputes rather than wait for it.

The deadline is also anticipated. While the fetch runs, a timer reads the rate it achieves
(``MeasuredRate``) and re-plans the blocks still to come (``FetchDeadline.overtaken``): where even at 1.5x
that rate the last block would miss its due time and waiting for the rest costs more than recomputing it,
the fetch is given up at once. A fresh node plans with the throughput prior (nothing measured yet); on a
path ten times slower than the prior that finds out within a few hundred milliseconds instead of after the
whole margin, and the abandoned fetch's bytes become the sample the next plan uses.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

logger = logging.getLogger(__name__)

RECOMPUTE = "recompute"
WHOLE_PROBE_GAIN = 0.2
"""A node that measured fetches only as split tails fetches everything once (a probe of the path alone)
rather than split where the split is estimated less than this much faster (a fraction) than that whole
fetch costed at the tails' rate: a fetch beside the head's forwards ran 1.3-1.5x slower than alone on 2
cores, so a gain below that may be the tails' rate standing in for the path's (module docstring)."""
SPLIT_MIN_GAIN = 0.1
"""A split plan must be estimated this much faster (a fraction) than the best plan without one: it costs a
second prefill's overhead and CPU that the fetch shares, and a near-tie gains nothing measurable."""
REPLAN_SLACK = 1.5
"""Factor in a running fetch's favour when it is re-planned (``FetchDeadline.overtaken``): a rate measured
over a fraction of a second is noisy, and a fetch nearly done must not be thrown away for one slow reading."""
# Higher quality first; a rendition not listed ranks after these, in name order. ``plain`` is exact like
# ``lossless`` (so accepting it lowers no floor); it ranks after it so that a tie in cost goes to the
# smaller payload (less for relays to cache and links to carry).
QUALITY_ORDER: tuple[str, ...] = ("lossless", "plain", "int8", "int4", "kvtc")
# Encoded size / raw size before anything was measured, by KV dtype. Measured on SmolLM2's KV (docs/
# performance.md, "Codec quality on real KV"): int8 and int4 are fixed fractions of the element size plus
# scales, so they save half as much on bf16 as on fp32, while bf16's short mantissas compress better
# losslessly. kvtc codes the same bytes whatever the dtype: 8.3x of bf16 measured at the calibration
# command's default step (docs/performance.md, "kvtc predicted from the layer before"), so about 16x of
# fp32.
# A dtype not listed uses the fp32 row.
DEFAULT_SIZE_RATIO: Mapping[str, Mapping[str, float]] = {
    "float32": {"lossless": 0.85, "plain": 1.0, "int8": 0.25, "int4": 0.14, "kvtc": 0.06},
    "bfloat16": {"lossless": 0.69, "plain": 1.0, "int8": 0.50, "int4": 0.28, "kvtc": 0.12},
    "float16": {"lossless": 0.90, "plain": 1.0, "int8": 0.50, "int4": 0.28, "kvtc": 0.12},
}
# Verify + decode speed (a layer's digest and its decode into the cache) in raw bytes per second before
# anything was measured; the node's own fetches replace these (``RenditionStats``). ``plain`` is a digest
# and a copy; with lossless at 1e9 the bf16 crossover is ~620 MB/s of link (docs/nodes.md, "Renditions").
DEFAULT_DECODE_BPS: Mapping[str, float] = {
    "lossless": 1.0e9, "plain": 2.0e9, "int8": 6.0e8, "int4": 4.0e8,
    # kvtc's rANS decode runs symbol by symbol on one CPU thread, then each layer is rebuilt from the one
    # before: ~22 MB/s of raw KV on SmolLM2 at load 1 (docs/performance.md, "kvtc predicted from the layer
    # before"); 18 allows for a busier node. With lossless's size and speed, kvtc then wins on bf16 links
    # below ~11 MB/s.
    "kvtc": 1.8e7,
}


def quality_rank(rendition: str) -> tuple[int, str]:
    try:
        return (QUALITY_ORDER.index(rendition), rendition)
    except ValueError:
        return (len(QUALITY_ORDER), rendition)


@dataclass(frozen=True)
class AbrConfig:
    """Knobs of the KV ABR."""

    acceptable: tuple[str, ...] = ("lossless",)
    """Renditions whose quality is acceptable; lossless only unless configured otherwise."""
    prior_throughput_bps: float = 100e6
    """Throughput in bytes/s assumed before the first measurement."""
    prior_rtt_s: float = 0.002
    """Round-trip time assumed before the first measurement."""
    safety: float = 0.9
    """Fraction of the estimated throughput the plan relies on (estimates are noisy)."""
    allow_recompute: bool = True
    """False forces fetching every located block (tests and benchmarks of the fetch path)."""
    force_recompute: bool = False
    """True never fetches (cold baseline)."""
    kv_dtype: str = "float32"
    """Element dtype of the KV blocks (names of ``kvnet.dtypes``): picks the size ratios assumed before any
    block was measured."""
    probe_after: int = 3
    """Plans in a row that decline located blocks after which the next one probes (fetches
    ``probe_blocks`` blocks whatever the estimates say, to measure the path again); 0 never probes."""
    probe_after_s: float = 30.0
    """A plan that declines located blocks also probes when the last throughput sample is older than this
    (seconds; 0: only ``probe_after`` counts)."""
    probe_blocks: int = 1
    """Blocks a probe fetches (the leading ones of the located prefix)."""
    overlap: bool = True
    """Plans may compute the head of the located prefix while fetching the tail (see the module
    docstring); False: fetch a prefix and recompute the rest, never both at once."""
    decode_beside_compute: bool = False
    """The node's forwards take every core its decoding of fetched layers needs (a CPU node whose torch
    threads and decode threads outnumber its cores): a split's head then pays for its tail's decoding,
    while the tail's bytes still cross the network beside it (``best_split``'s ``head_extra``), and
    computes ``shared_cores_head_slowdown`` times slower than alone. Decoding is a small part of lossless
    and plain; kvtc's rANS decode is most of its cost."""
    shared_cores_head_slowdown: float = 2.0
    """With ``decode_beside_compute``, how much longer a split's head takes than the same prefill alone,
    until a split was measured (``KvAbr.head_prefill``): the fetch's event loop (receive, verify, decode)
    takes a core from forwards whose threads wait on each other. Measured 1.75-2.2x for SmolLM2 in bfloat16
    on 2 AMX cores, tails fetched at 10-30 MB/s (docs/performance.md, "The head's chunk, measured per
    model")."""
    max_step_tokens: int | None = None
    """The engine's prompt tokens per forward (its step budget): a prefill of more takes more forwards, each
    with its fixed cost (``PrefillEstimator.max_step_tokens``), and a split's head runs in chunks of at
    most this (``KvAbr.head_chunk_tokens``). None: every prefill sample is one forward (vLLM's connector
    times forwards, not requests)."""
    deadline_margin_s: float = 1.0
    """Seconds a fetch may cost beyond the recompute time of the blocks it delivered before it is abandoned
    (``FetchDeadline``); bounds TTFT by recompute time plus this. Generous enough that a loaded machine's
    scheduling noise does not throw away a healthy fetch."""

    def __post_init__(self) -> None:
        if not self.acceptable:
            raise ValueError("acceptable: at least one rendition is required")
        if self.prior_throughput_bps <= 0:
            raise ValueError("prior_throughput_bps must be positive")
        if self.prior_rtt_s < 0:
            raise ValueError("prior_rtt_s must be >= 0")
        if not 0 < self.safety <= 1:
            raise ValueError("safety must be in (0, 1]")
        if not 0 < self.deadline_margin_s <= 3600:
            raise ValueError("deadline_margin_s must be in (0, 3600] seconds")
        if self.probe_after < 0:
            raise ValueError("probe_after must be >= 0")
        if self.probe_after_s < 0:
            raise ValueError("probe_after_s must be >= 0")
        if self.probe_blocks < 1:
            raise ValueError("probe_blocks must be >= 1")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError("max_step_tokens must be >= 1")
        if not 1.0 <= self.shared_cores_head_slowdown <= 100.0:
            raise ValueError("shared_cores_head_slowdown must be in [1, 100]")


class Ewma:
    """Exponentially weighted mean where each sample carries a weight (bytes, tokens), aged by weight, by
    count and by time.

    Weight-based decay (as in Shaka's estimator) keeps one huge transfer from being forgotten after a few
    small ones, and one tiny one from swinging the estimate. ``min_share``: every sample takes at least
    this share of the mean however small it is, so a handful of recent samples outweighs any history.
    ``time_half_life_s``: what was learned that long ago weighs half as much against a new sample.
    Kept as a weighted sum over a sum of weights (``value = S / W``), which is Shaka's zero-bias-corrected
    estimate when no time passes.
    """

    def __init__(self, half_life: float, min_share: float = 0.0, time_half_life_s: float = 0.0) -> None:
        if not 0 <= min_share < 1:
            raise ValueError("min_share must be in [0, 1)")
        self._alpha = math.log(0.5) / half_life
        self._min_share = min_share
        self._time_half_life_s = time_half_life_s
        self._sum = 0.0
        self._weight = 0.0
        self._last: float | None = None

    def add(self, weight: float, value: float, now: float | None = None) -> None:
        keep = min(math.exp(self._alpha * weight), 1 - self._min_share)
        if now is not None and self._last is not None and self._time_half_life_s > 0:
            keep *= 0.5 ** (max(now - self._last, 0.0) / self._time_half_life_s)
        if now is not None:
            self._last = now
        self._sum = keep * self._sum + (1 - keep) * value
        self._weight = keep * self._weight + (1 - keep)

    def value(self, default: float) -> float:
        return default if self._weight <= 0 else self._sum / self._weight

    @property
    def has_samples(self) -> bool:
        return self._weight > 0


@dataclass
class ThroughputEstimator:
    """Network throughput in bytes/s: the min of a fast and a slow EWMA (react to drops, not to spikes),
    both aged by time (``TIME_HALF_LIFE_S``) and count (each sample a minimum share)."""

    prior_bps: float
    clock: Callable[[], float] = time.monotonic
    fast: Ewma = field(default_factory=lambda: Ewma(256 * 1024, min_share=0.5, time_half_life_s=60.0))
    slow: Ewma = field(default_factory=lambda: Ewma(4 * 1024 * 1024, min_share=0.25, time_half_life_s=60.0))
    samples: int = 0
    last_sample_at: float | None = None
    """Clock reading of the latest sample (None before the first)."""

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        bps = nbytes / seconds
        now = self.clock()
        self.fast.add(nbytes, bps, now)
        self.slow.add(nbytes, bps, now)
        self.samples += 1
        self.last_sample_at = now

    def remeasure(self, nbytes: int, seconds: float) -> None:
        """Replace everything learned so far by this one measurement (a probe: see the module docstring)."""
        if nbytes <= 0 or seconds <= 0:
            return
        self.fast = Ewma(256 * 1024, min_share=0.5, time_half_life_s=60.0)
        self.slow = Ewma(4 * 1024 * 1024, min_share=0.25, time_half_life_s=60.0)
        self.add(nbytes, seconds)

    def estimate(self) -> float:
        if not self.fast.has_samples:
            return self.prior_bps
        return min(self.fast.value(self.prior_bps), self.slow.value(self.prior_bps))


@dataclass
class RttEstimator:
    """Smoothed round-trip time (RFC 6298 style, alpha = 1/8)."""

    prior_s: float
    srtt: float | None = None

    def add(self, seconds: float) -> None:
        if seconds < 0:
            return
        self.srtt = seconds if self.srtt is None else 0.875 * self.srtt + 0.125 * seconds

    def estimate(self) -> float:
        return self.prior_s if self.srtt is None else self.srtt


FIRST_BYTE_CAP_S = 10.0
"""The most a learned first-byte delay may be, in seconds (the node's default request timeout, after which a
FETCH that brought nothing has failed anyway): a relay that answers late, or never, cannot teach a node to
wait longer than that for a block (``FirstByteEstimator``)."""
PREFILL_SAMPLE_STEP = 1.5
"""The most a single prefill run can say the fit is off by (``PrefillEstimator.add``). Measured on SmolLM2
bf16 (2 AMX cores): one recompute took 2.02 s where the same request took 0.82 s in the next run, and taken
whole it moved the fit from 0.64 to 1.47 ms a token, so the next request split against a recompute it put
at 1.8 s (0.83 s in fact) and lost 50%."""
MAX_KEPT_SAMPLES = 4096
"""Samples a ``KvAbr`` keeps for another (``keep_samples``) while nobody takes them; the oldest go first."""
MAX_RELAYS_TRACKED = 64
"""Relays whose first-byte delay a node keeps at once; the one whose session began longest ago goes."""


@dataclass
class FirstByteEstimator:
    """How late one relay answers a FETCH: seconds from sending a block's FETCH to its first object beyond
    the round trip. A relay that serves a FETCH as its objects come answers within the RTT (about 0 here);
    one that first pulls the whole block from upstream (or answers only once it has all of it) delivers
    the block late but whole, a fixed cost per request that is not the link's throughput.

    The max of a fast and a slow per-fetch average, both aged by time like the throughput (a rise is
    believed at once, a fall once it holds), each sample clipped to ``cap_s`` first so a single stall
    cannot dominate, and the estimate capped at ``cap_s`` (``FIRST_BYTE_CAP_S`` unless told)."""

    cap_s: float = FIRST_BYTE_CAP_S
    clock: Callable[[], float] = time.monotonic
    fast: Ewma = field(default_factory=lambda: Ewma(2.0, min_share=0.5, time_half_life_s=60.0))
    slow: Ewma = field(default_factory=lambda: Ewma(16.0, min_share=0.1, time_half_life_s=60.0))
    samples: int = 0

    def add(self, seconds_beyond_rtt: float) -> None:
        if not math.isfinite(seconds_beyond_rtt):
            return
        value = min(max(seconds_beyond_rtt, 0.0), self.cap_s)
        now = self.clock()
        self.fast.add(1.0, value, now)
        self.slow.add(1.0, value, now)
        self.samples += 1

    def estimate(self) -> float:
        """Seconds beyond the RTT a FETCH waits for its first object (0 before the first sample)."""
        return min(self.cap_s, max(self.fast.value(0.0), self.slow.value(0.0)))


@dataclass
class PrefillEstimator:
    """Local prefill cost ``forwards(n) * overhead + n * per_token + pairs(n, context) * pair_s`` fitted by
    weighted least squares over the latest ``max_samples`` runs, each run weighing ``recency`` times the
    next one's (the newest weighs 1), so the fit follows a machine whose load changed.

    ``forwards(n) = ceil(n / max_step_tokens)``: the engine prefills at most ``max_step_tokens`` prompt tokens
    per forward (its step budget), and every forward pays the fixed cost again. That cost is the model's:
    a few ms on the ``small`` preset, ~70 ms for SmolLM2 in bfloat16 on an AMX CPU (reading every weight
    once per forward), where 576 tokens took 0.45 s in two forwards and a fit without the count of forwards,
    made from single-forward runs, predicted 0.24 s. None: every run is one forward.

    ``pairs(n, context)``: the (query, key) pairs between each forward's tokens and the keys cached before
    that forward (the ``context`` before the run, and the run's earlier forwards). That is the part of a
    prefill that grows with the context: on the ``bench`` preset (one AMX core, float32) 512 tokens took
    1.31 s from the prompt's start and 1.74 s after 1,536 cached tokens, and a fit without it put 1,024
    tokens from the start at 2.1 s (2.7 in fact) and the suffix after a fetched prefix at what the same
    tokens cost alone. Attention within a forward is left in its per-token cost: a run of one forward from
    the start has no pairs, so calibration's single-forward runs fit the line, and its run of two forwards
    pins ``pair_s``. Only calibration's runs (``add(..., whole=True)``) set it (0 until then): a pair costs
    the same whatever the host's load does to the rest, and one slowed run after a long context, fitted
    freely, made it 5x what it was."""

    per_token_s: float = 1e-3
    overhead_s: float = 0.0
    """Seconds each forward costs besides its tokens."""
    pair_s: float = 0.0
    """Seconds per (query, key) pair of attention (``pairs``)."""
    max_samples: int = 32
    recency: float = 0.8
    max_step_tokens: int | None = None
    _samples: list[tuple[int, int, float]] = field(default_factory=list)
    _calibration: list[tuple[int, int, float]] = field(default_factory=list)
    """Calibration's runs (the latest ``max_samples``), which alone fit ``pair_s``."""
    _last_outlier: int = 0
    """+1 / -1: the last run was more than ``PREFILL_SAMPLE_STEP`` slower / faster than the fit; 0: not."""

    def forwards(self, tokens: int) -> int:
        """Forwards the engine runs to prefill ``tokens`` prompt tokens alone."""
        return 1 if self.max_step_tokens is None else max(-(-tokens // self.max_step_tokens), 1)

    def pairs(self, tokens: int, context: int = 0) -> float:
        """(query, key) pairs between each forward's tokens and the keys cached before it, for ``tokens``
        prompt tokens after ``context`` cached ones in forwards of ``max_step_tokens``."""
        step = self.max_step_tokens or max(tokens, 1)
        total, done = 0, 0
        while done < tokens:
            chunk = min(step, tokens - done)
            total += chunk * (context + done)
            done += chunk
        return float(total)

    def add(self, tokens: int, seconds: float, whole: bool = False, context: int = 0) -> None:
        """A run of ``tokens`` after ``context`` cached ones took ``seconds``. Once the fit stands on two
        runs, a run more than ``PREFILL_SAMPLE_STEP`` times slower or faster than the fit says is taken as
        that step only, unless the run before it was off in the same direction: one run the host slowed
        (its other work, a first forward of a new shape) moves the estimate a little, and a machine whose
        speed really changed is followed from its second run on. ``whole``: taken as it is (calibration's
        runs, whose sizes are chosen to pin the fit down)."""
        if tokens <= 0 or seconds <= 0 or context < 0:
            return
        if len(self._samples) >= 2 and not whole:
            expected = self.estimate(tokens, context)
            low, high = expected / PREFILL_SAMPLE_STEP, expected * PREFILL_SAMPLE_STEP
            direction = (seconds > high) - (seconds < low)
            if direction and direction != self._last_outlier:
                seconds = min(max(seconds, low), high)
            self._last_outlier = direction
        self._samples.append((tokens, context, seconds))
        del self._samples[: -self.max_samples]
        if whole:
            self._calibration.append((tokens, context, seconds))
            del self._calibration[: -self.max_samples]
            self._fit_attention()
        self._refit()

    def _fit_attention(self) -> None:
        """``pair_s`` from calibration's runs, fitted with a forward's and a token's cost, when they include
        runs with pairs and the fit is all positive (else it stays)."""
        runs = self._calibration
        if len(runs) < 3 or not any(self.pairs(n, c) for n, c, _ in runs):
            return
        rows = [(float(self.forwards(n)), float(n), self.pairs(n, c)) for n, c, _ in runs]
        fit = _weighted_least_squares(rows, [s for _, _, s in runs], [1.0] * len(runs))
        if fit is not None and fit[0] >= 0 and fit[1] > 0 and fit[2] >= 0:
            self.pair_s = fit[2]

    def _refit(self) -> None:
        count = len(self._samples)
        ws = [self.recency ** (count - 1 - i) for i in range(count)]
        rows = [(float(self.forwards(n)), float(n)) for n, _, _ in self._samples]
        # Attention to cached keys at calibration's rate; the rest is fitted as forwards and tokens.
        ys = [s - self.pair_s * self.pairs(n, c) for n, c, s in self._samples]
        fit = _weighted_least_squares(rows, ys, ws) if count >= 2 else None
        if fit is not None and fit[1] > 0 and fit[0] >= 0:
            self.overhead_s, self.per_token_s = fit
            return
        # One size seen, or a fit with a negative term (runs of close sizes, one of them slowed by load,
        # make the least-squares slope swing several-fold): the fixed cost stays what the last valid fit
        # said (calibration runs are of sizes far apart), and the rest is per token.
        fs, ns = [row[0] for row in rows], [row[1] for row in rows]
        total = sum(ws)
        mean_f = sum(w * f for w, f in zip(ws, fs, strict=True)) / total
        mean_n = sum(w * n for w, n in zip(ws, ns, strict=True)) / total
        mean_y = sum(w * y for w, y in zip(ws, ys, strict=True)) / total
        overhead = max(min(self.overhead_s, min(y / f for y, f in zip(ys, fs, strict=True))), 0.0)
        if mean_y <= overhead * mean_f:
            overhead = 0.0
        self.per_token_s, self.overhead_s = max(mean_y - overhead * mean_f, 0.0) / mean_n, overhead

    def estimate(self, tokens: int, context: int = 0) -> float:
        """Seconds to prefill ``tokens`` prompt tokens after ``context`` cached ones."""
        if tokens <= 0:
            return 0.0
        return (self.forwards(tokens) * self.overhead_s + tokens * self.per_token_s
                + self.pairs(tokens, context) * self.pair_s)

    @property
    def has_samples(self) -> bool:
        return bool(self._samples)

    @property
    def samples(self) -> tuple[tuple[int, int, float], ...]:
        """The runs the fit is over, oldest first: ``(tokens, context, seconds)``."""
        return tuple(self._samples)


def _weighted_least_squares(
    rows: Sequence[Sequence[float]], ys: Sequence[float], ws: Sequence[float]
) -> tuple[float, ...] | None:
    """The coefficients minimising ``sum(w * (y - row . x) ** 2)`` (no intercept), or None when the rows do
    not determine them: a pivot of the normal equations, scaled to a unit diagonal, under 1e-9 (features
    collinear over these runs, e.g. every run of one size)."""
    k = len(rows[0])
    a = [[sum(w * r[i] * r[j] for w, r in zip(ws, rows, strict=True)) for j in range(k)] for i in range(k)]
    b = [sum(w * r[i] * y for w, r, y in zip(ws, rows, ys, strict=True)) for i in range(k)]
    if min(a[i][i] for i in range(k)) <= 0:
        return None
    # Scaled to a unit diagonal (forwards, tokens and pairs differ by orders of magnitude), the matrix is
    # symmetric positive semi-definite: elimination needs no pivoting, and its pivots measure independence.
    d = [math.sqrt(a[i][i]) for i in range(k)]
    a = [[a[i][j] / (d[i] * d[j]) for j in range(k)] for i in range(k)]
    b = [b[i] / d[i] for i in range(k)]
    for col in range(k):
        if a[col][col] <= 1e-9:
            return None
        for r in range(col + 1, k):
            factor = a[r][col] / a[col][col]
            for j in range(col, k):
                a[r][j] -= factor * a[col][j]
            b[r] -= factor * b[col]
    x = [0.0] * k
    for i in reversed(range(k)):
        x[i] = (b[i] - sum(a[i][j] * x[j] for j in range(i + 1, k))) / a[i][i]
    return tuple(x[i] / d[i] for i in range(k))


@dataclass
class RenditionStats:
    """Per rendition: encoded/raw size ratio and verify + decode speed (raw bytes per second of the node's
    digest checks and decodes of a block's layers), learned from the blocks this node fetched. Each is a
    per-block average aged like the throughput (``Ewma``): a half-life of 8 blocks and of
    ``TIME_HALF_LIFE_S`` seconds, so the latest blocks decide (a host whose load changed is re-measured
    within a prompt or two)."""

    kv_dtype: str = "float32"
    clock: Callable[[], float] = time.monotonic
    ratio: dict[str, Ewma] = field(default_factory=dict)
    decode: dict[str, Ewma] = field(default_factory=dict)

    TIME_HALF_LIFE_S: ClassVar[float] = 60.0

    def add(self, rendition: str, raw_bytes: int, encoded_bytes: int, decode_s: float) -> None:
        if raw_bytes <= 0:
            return
        now = self.clock()
        self.ratio.setdefault(rendition, self._average()).add(1.0, encoded_bytes / raw_bytes, now)
        if decode_s > 0:
            self.decode.setdefault(rendition, self._average()).add(1.0, raw_bytes / decode_s, now)

    def _average(self) -> Ewma:
        return Ewma(8.0, time_half_life_s=self.TIME_HALF_LIFE_S)

    def size_ratio(self, rendition: str) -> float:
        priors = DEFAULT_SIZE_RATIO.get(self.kv_dtype, DEFAULT_SIZE_RATIO["float32"])
        default = priors.get(rendition, 1.0)
        e = self.ratio.get(rendition)
        return default if e is None else e.value(default)

    def decode_bps(self, rendition: str) -> float:
        default = DEFAULT_DECODE_BPS.get(rendition, 5e8)
        e = self.decode.get(rendition)
        return default if e is None else e.value(default)


@dataclass(frozen=True, slots=True)
class BlockChoice:
    """What the plan does with one located block."""

    index: int
    action: str
    """A rendition name, or ``recompute``."""
    fetch_s: float
    """Estimated time to fetch and decode it with the best acceptable rendition."""
    recompute_s: float
    """Estimated marginal prefill time of its tokens."""
    best: str | None = None
    """The best acceptable rendition on offer whatever the action (None: none acceptable); what a fetch
    that takes more than its planned share asks for."""


@dataclass(frozen=True)
class AbrPlan:
    """The decision for one prompt and the inputs it was made from."""

    choices: tuple[BlockChoice, ...]
    fetch_blocks: int
    """Blocks [0, fetch_blocks) are fetched; the rest of the prompt is recomputed."""
    throughput_bps: float
    rtt_s: float
    prefill_per_token_s: float
    prefill_overhead_s: float
    est_total_s: float
    est_recompute_all_s: float
    declined_blocks: int = 0
    """Located blocks with an acceptable rendition that the estimates chose to recompute instead."""
    probe: bool = False
    """Blocks are fetched although the estimates declined them: a probe (see the module docstring)."""
    compute_blocks: int = 0
    """Blocks [0, compute_blocks) are computed by the engine while [compute_blocks, fetch_blocks) are
    fetched (0: no split). The node moves this meeting point as the two sides progress."""
    first_byte_s: float = 0.0
    """The relay's first-byte delay beyond the RTT the plan charged each fetch (``FirstByteEstimator``)."""
    prefill_pair_s: float = 0.0
    """The prefill's price of attention to a cached key (``PrefillEstimator.pair_s``)."""

    def rendition_of(self, index: int) -> str:
        return self.choices[index].action

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for c in self.choices:
            counts[c.action] = counts.get(c.action, 0) + 1
        return {
            "fetch_blocks": self.fetch_blocks,
            "compute_blocks": self.compute_blocks,
            "actions": counts,
            "inputs": {
                "throughput_bps": round(self.throughput_bps, 1),
                "rtt_s": round(self.rtt_s, 6),
                "first_byte_s": round(self.first_byte_s, 6),
                "prefill_per_token_s": self.prefill_per_token_s,
                "prefill_overhead_s": round(self.prefill_overhead_s, 6),
                "prefill_pair_s": self.prefill_pair_s,
            },
            "est_total_s": round(self.est_total_s, 6),
            "est_recompute_all_s": round(self.est_recompute_all_s, 6),
            "declined_blocks": self.declined_blocks,
            "probe": self.probe,
        }

    def describe_decline(self) -> str:
        """One line saying what was declined and from which inputs (for the log)."""
        inputs = self.to_json()["inputs"]
        return (
            f"declined {self.declined_blocks} located block(s): estimated {self.est_total_s:.4f}s fetching "
            f"{self.fetch_blocks} vs {self.est_recompute_all_s:.4f}s recomputing all; inputs "
            + " ".join(f"{k}={v}" for k, v in inputs.items())
        )


def best_split(
    fetch_costs: Sequence[float], rtt_s: float, head_cost: Callable[[int], float],
    head_extra: Sequence[float] | None = None,
) -> tuple[int, float]:
    """Where computing ``[0, k)`` while fetching ``[k, n)`` of ``n`` blocks finishes soonest: ``(k, T)``
    with ``T = max(head_cost(k) + sum(head_extra[k:]), rtt + sum(fetch_costs[k:]))`` (no fetch, no round
    trip, for ``k = n``). ``head_extra``: what each tail block's decoding takes from the head's cores
    (``AbrConfig.decode_beside_compute``), none by default.

    The head's cost grows with ``k`` and the fetch's shrinks, so ``T`` is their crossing; every ``k`` is
    scanned anyway (O(n), exact for uneven costs). Ties go to the smaller ``k``: fetching saves compute
    for everyone on the node. An infinite cost (no acceptable rendition) forces the head past that block.
    """
    n = len(fetch_costs)
    tail = [0.0] * (n + 1)  # tail[k] = sum(fetch_costs[k:])
    extra = [0.0] * (n + 1)  # extra[k] = sum(head_extra[k:])
    for i in range(n - 1, -1, -1):
        tail[i] = tail[i + 1] + fetch_costs[i]
        extra[i] = extra[i + 1] + (head_extra[i] if head_extra is not None else 0.0)
    best_k, best_t = n, head_cost(n)
    for k in range(n):
        t = max(head_cost(k) + extra[k], rtt_s + tail[k])
        if t < best_t:
            best_k, best_t = k, t
    return best_k, best_t


@dataclass(frozen=True, slots=True)
class FetchDeadline:
    """When a fetch must have delivered each block: block ``i`` (0-based) is due at
    ``started + margin_s + first_byte_s + (i + 1) * block_recompute_s``, so the time spent never exceeds
    what the delivered blocks save by more than the margin and the relay's learned first-byte delay. Block
    ``i`` is credited with its own recompute time: due at the margin alone, the first block of a WAN fetch
    (a round trip plus a MB or more) would be abandoned even where fetching the prefix is many times faster
    than recomputing it. The first-byte delay is a fixed cost of the request, paid once whatever the
    prefix's length, that the plan already weighed (``KvAbr.fetch_latency_s``): charged to the first block
    alone it would abandon every fetch through a relay that answers late but whole."""

    started: float
    """Clock reading (the event loop's) when the fetch began."""
    margin_s: float
    block_recompute_s: float
    """Estimated prefill time of one block's tokens on this node."""
    first_byte_s: float = 0.0
    """The relay's learned first-byte delay beyond the RTT (``FirstByteEstimator``, capped)."""

    def due(self, loaded_blocks: int) -> float:
        """Clock reading by which block ``loaded_blocks`` must be in (with ``loaded_blocks`` before it)."""
        return self.started + self.margin_s + self.first_byte_s + (loaded_blocks + 1) * self.block_recompute_s

    def describe(self, loaded_blocks: int, now: float) -> str:
        """Why the fetch was abandoned at block ``loaded_blocks`` at time ``now``."""
        return (
            f"deadline: {now - self.started:.3f}s spent with {loaded_blocks} block(s) delivered, past the "
            f"{(loaded_blocks + 1) * self.block_recompute_s:.3f}s recomputing them and the block awaited "
            f"would take plus the {self.margin_s:.3f}s margin and the relay's {self.first_byte_s:.3f}s "
            "first-byte delay; recomputing is faster than waiting"
        )

    def overtaken(
        self, now: float, last_block: int, remaining_blocks: int, remaining_bytes: float, rate_bps: float
    ) -> str | None:
        """The mid-fetch re-plan: why the ``remaining_blocks`` not yet in (``remaining_bytes`` still to come)
        should be given up at ``now``, judged by the fetch's own measured ``rate_bps``; None to go on.

        Two conditions, each with ``REPLAN_SLACK`` in the fetch's favour: even at that multiple of the
        measured rate the last block (``last_block``) would miss its due time, so the deadline would end
        the fetch anyway; and waiting for the rest costs more than recomputing it, so every block delivered
        before then would have cost more than it saves. Abandoning now rather than at the deadline saves
        the difference. The rate is what this fetch achieves, not the estimate the plan used: a fresh node
        plans with a prior, and a path several times slower than it is found within a fraction of a second
        instead of after the whole margin."""
        if rate_bps <= 0 or remaining_blocks <= 0:
            return None
        wait = remaining_bytes / rate_bps
        recompute = remaining_blocks * self.block_recompute_s
        if now + wait / REPLAN_SLACK <= self.due(last_block) or wait <= REPLAN_SLACK * recompute:
            return None
        return (
            f"re-planned after {now - self.started:.3f}s: at the {rate_bps / 1e6:.2f} MB/s this fetch "
            f"measured, its {remaining_blocks} block(s) still to come would take {wait:.3f}s against "
            f"{recompute:.3f}s recomputing them, past the deadline; recomputing is faster than waiting"
        )


class MeasuredRate:
    """A running fetch's own rate, read by a timer (``FetchDeadline.overtaken``'s input): bytes since the
    first reading that saw any, over the time since then, or over the last ``window_s`` if that is faster.

    The faster of the two, because both err low in one case: the whole-fetch average while a fresh
    connection's congestion window still opens (its last round trips are the path's), the recent window
    when a loaded host's scheduler paused the receiver. No rate (None) before ``min_observed_s`` has passed
    since the first bytes, and none while nothing arrives at all: a silent relay is the deadline's to judge
    (``FetchDeadline.due``), not a rate of zero."""

    def __init__(self, window_s: float, min_observed_s: float) -> None:
        self.window_s = window_s
        self.min_observed_s = min_observed_s
        self._first: tuple[float, int] | None = None
        self._readings: deque[tuple[float, int]] = deque()

    def observe(self, now: float, nbytes: int) -> float | None:
        """Record that ``nbytes`` had arrived in all by ``now``; the rate in bytes/s, or None (see above)."""
        if self._first is None:
            if nbytes <= 0:
                return None
            self._first = (now, nbytes)
        self._readings.append((now, nbytes))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self.window_s:
            self._readings.popleft()
        t0, b0 = self._first
        if now - t0 < self.min_observed_s:
            return None
        average = (nbytes - b0) / (now - t0)
        t1, b1 = self._readings[0]
        recent = (nbytes - b1) / (now - t1) if now > t1 else 0.0
        rate = max(average, recent)
        return rate if rate > 0 else None


AbrSampleKind = Literal["throughput", "rtt", "first_byte", "rendition", "prefill"]


@dataclass(frozen=True, slots=True)
class AbrSample:
    """One measurement as a ``KvAbr`` took it, for another ``KvAbr`` to take too (``KvAbr.absorb``).

    An engine whose plans and transfers run in different processes (vLLM: its scheduler plans, its worker
    fetches and runs the forwards) keeps the worker's samples (``KvAbr.keep_samples``) and replays them into
    the scheduler's estimators, so both age and weigh them alike. ``values`` are the arguments of the
    ``KvAbr`` method named after ``kind`` (``throughput`` is ``fetch_measured``; the others
    ``<kind>_measured``); plain numbers and strings, so the sample crosses a process boundary as it is."""

    kind: AbrSampleKind
    values: tuple[float | int | str, ...]


@dataclass
class KvAbr:
    """Estimators plus the decision; one per node, so measurements carry over between requests.

    Every sample comes in through a ``*_measured`` method (``fetch_measured`` for throughput): fetches call
    them, and ``absorb`` replays samples another ``KvAbr`` kept."""

    config: AbrConfig = field(default_factory=AbrConfig)
    throughput: ThroughputEstimator = field(init=False)
    rtt: RttEstimator = field(init=False)
    prefill: PrefillEstimator = field(init=False)
    head_prefill: PrefillEstimator = field(default_factory=PrefillEstimator)
    """The prefill of a head computed while its tail is fetched (``kvnet.node.overlap``), apart from
    ``prefill``: on a CPU engine the fetch's event loop (receive, verify, decode) takes cores the forwards
    would use (a head ran at half its speed alone on 2 cores), which a plan must know before it splits
    again, and which must not make plain recomputes look slower. ``prefill`` stands in until the first
    split is measured."""
    tail_throughput: ThroughputEstimator = field(init=False)
    """The throughput of a tail fetched while its head computes, apart from ``throughput`` for the same
    reason as ``head_prefill``: on a CPU node the head's forwards take the cores the fetch's receive,
    verify and decode need (over a 3 MB/s WAN path on 2 cores a tail came at 0.8 MB/s beside its head, and
    the split took 3.6x fetching everything), which a plan must know before it splits again, and which must
    not make plain fetches look slower. ``throughput`` stands in until the first split is measured."""
    renditions: RenditionStats = field(init=False)

    clock: Callable[[], float] = time.monotonic
    declined_streak: int = field(default=0, init=False)
    """Plans in a row that declined located blocks (reset by a plan that fetched them all, or a probe)."""
    declined_plans: int = field(default=0, init=False)
    """Plans that declined located blocks (monotonic; exported as a metric)."""
    declined_blocks: int = field(default=0, init=False)
    """Located blocks declined, over all plans (monotonic)."""
    probes: int = field(default=0, init=False)
    """Plans that probed (monotonic)."""
    skipped_locates: int = field(default=0, init=False)
    """Requests that did not look for remote blocks because no plan could fetch any (``skip_locate``)."""
    first_byte: dict[str, FirstByteEstimator] = field(default_factory=dict, init=False)
    """Per relay (its URL): how late it answers a FETCH beyond the RTT (``first_byte_of``)."""
    _probe_pending: bool = field(default=False, init=False)
    _kept: deque[AbrSample] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.prefill = PrefillEstimator(max_step_tokens=self.config.max_step_tokens)
        self.renditions = RenditionStats(kv_dtype=self.config.kv_dtype, clock=self.clock)
        self.throughput = ThroughputEstimator(self.config.prior_throughput_bps, self.clock)
        self.tail_throughput = ThroughputEstimator(self.config.prior_throughput_bps, self.clock)
        self.rtt = RttEstimator(self.config.prior_rtt_s)

    def keep_samples(self, limit: int = MAX_KEPT_SAMPLES) -> None:
        """From now on also keep every sample taken (the newest ``limit``) for ``take_samples``."""
        self._kept = deque(maxlen=limit)

    def take_samples(self) -> tuple[AbrSample, ...]:
        """The samples kept since the last call, oldest first (none unless ``keep_samples`` was called).

        Safe against samples taken meanwhile on another thread (a deque's appends and pops are atomic):
        vLLM's worker takes its fetch loop's samples on its forward thread."""
        kept = self._kept
        if kept is None:
            return ()
        return tuple(kept.popleft() for _ in range(len(kept)))

    def absorb(self, samples: Sequence[AbrSample]) -> None:
        """Take ``samples`` (another ``KvAbr``'s ``take_samples``) as if measured here, in order; a sample
        of an unknown kind or with values of the wrong types is dropped (it crossed a process boundary)."""
        for sample in samples:
            try:
                self._ABSORB[sample.kind](self, *sample.values)
            except (KeyError, TypeError):
                logger.debug("dropped an ABR sample that cannot be taken: %r", sample)

    def _keep(self, kind: AbrSampleKind, *values: float | int | str) -> None:
        if self._kept is not None:
            self._kept.append(AbrSample(kind, values))

    def fetch_measured(self, nbytes: int, seconds: float, beside_compute: bool = False) -> None:
        """A clean transfer's throughput sample; the first after a probe replaces the estimate.
        ``beside_compute``: the tail of a split, fetched while its head computed (``tail_throughput``)."""
        self._keep("throughput", nbytes, seconds, beside_compute)
        if beside_compute:
            self.tail_throughput.add(nbytes, seconds)
        elif self._probe_pending:
            self._probe_pending = False
            self.throughput.remeasure(nbytes, seconds)
        else:
            self.throughput.add(nbytes, seconds)

    def rtt_measured(self, seconds: float) -> None:
        """A round trip: a request sent to its first answer."""
        self._keep("rtt", seconds)
        self.rtt.add(seconds)

    def first_byte_measured(self, relay: str, cap_s: float, seconds_beyond_rtt: float) -> None:
        """How late ``relay`` answered a FETCH beyond the round trip (``FirstByteEstimator``; ``cap_s`` is
        the estimator's cap if this relay is new here)."""
        self._keep("first_byte", relay, cap_s, seconds_beyond_rtt)
        estimator = self.first_byte.get(relay)
        if estimator is None:
            estimator = self.first_byte_of(relay, cap_s)
        estimator.add(seconds_beyond_rtt)

    def rendition_measured(self, rendition: str, raw_bytes: int, encoded_bytes: int, decode_s: float) -> None:
        """One fetched block's size on the wire and its verify + decode time (``RenditionStats``)."""
        self._keep("rendition", rendition, raw_bytes, encoded_bytes, decode_s)
        self.renditions.add(rendition, raw_bytes, encoded_bytes, decode_s)

    def prefill_measured(
        self, tokens: int, seconds: float, calibration: bool = False, context: int = 0
    ) -> None:
        """A prefill of ``tokens`` prompt tokens after ``context`` cached ones took ``seconds``
        (``PrefillEstimator``); ``calibration``: a run of the node's start-up calibration, taken whole."""
        self._keep("prefill", tokens, seconds, calibration, context)
        self.prefill.add(tokens, seconds, whole=calibration, context=context)

    _ABSORB: ClassVar[Mapping[str, Callable[..., None]]] = {
        "throughput": fetch_measured, "rtt": rtt_measured, "first_byte": first_byte_measured,
        "rendition": rendition_measured, "prefill": prefill_measured,
    }

    def first_byte_of(self, relay: str, cap_s: float = FIRST_BYTE_CAP_S) -> FirstByteEstimator:
        """The first-byte estimator of ``relay`` (made on first use, with ``cap_s``, the fetch timeout of
        the session that feeds it); at most ``MAX_RELAYS_TRACKED`` are kept, the least recently used goes."""
        estimator = self.first_byte.pop(relay, None)
        if estimator is None:
            estimator = FirstByteEstimator(cap_s=cap_s, clock=self.clock)
            while len(self.first_byte) >= MAX_RELAYS_TRACKED:
                del self.first_byte[next(iter(self.first_byte))]
        self.first_byte[relay] = estimator
        return estimator

    def first_byte_s(self, relay: str | None = None) -> float:
        """The first-byte delay beyond the RTT a FETCH to ``relay`` waits; 0 before any measurement. None:
        the relay of the newest session (the last one ``first_byte_of`` was asked for, as each session's
        fetcher does when it starts), so a node that moved to another relay does not keep the old one's."""
        if relay is None:
            relay = next(reversed(self.first_byte), None)
        estimator = None if relay is None else self.first_byte.get(relay)
        return 0.0 if estimator is None else estimator.estimate()

    def fetch_latency_s(self, relay: str | None = None) -> float:
        """What a fetch costs before its bytes flow: one round trip plus the relay's first-byte delay."""
        return self.rtt.estimate() + self.first_byte_s(relay)

    def skip_locate(
        self, block_size: int, block_raw_bytes: int, blocks: int, total_tokens: int, context_tokens: int = 0
    ) -> dict[str, Any] | None:
        """Why a request should not look for remote blocks at all (its report's ``abr`` entry), or None to
        look. ``blocks`` is how many the relay could have (the prompt's missing ones), ``total_tokens``
        what prefill would process without them, after ``context_tokens`` the cache holds (local hits).
        Skipped while, even were every one of those blocks located, no plan would fetch any: each block's
        fetch costs at least its recompute (so a fetched prefix never wins) and the best split
        (``best_split``) saves less than ``SPLIT_MIN_GAIN``. That saves the locate's round trip (a WAN RTT
        or more) on every request of a node whose path loses to its compute. Only a measured throughput is
        trusted this way (a split tail's too, as in ``_fetch_throughput``), never the prior; and a skip
        counts as a declining plan (``declined_streak``), so the probes that measure the path again
        (``_should_probe``) come as often as if the blocks had been located and declined."""
        cfg = self.config
        if blocks <= 0 or self._fetch_throughput().samples == 0:  # nothing to find, or only the prior
            return None
        if cfg.force_recompute or not cfg.allow_recompute or self._should_probe():
            return None
        _, fetch = self.fetch_cost(block_raw_bytes, cfg.acceptable)
        # The least a fetched block saves: its tokens and their attention to the context (no forward's).
        prefill = self.prefill
        attention = prefill.pairs(block_size, context_tokens) * prefill.pair_s
        compute = block_size * prefill.per_token_s + attention
        if fetch < compute:
            return None
        recompute_all = self.prefill.estimate(total_tokens, context_tokens)
        if cfg.overlap:
            best, tail = self.fetch_cost(block_raw_bytes, cfg.acceptable, beside_compute=True)
            extra = [self.decode_beside_head(block_raw_bytes, best)] * blocks
            head = self.head_cost(block_size, context_tokens=context_tokens)
            _, parallel = best_split([tail] * blocks, self.fetch_latency_s(), head, extra)
            fetched = blocks * block_size
            rest = self.prefill.estimate(total_tokens - fetched, context_tokens + fetched)
            if parallel + rest < (1 - SPLIT_MIN_GAIN) * recompute_all:
                return None
        self.skipped_locates += 1
        self.declined_streak += 1
        return {
            "fetch_blocks": 0,
            "compute_blocks": 0,
            "locate_skipped": (
                f"fetching a block would take {fetch * 1e3:.1f} ms against {compute * 1e3:.1f} ms "
                "computing it: no plan could fetch, so no locate"
            ),
            "inputs": self.inputs(),
        }

    def inputs(self) -> dict[str, float]:
        """The estimates a plan is made from now (a skipped locate's report, an engine's metrics file)."""
        return {
            "throughput_bps": self._fetch_throughput().estimate(),
            "rtt_s": self.rtt.estimate(),
            "prefill_per_token_s": self.prefill.per_token_s,
            "prefill_overhead_s": self.prefill.overhead_s,
            "prefill_pair_s": self.prefill.pair_s,
        }

    def _should_probe(self) -> bool:
        cfg = self.config
        if cfg.probe_after and self.declined_streak >= cfg.probe_after:
            return True
        last = self._fetch_throughput().last_sample_at
        return bool(cfg.probe_after_s) and last is not None and self.clock() - last > cfg.probe_after_s

    def _fetch_throughput(self, beside_compute: bool = False) -> ThroughputEstimator:
        """What a fetch is costed at: as a split's tail, ``tail_throughput`` once one was measured; whole,
        ``throughput``, or ``tail_throughput`` where it was measured faster, or while only the former's
        prior stands: a tail's rate is at most the path's (module docstring)."""
        tail = self.tail_throughput
        if beside_compute:
            return tail if tail.samples else self.throughput
        if tail.samples and (not self.throughput.samples or tail.estimate() > self.throughput.estimate()):
            return tail
        return self.throughput

    def fetch_cost(
        self, raw_bytes: int, available: Sequence[str], beside_compute: bool = False
    ) -> tuple[str | None, float]:
        """Best acceptable rendition among ``available`` for a block of ``raw_bytes``, and its cost;
        ``beside_compute``: as the tail of a split, fetched while the head computes (``tail_throughput``)."""
        bps = self._fetch_throughput(beside_compute).estimate() * self.config.safety
        best: tuple[float, tuple[int, str], str] | None = None
        for r in available:
            if r not in self.config.acceptable:
                continue
            cost = raw_bytes * self.renditions.size_ratio(r) / bps + raw_bytes / self.renditions.decode_bps(r)
            key = (cost, quality_rank(r), r)
            if best is None or key < best:
                best = key
        return (None, math.inf) if best is None else (best[2], best[0])

    def plan(
        self,
        located: Sequence[Sequence[str]],
        block_size: int,
        block_raw_bytes: int,
        total_tokens: int,
        relay: str | None = None,
        context_tokens: int = 0,
    ) -> AbrPlan:
        """Plan the located prefix: ``located[i]`` lists the renditions available for block i.

        ``total_tokens`` is what prefill would process with nothing fetched (tokens after local hits, of
        which there are ``context_tokens``: what is computed attends to them too);
        ``relay`` is the relay fetched from (None: see ``first_byte_s``). A fetch's fixed cost is the RTT
        plus the relay's first-byte delay (``fetch_latency_s``).
        """
        per_tok = self.prefill.per_token_s
        choices: list[BlockChoice] = []
        fetch_costs: list[float] = []
        for i, avail in enumerate(located):
            r, cost = self.fetch_cost(block_raw_bytes, avail)
            fetch_costs.append(cost)
            choices.append(BlockChoice(i, r or RECOMPUTE, cost, block_size * per_tok, r))
        rtt = self.rtt.estimate()
        first_byte = self.first_byte_s(relay)
        latency = rtt + first_byte
        ctx = context_tokens

        def rest_after(k: int) -> float:
            """The prefill left once the first ``k`` located blocks are in the cache."""
            return self.prefill.estimate(total_tokens - k * block_size, ctx + k * block_size)

        best_k, best_t = 0, rest_after(0)
        recompute_all = best_t
        whole_t = math.inf  # fetching every located block with an acceptable rendition, then the rest
        if not self.config.force_recompute:
            acc = latency
            for k in range(1, len(located) + 1):
                acc += fetch_costs[k - 1]
                if math.isinf(acc):
                    break
                t = whole_t = acc + rest_after(k)
                # Ties favour fetching more (saves compute for everyone on the node).
                if t <= best_t or not self.config.allow_recompute:
                    best_k, best_t = k, t
        # Blocks the estimates declined: those after the cut up to the first one without an acceptable
        # rendition (a block nobody offers acceptably is not a decision the estimates made).
        fetchable = next((i for i, c in enumerate(fetch_costs) if math.isinf(c)), len(located))
        compute_k = 0
        probe = False
        if self.config.overlap and self.config.allow_recompute and not self.config.force_recompute:
            rest = rest_after(fetchable)
            # As the tail of a split: at ``tail_throughput`` once one was measured (the same costs before).
            tail_costs = fetch_costs[:fetchable] if not self.tail_throughput.samples else [
                self.fetch_cost(block_raw_bytes, avail, beside_compute=True)[1]
                for avail in located[:fetchable]
            ]
            extra = [self.decode_beside_head(block_raw_bytes, c.best) for c in choices[:fetchable]]
            head = self.head_cost(block_size, context_tokens=ctx)
            k, parallel = best_split(tail_costs, latency, head, extra)
            if 0 < k < fetchable and parallel + rest < (1 - SPLIT_MIN_GAIN) * best_t:
                compute_k, best_k, best_t = k, fetchable, parallel + rest
                if (self.tail_throughput.samples and not self.throughput.samples
                        and best_t >= (1 - WHOLE_PROBE_GAIN) * whole_t):
                    probe, best_t = True, whole_t  # fetch everything to measure the path alone
        declined = max(fetchable - best_k, 0) if self.config.allow_recompute else 0
        if declined and not self.config.force_recompute:
            self.declined_plans += 1
            self.declined_blocks += declined
            if self._should_probe():
                probe = True
                self.declined_streak = 0
                best_k = max(best_k, min(self.config.probe_blocks, fetchable))
                acc = latency + sum(fetch_costs[:best_k])
                best_t = acc + rest_after(best_k)
            else:
                self.declined_streak += 1
        elif fetchable:
            self.declined_streak = 0
        if probe:  # measures the path alone: its sample replaces the estimate (``fetch_measured``)
            compute_k, self._probe_pending = 0, True
            self.probes += 1
        final = tuple(
            c if compute_k <= c.index < best_k
            else BlockChoice(c.index, RECOMPUTE, c.fetch_s, c.recompute_s, c.best)
            for c in choices
        )
        return AbrPlan(
            choices=final,
            fetch_blocks=best_k,
            throughput_bps=self._fetch_throughput().estimate(),
            rtt_s=rtt,
            first_byte_s=first_byte,
            prefill_per_token_s=per_tok,
            prefill_overhead_s=self.prefill.overhead_s,
            prefill_pair_s=self.prefill.pair_s,
            est_total_s=best_t,
            est_recompute_all_s=recompute_all,
            declined_blocks=declined,
            probe=probe,
            compute_blocks=compute_k,
        )

    def head_chunk_tokens(self, block_size: int, head_blocks: int) -> int:
        """Prompt tokens per forward of a split's head that computes ``head_blocks`` blocks: whole blocks,
        at least one, at most the engine's step budget (``AbrConfig.max_step_tokens``).

        Each forward costs the prefill's fixed cost (``prefill.overhead_s``, measured) besides its tokens,
        and a head whose limit comes down mid-chunk computes on average half a chunk past it, so the total
        ``(H / c) * overhead + (c / 2) * per_token`` is least at ``c = sqrt(2 * overhead * H / per_token)``.
        The fixed cost is the model's, not a constant: ~4 ms on the ``small`` preset (128-token chunks), but
        ~70 ms for SmolLM2 in bfloat16 on an AMX CPU, where 128-token chunks took a head 1.8x as long as
        one 512-token forward (docs/performance.md, "The head's chunk, measured per model")."""
        per_token = max(self.prefill.per_token_s, 1e-9)
        head_tokens = max(head_blocks, 1) * block_size
        best = math.sqrt(2.0 * self.prefill.overhead_s * head_tokens / per_token)
        blocks = max(round(best / block_size), 1)
        if self.config.max_step_tokens is not None:
            blocks = min(blocks, self.config.max_step_tokens // block_size)
        return max(blocks, 1) * block_size

    def head_cost(
        self, block_size: int, chunk_tokens: int | None = None, context_tokens: int = 0
    ) -> Callable[[int], float]:
        """Estimated seconds to prefill ``n`` blocks of a head beside its fetch.

        Once a split was measured, ``head_prefill``'s fit (its samples include their chunks' fixed costs
        and the cores the tail took). Before, the plain prefill's: each forward's fixed cost once per chunk
        of ``head_chunk_tokens``, times ``shared_cores_head_slowdown`` where the fetch takes the forwards'
        cores (``decode_beside_compute``). ``chunk_tokens``: the head is running already, in chunks of that
        size (more of it, no new forward to start); None: a new head. ``context_tokens``: the cached
        tokens before the head's first block, which its attention reads too."""
        if self.head_prefill.has_samples:
            head = self.head_prefill
            per_block = block_size * head.per_token_s
            base = head.overhead_s if chunk_tokens is None else 0.0
            return lambda n: 0.0 if n <= 0 else (
                base + n * per_block + head.pairs(n * block_size, context_tokens) * head.pair_s
            )
        prefill = self.prefill
        fixed, per_block = prefill.overhead_s, block_size * prefill.per_token_s
        slowdown = self.config.shared_cores_head_slowdown if self.config.decode_beside_compute else 1.0

        def cost(n: int) -> float:
            if n <= 0:
                return 0.0
            chunk = chunk_tokens or self.head_chunk_tokens(block_size, n)
            attention = prefill.pairs(n * block_size, context_tokens) * prefill.pair_s
            return slowdown * (math.ceil(n * block_size / chunk) * fixed + n * per_block + attention)
        return cost

    def decode_beside_head(self, block_raw_bytes: int, rendition: str | None) -> float:
        """Seconds a split's head waits for the decoding of one tail block in ``rendition``: 0 unless
        ``AbrConfig.decode_beside_compute``, where no rendition is acceptable, and once a head was measured
        beside its tail (``head_prefill`` has counted the sharing then)."""
        if not self.config.decode_beside_compute or rendition is None or self.head_prefill.has_samples:
            return 0.0
        return block_raw_bytes / self.renditions.decode_bps(rendition)

    def block_fetch_cost(self, block_raw_bytes: int, rendition: str, beside_compute: bool = False) -> float:
        """Estimated seconds to fetch and decode one block of ``rendition`` (``inf`` if not acceptable);
        ``beside_compute`` as in ``fetch_cost``."""
        return self.fetch_cost(block_raw_bytes, [rendition], beside_compute)[1]

    def deadline(self, started: float, block_size: int, relay: str | None = None) -> FetchDeadline | None:
        """The deadline of a fetch from ``relay`` (None: see ``first_byte_s``) starting at ``started``; None
        when the fetch must not be abandoned (``allow_recompute`` off: every located block is fetched)."""
        if not self.config.allow_recompute:
            return None
        return FetchDeadline(started, self.config.deadline_margin_s, block_size * self.prefill.per_token_s,
                             self.first_byte_s(relay))
