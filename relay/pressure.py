"""Relay-wide pressure: bytes buffered and held for sessions, and the sweep that applies the limits.

Owns: ``Pressure``, built once by the relay: the estimate of bytes buffered for all sessions and the wait
for room under ``max_buffered_bytes``; the sweep every ``sweep_interval`` seconds (idle sessions closed,
idle ones reaped while the session table is nearly full, slow readers cut off, the sessions' own refusals
counted, the sessions holding the most cut off over a buffered-bytes bound); a session slot taken under
pressure; the objects of pushed tracks held for sessions outside the cache, bounded per session, address,
identity and in total; and handing freed memory back to the system.

Reaches sessions as ``relay.peer.Peer`` and held tracks as ``relay.fanout.Holding``, never the relay
itself: the relay passes in what is counted against (its session table, slots and quotas).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping

from proto.errors import StreamResetCode
from relay.fanout import Holding
from relay.limits import HeldBytes, LimitExceeded, LimitsConfig, Quota, Slots, return_freed_memory
from relay.metrics import Metrics
from relay.peer import Peer

logger = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 16 * 1024 * 1024
"""Held bytes released since memory was last handed back to the system that make it worth doing again."""


class Pressure:
    """The relay's buffered and held bytes and its sweep over the sessions of ``peers`` (the relay's live
    table of accepted sessions, by id), counted against ``limits``; ``sessions`` and ``address_sessions``
    are the relay's session slots and per-address quota, which ``admit_session`` takes from."""

    def __init__(
        self,
        limits: LimitsConfig,
        metrics: Metrics,
        clock: Callable[[], float],
        peers: Mapping[int, Peer],
        sessions: Slots,
        address_sessions: Quota,
    ) -> None:
        self.limits = limits
        self.metrics = metrics
        self.clock = clock
        self.peers = peers
        self.sessions = sessions
        self.address_sessions = address_sessions
        self.buffered_sample = 0
        """Bytes buffered for all sessions at the last sweep (send + receive side)."""
        self.buffered_since = 0
        """Object bytes written toward peers since that sweep (so the estimate never lags behind)."""
        self._swept = asyncio.Event()
        self.held = HeldBytes(limits)
        """Bytes of pushed objects held outside the cache, per session, address, identity and in total."""
        self.holdings: dict[int, dict[Holding, None]] = {}
        """By session id: its tracks holding objects (``hold``), oldest first."""
        self._freed_since_trim = 0

    # -- bytes buffered toward all sessions ----------------------------------------------------------
    def buffered_estimate(self) -> int:
        return self.buffered_sample + self.buffered_since

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` of object payload were written toward a session (in the estimate until the next
        sweep)."""
        self.buffered_since += nbytes

    def buffers_full(self) -> bool:
        """Bytes buffered for all sessions have reached ``max_buffered_bytes``."""
        return self.buffered_estimate() >= self.limits.max_buffered_bytes

    def buffer_fair_share(self) -> int:
        return self.limits.max_buffered_bytes // max(1, len(self.peers))

    async def wait_buffer_room(self, timeout: float) -> bool:
        """Wait (at most ``timeout``) until the relay-wide buffers are below their cap again."""
        deadline = self.clock() + timeout
        while self.buffers_full():
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._swept.wait()
        return True

    def sweep_interval(self) -> float:
        lim = self.limits
        timeouts = [
            t for t in (lim.session_idle_timeout, lim.slow_peer_timeout, lim.pressure_idle_timeout) if t > 0
        ]
        return min(1.0, max(0.05, min(timeouts) / 4))

    async def watch(self) -> None:
        """Apply the timeouts and the relay-wide buffer cap, every ``sweep_interval`` seconds."""
        interval = self.sweep_interval()
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep(self.clock())
            except Exception:  # the watchdog must outlive any one bad session
                logger.exception("sweep failed")

    def sweep(self, now: float) -> None:
        """One pass over the sessions: idle ones are closed, slow readers cut off, header timeouts and
        the sessions' own refusals counted; then, over ``max_buffered_bytes``, the sessions holding the
        most are cut off first."""
        lim = self.limits
        total = 0
        held: list[tuple[int, Peer]] = []
        by_host: dict[str, list[tuple[int, Peer]]] = {}
        by_identity: dict[str, list[tuple[int, Peer]]] = {}
        pressured = self.under_pressure()
        for peer in list(self.peers.values()):
            conn = peer.conn
            if conn.is_closed:
                continue
            self.count_session_refusals(peer)
            idle = peer.idle_for(now)
            if lim.session_idle_timeout and peer.requests.used == 0 and idle >= lim.session_idle_timeout:
                peer.close_for("idle_timeout", "idle timeout")
                continue
            if pressured and peer.reapable(idle):
                peer.close_for("pressure_idle", "idle timeout (relay under pressure)")
                continue
            sent = conn.send_buffered()
            total += sent + conn.receive_buffered
            held.append((sent, peer))
            if peer.host is not None:
                by_host.setdefault(peer.host, []).append((sent, peer))
            if peer.identity is not None:
                by_identity.setdefault(peer.identity, []).append((sent, peer))
            peer.check_progress(now, sent)
        for groups, limit, label in (
            (by_host, lim.max_buffered_bytes_per_address, "buffered_bytes_per_address"),
            (by_identity, lim.max_buffered_bytes_per_identity, "buffered_bytes_per_identity"),
        ):
            if limit:
                for group_held in groups.values():
                    self._cut_biggest(group_held, limit, label)
        self._cut_biggest(held, lim.max_buffered_bytes, "buffered_bytes_global", total)
        self.buffered_sample = total
        self.buffered_since = 0
        self.trim_freed_memory()
        self._swept.set()
        self._swept = asyncio.Event()

    def _cut_biggest(
        self, held: list[tuple[int, Peer]], limit: int, label: str, total: int | None = None
    ) -> None:
        """Over ``limit`` bytes (``total``, or the sum of ``held``), cut off the sessions holding the most
        until back under it: their data requests reset, or the session closed if it has none."""
        total = sum(sent for sent, _ in held) if total is None else total
        if total <= limit:
            return
        for sent, peer in sorted(held, key=lambda h: h[0], reverse=True):
            if total <= limit or sent == 0:
                break
            if not peer.cut(StreamResetCode.EXCESSIVE_LOAD, label):
                peer.close_for(label, f"relay limit reached: {label.replace('_', ' ')}")
            total -= sent

    def under_pressure(self) -> bool:
        """The session table is at least 90 % full (and pressure reaping is on)."""
        lim = self.limits
        return lim.pressure_idle_timeout > 0 and self.sessions.used * 10 >= lim.max_sessions * 9

    def admit_session(self) -> None:
        """Take a session slot; when none is left, close the longest-idle session of the address holding
        the most sessions (idle at least ``pressure_idle_timeout``) and take its slot instead."""
        try:
            self.sessions.acquire()
            return
        except LimitExceeded:
            if not self.limits.pressure_idle_timeout:
                raise
            now = self.clock()
            idle = [p for p in self.peers.values() if not p.conn.is_closed and p.reapable(p.idle_for(now))]
            if not idle:
                raise
            victim = max(
                idle, key=lambda p: (self.address_sessions.used.get(p.host or "", 0), p.idle_for(now))
            )
            victim.close_for("pressure_idle", "idle timeout (relay under pressure)")
            # The victim's slot is released when its session ends; until then the table is one over.
            self.sessions.used += 1

    def count_session_refusals(self, peer: Peer) -> None:
        """Add to the metrics what the session's connection refused or reset on its own since the last
        call: request-header timeouts, and requests refused for a limit before they reached us."""
        timeouts, refused = peer.count_refusals()
        if timeouts:
            self.metrics.inc("request_header_timeouts_total", timeouts)
        for limit, new in refused.items():
            self.metrics.inc("limit_rejections_total", new, labels={"limit": f"session_{limit}"})

    # -- objects held for sessions outside the cache -----------------------------------------------------
    def hold(self, holding: Holding, n: int) -> bool:
        """Charge ``n`` more held bytes to ``holding``'s session. Over a bound (per session, address,
        identity, or in total), holdings are dropped until it fits: the oldest of the session over it, or
        of the session holding the most in the address, identity or relay over it. False when ``holding``
        itself was dropped (or holds nothing and ``n`` alone is over a bound): the object is not held."""
        peer = holding.holder
        while (label := self.held.exceeded(peer.id, peer.host, peer.identity, n)) is not None:
            victim = self._held_victim(label, peer) or holding
            self.metrics.inc("limit_rejections_total", labels={"limit": label})
            victim.holder.log.warning(
                "dropping a held pushed track over a limit",
                extra={"limit": label, "bytes": victim.held_bytes},
            )
            victim.drop_held()
            if victim is holding:
                return False
        self.held.add(peer.id, peer.host, peer.identity, n)
        self.holdings.setdefault(peer.id, {})[holding] = None
        return True

    def unhold(self, holding: Holding, n: int) -> None:
        """``n`` bytes of ``holding`` were let go."""
        peer = holding.holder
        self.held.add(peer.id, peer.host, peer.identity, -n)
        self._freed_since_trim += n

    def release_held(self, holding: Holding) -> None:
        """``holding`` lets go of everything it held (its track ended, was cached, or was dropped)."""
        self.unhold(holding, holding.held_bytes)
        mine = self.holdings.get(holding.holder.id)
        if mine is not None:
            mine.pop(holding, None)
            if not mine:
                del self.holdings[holding.holder.id]

    def _held_victim(self, label: str, peer: Peer) -> Holding | None:
        """The holding to drop for bound ``label``: the oldest non-empty one of ``peer``'s session
        (session bound) or of the session holding the most within the scope over its bound."""
        if label == "held_bytes_per_session":
            owner = peer.id
        else:
            def in_scope(session: int) -> bool:
                first = next(iter(self.holdings[session]), None)
                if first is None:
                    return False
                if label == "held_bytes_per_address":
                    return first.holder.host == peer.host
                if label == "held_bytes_per_identity":
                    return first.holder.identity == peer.identity
                return True

            scope = [s for s in self.holdings if in_scope(s)]
            if not scope:
                return None
            owner = max(scope, key=lambda s: self.held.by_session.get(s, 0))
        return next((h for h in self.holdings.get(owner, {}) if h.held_bytes > 0), None)

    def trim_freed_memory(self) -> None:
        """Hand freed heap pages back to the system once enough held bytes were released."""
        if self._freed_since_trim >= TRIM_AFTER_BYTES:
            self._freed_since_trim = 0
            return_freed_memory()
