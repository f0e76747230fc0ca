"""KV ABR: per block, fetch which rendition, or recompute locally.

Owns: the estimators (network throughput, round-trip time, local prefill speed, per-rendition size ratio and
decode speed) and the decision function. It knows nothing about QUIC, MoQT or torch: callers feed it
measurements (bytes and seconds) and ask for a plan; the plan records its inputs so they can be reported.

The decision. Blocks form a chain, and a fetched block is only useful if every block before it is present, so
the plan is "fetch blocks [0, k) and recompute the rest". For each block the cheapest acceptable rendition is
the one with the smallest estimated ``bytes / throughput + decode time`` (ties go to the higher quality). The
cut ``k`` minimises::

    T(k) = (rtt if k > 0) + sum(fetch_i for i < k) + prefill(tokens_total - k * block_size)

with ``prefill(n) = overhead + n * per_token`` measured on this machine. This is an exact argmin over every
cut, O(n), so uneven block sizes are handled. While a fetch runs the caller re-plans the blocks not yet
received with fresh measurements (``should_abandon``), which is what video ABR does per segment.

Whatever the estimates said, a fetch also has one deadline (``FetchDeadline``): it may take at most
``deadline_margin_s`` plus the estimated recompute time of the blocks it has already delivered. Past that,
finishing it can only be slower than recomputing the rest, so it is abandoned, however the relay paces its
objects (a relay trickling one object just inside the per-object timeout cannot hold a request).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RECOMPUTE = "recompute"
# Higher quality first; a rendition not listed ranks after these, in name order.
QUALITY_ORDER: tuple[str, ...] = ("lossless", "int8", "int4")
# Encoded size / raw size before anything was measured, by KV dtype. Measured on SmolLM2's KV (docs/
# performance.md, "Codec quality on real KV"): int8 and int4 are fixed fractions of the element size plus
# scales, so they save half as much on bf16 as on fp32, while bf16's short mantissas compress better
# losslessly. A dtype not listed uses the fp32 row.
DEFAULT_SIZE_RATIO: Mapping[str, Mapping[str, float]] = {
    "float32": {"lossless": 0.85, "int8": 0.25, "int4": 0.14},
    "bfloat16": {"lossless": 0.69, "int8": 0.50, "int4": 0.28},
    "float16": {"lossless": 0.90, "int8": 0.50, "int4": 0.28},
}
# Decode speed in raw bytes produced per second before anything was measured.
DEFAULT_DECODE_BPS: Mapping[str, float] = {"lossless": 1.0e9, "int8": 6.0e8, "int4": 4.0e8}


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


class Ewma:
    """Exponentially weighted mean where each sample carries a weight (bytes, tokens).

    Weight-based decay (as in Shaka's estimator) keeps one huge transfer from being forgotten after a few
    small ones, and one tiny one from swinging the estimate.
    """

    def __init__(self, half_life: float) -> None:
        self._alpha = math.log(0.5) / half_life
        self._estimate = 0.0
        self._total_weight = 0.0

    def add(self, weight: float, value: float) -> None:
        adj = math.exp(self._alpha * weight)
        self._estimate = value * (1 - adj) + adj * self._estimate
        self._total_weight += weight

    def value(self, default: float) -> float:
        if self._total_weight <= 0:
            return default
        # Zero-bias correction: early estimates are not dragged towards the initial 0.
        zero_factor = 1 - math.exp(self._alpha * self._total_weight)
        return self._estimate / zero_factor

    @property
    def has_samples(self) -> bool:
        return self._total_weight > 0


@dataclass
class ThroughputEstimator:
    """Network throughput in bytes/s: the min of a fast and a slow EWMA (react to drops, not to spikes)."""

    prior_bps: float
    fast: Ewma = field(default_factory=lambda: Ewma(half_life=256 * 1024))
    slow: Ewma = field(default_factory=lambda: Ewma(half_life=4 * 1024 * 1024))
    samples: int = 0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        bps = nbytes / seconds
        self.fast.add(nbytes, bps)
        self.slow.add(nbytes, bps)
        self.samples += 1

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


@dataclass
class PrefillEstimator:
    """Local prefill cost ``overhead + n * per_token`` fitted by least squares over recent runs."""

    per_token_s: float = 1e-3
    overhead_s: float = 0.0
    max_samples: int = 32
    _samples: list[tuple[int, float]] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self._samples.append((tokens, seconds))
        del self._samples[: -self.max_samples]
        self._refit()

    def _refit(self) -> None:
        xs = [float(n) for n, _ in self._samples]
        ys = [s for _, s in self._samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        var = sum((x - mx) ** 2 for x in xs)
        if n >= 2 and var > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
            intercept = my - slope * mx
            if slope > 0 and intercept >= 0:
                self.per_token_s, self.overhead_s = slope, intercept
                return
        # One size seen (or a fit with a negative term): attribute everything to tokens.
        self.per_token_s = sum(ys) / sum(xs)
        self.overhead_s = 0.0

    def estimate(self, tokens: int) -> float:
        return 0.0 if tokens <= 0 else self.overhead_s + tokens * self.per_token_s

    @property
    def has_samples(self) -> bool:
        return bool(self._samples)


@dataclass
class RenditionStats:
    """Per rendition: encoded/raw size ratio and decode speed, learned from received blocks."""

    kv_dtype: str = "float32"
    ratio: dict[str, Ewma] = field(default_factory=dict)
    decode: dict[str, Ewma] = field(default_factory=dict)

    def add(self, rendition: str, raw_bytes: int, encoded_bytes: int, decode_s: float) -> None:
        if raw_bytes <= 0:
            return
        self.ratio.setdefault(rendition, Ewma(half_life=8.0)).add(1.0, encoded_bytes / raw_bytes)
        if decode_s > 0:
            self.decode.setdefault(rendition, Ewma(half_life=8.0)).add(1.0, raw_bytes / decode_s)

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

    def rendition_of(self, index: int) -> str:
        return self.choices[index].action

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for c in self.choices:
            counts[c.action] = counts.get(c.action, 0) + 1
        return {
            "fetch_blocks": self.fetch_blocks,
            "actions": counts,
            "inputs": {
                "throughput_bps": round(self.throughput_bps, 1),
                "rtt_s": round(self.rtt_s, 6),
                "prefill_per_token_s": self.prefill_per_token_s,
                "prefill_overhead_s": round(self.prefill_overhead_s, 6),
            },
            "est_total_s": round(self.est_total_s, 6),
            "est_recompute_all_s": round(self.est_recompute_all_s, 6),
        }


@dataclass(frozen=True, slots=True)
class FetchDeadline:
    """When a fetch must have delivered each block: block ``i`` (0-based) is due at
    ``started + margin_s + (i + 1) * block_recompute_s``, so the time spent never exceeds what the delivered
    blocks save by more than the margin. Block ``i`` is credited with its own recompute time: due at the
    margin alone, the first block of a WAN fetch (a round trip plus a MB or more) would be abandoned even
    where fetching the prefix is many times faster than recomputing it."""

    started: float
    """Clock reading (the event loop's) when the fetch began."""
    margin_s: float
    block_recompute_s: float
    """Estimated prefill time of one block's tokens on this node."""

    def due(self, loaded_blocks: int) -> float:
        """Clock reading by which block ``loaded_blocks`` must be in (with ``loaded_blocks`` before it)."""
        return self.started + self.margin_s + (loaded_blocks + 1) * self.block_recompute_s

    def describe(self, loaded_blocks: int, now: float) -> str:
        """Why the fetch was abandoned at block ``loaded_blocks`` at time ``now``."""
        return (
            f"deadline: {now - self.started:.3f}s spent with {loaded_blocks} block(s) delivered, past the "
            f"{(loaded_blocks + 1) * self.block_recompute_s:.3f}s recomputing them and the block awaited "
            f"would take plus the {self.margin_s:.3f}s margin; recomputing is faster than waiting"
        )


@dataclass
class KvAbr:
    """Estimators plus the decision; one per node, so measurements carry over between requests."""

    config: AbrConfig = field(default_factory=AbrConfig)
    throughput: ThroughputEstimator = field(init=False)
    rtt: RttEstimator = field(init=False)
    prefill: PrefillEstimator = field(default_factory=PrefillEstimator)
    renditions: RenditionStats = field(init=False)

    def __post_init__(self) -> None:
        self.renditions = RenditionStats(kv_dtype=self.config.kv_dtype)
        self.throughput = ThroughputEstimator(self.config.prior_throughput_bps)
        self.rtt = RttEstimator(self.config.prior_rtt_s)

    def fetch_cost(self, raw_bytes: int, available: Sequence[str]) -> tuple[str | None, float]:
        """Best acceptable rendition among ``available`` for a block of ``raw_bytes``, and its cost."""
        bps = self.throughput.estimate() * self.config.safety
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
    ) -> AbrPlan:
        """Plan the located prefix: ``located[i]`` lists the renditions available for block i.

        ``total_tokens`` is what prefill would process with nothing fetched (tokens after local hits).
        """
        per_tok = self.prefill.per_token_s
        choices: list[BlockChoice] = []
        fetch_costs: list[float] = []
        for i, avail in enumerate(located):
            r, cost = self.fetch_cost(block_raw_bytes, avail)
            fetch_costs.append(cost)
            choices.append(BlockChoice(i, r or RECOMPUTE, cost, block_size * per_tok))
        rtt = self.rtt.estimate()
        best_k, best_t = 0, self.prefill.estimate(total_tokens)
        recompute_all = best_t
        if not self.config.force_recompute:
            acc = rtt
            for k in range(1, len(located) + 1):
                acc += fetch_costs[k - 1]
                if math.isinf(acc):
                    break
                t = acc + self.prefill.estimate(total_tokens - k * block_size)
                # Ties favour fetching more (saves compute for everyone on the node).
                if t <= best_t or not self.config.allow_recompute:
                    best_k, best_t = k, t
        final = tuple(
            c if c.index < best_k else BlockChoice(c.index, RECOMPUTE, c.fetch_s, c.recompute_s)
            for c in choices
        )
        return AbrPlan(
            choices=final,
            fetch_blocks=best_k,
            throughput_bps=self.throughput.estimate(),
            rtt_s=rtt,
            prefill_per_token_s=per_tok,
            prefill_overhead_s=self.prefill.overhead_s,
            est_total_s=best_t,
            est_recompute_all_s=recompute_all,
        )

    def deadline(self, started: float, block_size: int) -> FetchDeadline | None:
        """The deadline of a fetch starting at ``started``; None when the fetch must not be abandoned
        (``allow_recompute`` off: every located block is fetched)."""
        if not self.config.allow_recompute:
            return None
        return FetchDeadline(started, self.config.deadline_margin_s, block_size * self.prefill.per_token_s)

    def should_abandon(self, remaining_raw_bytes: int, rendition: str, remaining_tokens: int) -> bool:
        """Mid-fetch re-plan: True when recomputing what is not yet received beats waiting for it."""
        if not self.config.allow_recompute or remaining_raw_bytes <= 0:
            return False
        _, cost = self.fetch_cost(remaining_raw_bytes, [rendition])
        # 1.5x hysteresis: one slow sample must not throw away a fetch that is nearly done.
        return cost > self.prefill.per_token_s * remaining_tokens * 1.5
