"""What a node reports: per-request reports (the subscriber's ``--json`` output) and the /metrics counters.

Plain data with ``to_json``; filled in by ``kvnet.node.node.Node``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timings:
    """Seconds spent in each phase of one request."""

    hash_s: float = 0.0
    locate_s: float = 0.0
    fetch_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class RequestReport:
    """Everything one completion did; ``to_json`` is the subscriber's ``--json`` output."""

    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    located_blocks: int = 0
    bytes_fetched: int = 0
    renditions: dict[str, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str = "length"
    abr: dict[str, Any] = field(default_factory=dict)
    locate: dict[str, int] = field(default_factory=dict)
    """What the locate searched and cost: ``blocks, located, probes, rounds, fan_out``."""
    fallback: list[str] = field(default_factory=list)
    abandoned: str | None = None
    """Why the fetch was abandoned at its deadline and the rest recomputed (``FetchDeadline.describe``)."""
    security_events: list[dict[str, str]] = field(default_factory=list)
    """Blocks refused by verification: ``{"kind": "signature" | "content", "detail": ...}``."""
    published_blocks: int = 0
    fetch_retries: int = 0
    """FETCHes sent again for blocks the relay did not have whole yet (still being pushed)."""
    head_computed_blocks: int = 0
    """Blocks of the located prefix the engine computed while the tail was fetched (``kvnet.node.overlap``;
    0 without a split)."""
    tail_fetched_blocks: int = 0
    """Blocks of the located prefix fetched while the head was computed (0 without a split)."""
    overlap: dict[str, Any] = field(default_factory=dict)
    """What fetching and computing at once did (``OverlapResult.to_json``); empty without a split."""
    kv_exact: bool = True
    """Every block loaded from a relay is a trusted publisher's K/V bit for bit: its layers matched the
    signed payload digests on arrival (always checked), its signer is trusted (not only accepted under
    ``--trust-any``) and it came in a bit-exact rendition, ``lossless`` or ``plain``
    (``kvnet.node.verification``)."""
    verified: bool | None = None
    """With ``--verify``: ``kv_exact`` and the output equals this node's own output with the same prefix
    K/V held locally (the local-hit reference); None without ``--verify``."""
    equals_recompute: bool | None = None
    """With ``--verify``: the output equals a cold recompute of the whole prompt. Not verification: on CPUs
    whose bfloat16 kernels round by batch shape (AMX) it can be False when ``verified`` is True."""
    relay_connected: bool | None = None
    """False when a relay is configured but had no session while this request was served (so no remote
    prefix could be looked up); None without a relay."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "local_hit_tokens": self.local_hit_tokens,
            "remote_hit_tokens": self.remote_hit_tokens,
            "computed_tokens": self.computed_tokens,
            "located_blocks": self.located_blocks,
            "bytes_fetched": self.bytes_fetched,
            "renditions": dict(self.renditions),
            "timings": self.timings.to_json(),
            "output_token_ids": list(self.output_token_ids),
            "output_text": self.output_text,
            "finish_reason": self.finish_reason,
            "abr": self.abr,
            "locate": dict(self.locate),
            "fallback": list(self.fallback),
            "abandoned": self.abandoned,
            "security_events": [dict(e) for e in self.security_events],
            "published_blocks": self.published_blocks,
            "fetch_retries": self.fetch_retries,
            "head_computed_blocks": self.head_computed_blocks,
            "tail_fetched_blocks": self.tail_fetched_blocks,
            "overlap": dict(self.overlap),
            "kv_exact": self.kv_exact,
        }
        if self.verified is not None:
            out["verified"] = self.verified
        if self.equals_recompute is not None:
            out["equals_recompute"] = self.equals_recompute
        if self.relay_connected is not None:
            out["relay_connected"] = self.relay_connected
        return out


@dataclass
class PublishReport:
    """What ``publish_prompt`` did."""

    prompt_tokens: int
    computed_tokens: int
    blocks: int
    objects_bytes: int
    pushed: int
    prefill_s: float
    encode_s: float
    push_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class NodeCounters:
    """Monotonic counters exported on /metrics (``kvnet.node.metrics``)."""

    requests: int = 0
    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    bytes_fetched: int = 0
    blocks_rejected: int = 0
    security_signature_failures: int = 0
    """Blocks refused because they were unsigned or not signed by a trusted key."""
    security_content_failures: int = 0
    """Signed blocks whose manifest or payload disagreed with our prompt (poisoning or corruption)."""
    fetch_fallbacks: int = 0
    fetch_retries: int = 0
    """FETCHes sent again for blocks the relay did not have whole yet."""
    published_blocks: int = 0
    relay_sessions: int = 0
    """Relay sessions established (the first one and every reconnect)."""
    republished_blocks: int = 0
    """Stored blocks pushed again on a new relay session because the relay lacked them."""
