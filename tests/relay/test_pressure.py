"""``relay.pressure``: the held-bytes bounds, on a ``Pressure`` alone (no relay, no sessions' connections):
over a bound the oldest holding of the session over it, or of the session holding the most, is dropped."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import cast

from relay.limits import LimitsConfig, Quota, Slots
from relay.metrics import Metrics
from relay.peer import Peer
from relay.pressure import Pressure


class HeldTrack:
    """A pushed track holding objects for one session, as a PUBLISH-fed ``Fanout`` does."""

    def __init__(self, pressure: Pressure, holder: Peer) -> None:
        self.pressure = pressure
        self.holder = holder
        self.held_bytes = 0
        self.dropped = False

    def take(self, n: int) -> bool:
        if not self.pressure.hold(self, n):
            return False
        self.held_bytes += n
        return True

    def drop_held(self) -> None:
        self.pressure.release_held(self)
        self.held_bytes = 0
        self.dropped = True


def _session(session_id: int, host: str) -> Peer:
    # Only what the held-bytes accounting reads of a session.
    log = logging.getLogger(__name__)
    return cast(Peer, SimpleNamespace(id=session_id, host=host, identity=None, log=log))


def _pressure(**bounds: int) -> tuple[Pressure, Metrics]:
    limits = LimitsConfig(**bounds)
    metrics = Metrics()
    slots, quota = Slots("sessions", 8), Quota("sessions per address", 0)
    pressure = Pressure(limits, metrics, lambda: 0.0, {}, slots, quota)
    return pressure, metrics


def test_over_the_session_bound_the_sessions_oldest_holding_is_dropped() -> None:
    pressure, metrics = _pressure(max_held_bytes_per_session=100, max_held_bytes=1000)
    session = _session(1, "10.0.0.1")
    old, new = HeldTrack(pressure, session), HeldTrack(pressure, session)
    assert old.take(60) and new.take(30)
    assert new.take(20)  # 110 > 100: the oldest holding goes, the new bytes are held
    assert old.dropped and old.held_bytes == 0
    assert not new.dropped and new.held_bytes == 50
    assert pressure.held.total == 50 and pressure.held.by_session == {1: 50}
    assert metrics.value("limit_rejections_total", {"limit": "held_bytes_per_session"}) == 1


def test_over_the_relay_bound_the_session_holding_the_most_loses_its_holding() -> None:
    pressure, metrics = _pressure(max_held_bytes_per_session=1000, max_held_bytes=100)
    big, small = HeldTrack(pressure, _session(1, "10.0.0.1")), HeldTrack(pressure, _session(2, "10.0.0.2"))
    assert big.take(70) and small.take(20)
    assert small.take(20)  # 110 > 100: the other session holds the most, its holding goes
    assert big.dropped and not small.dropped
    assert pressure.held.total == 40 and pressure.holdings.keys() == {2}
    assert metrics.value("limit_rejections_total", {"limit": "held_bytes_global"}) == 1


def test_bytes_over_a_bound_on_their_own_are_not_held() -> None:
    pressure, _ = _pressure(max_held_bytes_per_session=100, max_held_bytes=1000)
    track = HeldTrack(pressure, _session(1, "10.0.0.1"))
    assert not track.take(101)
    assert track.dropped and pressure.held.total == 0 and pressure.holdings == {}
