"""When to try a lost relay session again: capped exponential backoff with jitter (sans-I/O).

Owns ``Backoff`` only, the one reconnect policy: ``kvnet.node.node.Node`` runs its relay session's
reconnect loop with it, ``relay.upstream.UpstreamRelay`` an edge relay's loop to its upstream. The delay
before attempt ``n`` (0-based) is drawn from ``[c/2, c]`` with ``c = min(cap, initial * factor**n)``: never
above the cap (so a node or edge is back within ``cap`` of a restarted relay), never below half of it (so
a fleet restarting together spreads out instead of retrying in lockstep).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvnet.net.url import parse_moqt_url

DEFAULT_INITIAL_S = 0.25
DEFAULT_CAP_S = 5.0
STABLE_SESSION_S = 10.0
"""A session that lasted this long resets the backoff; a shorter one (e.g. a draining relay that sends
GOAWAY at once) counts as a failed attempt."""


@dataclass
class Backoff:
    """Delays between reconnect attempts; ``reset`` after a session was established."""

    initial_s: float = DEFAULT_INITIAL_S
    cap_s: float = DEFAULT_CAP_S
    factor: float = 2.0
    rng: random.Random = field(default_factory=random.Random)
    attempt: int = 0
    """Attempts that failed since the last reset."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.cap_s:
            raise ValueError(f"backoff needs 0 < initial ({self.initial_s}) <= cap ({self.cap_s})")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")

    def ceiling(self) -> float:
        """The largest delay the next attempt may wait."""
        return min(self.cap_s, self.initial_s * self.factor ** min(self.attempt, 64))

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt (and count this one as failed)."""
        ceiling = self.ceiling()
        self.attempt += 1
        return ceiling / 2 + self.rng.uniform(0.0, ceiling / 2)

    def reset(self) -> None:
        self.attempt = 0


def redirect_target(new_session_uri: bytes) -> str | None:
    """Where a GOAWAY asks us to reconnect: its New Session URI when it is a usable ``moqt://`` URL, else
    None (empty: reconnect to the URL we know; anything else is ignored rather than followed)."""
    try:
        uri = new_session_uri.decode()
        parse_moqt_url(uri)
    except (UnicodeDecodeError, ValueError):
        return None
    return uri or None
