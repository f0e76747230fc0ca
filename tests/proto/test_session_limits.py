"""Tests of proto/session_limits.py: the bounded memories of the peer's Request IDs and stream ids."""

from __future__ import annotations

import pytest

from proto.errors import InvalidRequestId
from proto.session_limits import HandledPeerStreams, PeerRequestIds


def test_handled_peer_streams_stay_bounded_and_forget_the_smallest_ids() -> None:
    seen = HandledPeerStreams(limit=4)
    ids = [16, 4, 12, 0, 8, 20, 4]  # out of order, one repeat
    for i in ids:
        seen.add(i)
    # Six distinct ids over a limit of four: the two smallest are forgotten, the rest are remembered.
    assert 0 not in seen and 4 not in seen
    assert all(i in seen for i in (8, 12, 16, 20))
    for i in range(24, 4000, 4):
        seen.add(i)
    assert [i for i in range(0, 4000, 4) if i in seen] == [3984, 3988, 3992, 3996]


def test_peer_request_ids_accept_out_of_order_and_refuse_repeats_and_wrong_parity() -> None:
    ids = PeerRequestIds(first=1, max_out_of_order=8)  # a client's peer (the server) uses odd ids
    for rid in (5, 1, 3, 9):
        ids.check(rid)
    assert ids.floor == 7  # 1, 3, 5 seen: everything below 7 is known
    for bad in (1, 5, 9):
        with pytest.raises(InvalidRequestId, match="duplicate"):
            ids.check(bad)
    with pytest.raises(InvalidRequestId, match="parity"):
        ids.check(4)


def test_peer_request_ids_stay_bounded_by_forgetting_the_gap() -> None:
    # A request whose stream was reset before its first byte never shows up; the set of ids seen above
    # the floor must not grow for ever waiting for it.
    ids = PeerRequestIds(first=0, max_out_of_order=4)
    for rid in range(2, 2 + 2 * 10, 2):  # 0 never arrives
        ids.check(rid)
    assert ids.floor > 2 and len(ids._seen) <= 4
    with pytest.raises(InvalidRequestId):
        ids.check(0)  # below the floor now: treated as already seen
