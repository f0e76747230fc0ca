"""NamespaceRouter: the draft's field-by-field prefix rule, longest match first, limits, pruning."""

from __future__ import annotations

import pytest

from relay.router import NamespaceRouter, RouteLimitError


def test_prefix_matching_is_per_field() -> None:
    r: NamespaceRouter[str] = NamespaceRouter()
    r.add((b"foo",), "p1")
    r.add((b"foo", b"bar"), "p2")
    r.add((b"foobar",), "p3")
    assert r.lookup((b"foo", b"bar")) == ["p2", "p1"]  # longest first
    assert r.lookup((b"foo", b"bar", b"baz")) == ["p2", "p1"]
    assert r.lookup((b"foo",)) == ["p1"]
    assert r.lookup((b"foob",)) == []
    assert r.lookup((b"foobar", b"x")) == ["p3"]
    assert r.lookup((b"fo",)) == []


def test_same_route_on_two_prefixes_is_listed_once() -> None:
    r: NamespaceRouter[str] = NamespaceRouter()
    r.add((b"a",), "p")
    r.add((b"a", b"b"), "p")
    r.add((b"a",), "q")
    assert r.lookup((b"a", b"b")) == ["p", "q"]


def test_remove_prunes_and_remove_route() -> None:
    r: NamespaceRouter[str] = NamespaceRouter()
    assert r.add((b"a", b"b", b"c"), "p")
    assert not r.add((b"a", b"b", b"c"), "p")
    r.add((b"a",), "p")
    r.add((b"x",), "q")
    assert r.remove((b"a", b"b", b"c"), "p")
    assert not r.remove((b"a", b"b", b"c"), "p")
    assert r.lookup((b"a", b"b", b"c")) == ["p"]
    assert r.remove_route("p") == 1
    assert len(r) == 1 and list(r.items()) == [((b"x",), "q")]


def test_under_lists_registrations_below_prefix() -> None:
    r: NamespaceRouter[str] = NamespaceRouter()
    r.add((b"kvnet", b"v1", b"fp1"), "p")
    r.add((b"kvnet", b"v1", b"fp2"), "q")
    r.add((b"other",), "z")
    assert sorted(r.under((b"kvnet",))) == [
        ((b"kvnet", b"v1", b"fp1"), "p"),
        ((b"kvnet", b"v1", b"fp2"), "q"),
    ]
    assert list(r.under((b"nothing",))) == []


def test_empty_namespace_matches_everything() -> None:
    r: NamespaceRouter[str] = NamespaceRouter()
    r.add((), "all")
    r.add((b"a",), "a")
    assert r.lookup((b"a", b"b")) == ["a", "all"]


def test_route_limit() -> None:
    r: NamespaceRouter[str] = NamespaceRouter(max_routes=2)
    r.add((b"a",), "p")
    r.add((b"b",), "p")
    with pytest.raises(RouteLimitError, match="maximum of 2"):
        r.add((b"c",), "p")
