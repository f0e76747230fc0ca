"""The per-connection resource limits the glue enforces (the session enforces the protocol's own).

Owns: ``ConnectionLimits``, one frozen dataclass checked on construction. ``MoqtConnection`` and its
``kvnet.net.routing.RequestRouter`` read it; role code passes it to ``connect`` / ``serve``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Per-connection resource limits enforced by the glue (the session enforces protocol limits)."""

    max_outstanding_requests: int = 8192
    """Requests we have open at once; further ones wait for a slot."""
    max_send_buffer: int = 16 << 20
    """Unacknowledged bytes queued in QUIC before ``wait_writable`` makes senders wait."""
    max_receive_buffer: int = 64 << 20
    """Object bytes received but not yet consumed by the application, over all requests. A request
    that pushes the total above this is cancelled (EXCESSIVE_LOAD) rather than buffering without end."""
    max_incoming_queue: int = 4096
    """Incoming requests waiting for the application; more are refused with EXCESSIVE_LOAD."""
    setup_timeout: float = 10.0
    """Seconds to wait for the peer's SETUP."""
    publish_done_timeout: float = 5.0
    """Seconds a subscription stays open after PUBLISH_DONE with none of its bytes arriving, waiting for
    the subgroup streams its Stream Count announces (draft "PUBLISH_DONE": data may still be in flight),
    before it ends anyway."""

    def __post_init__(self) -> None:
        names = ("max_outstanding_requests", "max_send_buffer", "max_receive_buffer", "max_incoming_queue")
        for name in names:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.setup_timeout <= 0:
            raise ValueError("setup_timeout must be positive")
        if self.publish_done_timeout < 0:
            raise ValueError("publish_done_timeout must not be negative")
