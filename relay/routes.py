"""Where a miss goes: the sessions and upstream relays a request the relay cannot answer itself is sent
to, in order, as a ``relay.upstream.RoutedUpstream``.

Owns: ``Routes``: the longest-prefix publishers first (at the hub of ``relay.workers``, then every other
worker), the upstream relays after them, routes that recently let a request pass its deadline last; a
request that came from an upstream relay never goes back up (a loop). At the hub, TRACK_STATUS asks the
workers apart from the upstream relays (``track_status``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from relay.cache import ObjectCache, TrackKey, TrackStatus
from relay.limits import LimitsConfig
from relay.metrics import Metrics
from relay.peer import Peer
from relay.router import NamespaceRouter
from relay.upstream import RoutedUpstream, Source, UpstreamRelay


class Routes:
    """The routes of one relay: its namespace ``router``, its accepted sessions ``peers`` (by id, live), its
    ``upstreams``; ``hub``: the relay is the hub of ``relay.workers`` (its sessions are the workers)."""

    def __init__(
        self,
        router: NamespaceRouter[Peer],
        peers: Mapping[int, Peer],
        upstreams: Sequence[UpstreamRelay],
        hub: bool,
        limits: LimitsConfig,
        metrics: Metrics,
        cache: ObjectCache,
    ) -> None:
        self.router = router
        self.peers = peers
        self.upstreams = upstreams
        self.hub = hub
        self.limits = limits
        self.metrics = metrics
        self.cache = cache

    def candidates(self, key: TrackKey, exclude: Peer | None) -> list[Source]:
        """Longest-prefix publishers (at the hub of ``relay.workers``, then every other worker), then the
        upstream relays. A request that came from an upstream relay goes to local publishers only: sending
        it upstream again could only bring it back (a loop)."""
        return self._by_speed([*self.local_sources(key, exclude), *self._upstream_sources(exclude)])

    def local_sources(self, key: TrackKey, exclude: Peer | None) -> list[Source]:
        """The longest-prefix publishers, and at the hub then every other worker."""
        pubs: list[Source] = [
            p for p in self.router.lookup(key[0]) if p is not exclude and not p.conn.is_closed
        ]
        if self.hub:
            # The workers' caches: blocks pushed into one stay there after their publisher left.
            pubs += [
                p for p in self.peers.values()
                if p is not exclude and not p.conn.is_closed and all(p is not q for q in pubs)
            ]
        return pubs

    def _upstream_sources(self, exclude: Peer | None) -> list[Source]:
        """The upstream relays, unless the request came from one."""
        return [] if exclude is not None and exclude.upstream is not None else list(self.upstreams)

    @staticmethod
    def _by_speed(sources: list[Source]) -> list[Source]:
        # Routes that recently let a request pass the route deadline go last (stable: order kept).
        return sorted(sources, key=lambda src: src.slow)

    def upstream_for(self, key: TrackKey, requester: Peer) -> RoutedUpstream:
        return self._routed(lambda: self.candidates(key, requester))

    def _routed(self, candidates: Callable[[], list[Source]]) -> RoutedUpstream:
        lim = self.limits
        return RoutedUpstream(candidates, lim.upstream_timeout, self.metrics, lim.route_timeout)

    async def track_status(self, key: TrackKey, requester: Peer) -> TrackStatus:
        """TRACK_STATUS through the cache. At the hub of ``relay.workers`` the workers are asked apart
        from the upstream relays, first and on every miss: a worker hears of a block pushed to it, the hub
        does not, so only the upstream relays' misses are negatively cached there (a block pushed at one
        worker is found at once from every other)."""
        from_upstream = requester.upstream is not None
        if not self.hub:
            return await self.cache.track_status(
                key, self.upstream_for(key, requester), from_upstream=from_upstream
            )
        workers = self._routed(lambda: self._by_speed(self.local_sources(key, requester)))
        upstreams = self._routed(lambda: self._by_speed(self._upstream_sources(requester)))
        return await self.cache.track_status(key, upstreams, asked_first=workers, from_upstream=from_upstream)
