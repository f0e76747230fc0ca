"""A node's (or an engine's) MoQT session to its relay: connect, announce, serve our blocks, locate, fetch.

Owns ``RelayPeer``: it opens the session (TLS settings, authorization token, SETUP limits), wires a
``BlockServer`` (answers the relay's requests for our store in its own task) and a ``BlockFetcher`` (our
locates and fetches) to it, pushes new blocks, and drains and closes it on shutdown. With
``fetch_connections`` N > 1 it also keeps N - 1 fetch-only sessions to the same relay, opened with it in
the background (and again, by the next fetch, after they ended), each with its own ``BlockFetcher``, and
every fetch is striped over the sessions that are up (``kvnet.exchange.striping``); they end with the main
session. It is given what it uses (a ``RelayPeerConfig`` and the store, cache, trust and ABR objects) and
knows nothing of who owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import torch

from kvnet.blocks.identity import BlockIdentity
from kvnet.exchange.abr import KvAbr
from kvnet.exchange.blockstore import BlockStore, StoredBlock
from kvnet.exchange.config import RelayPeerConfig
from kvnet.exchange.fetching import BlockFetcher, CacheWriter, Deadline, FetchOutcome
from kvnet.exchange.locate import Located
from kvnet.exchange.publishing import BlockServer
from kvnet.exchange.striping import fetch_striped
from kvnet.exchange.tables import TablesSource
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from kvnet.net.reconnect import STABLE_SESSION_S, Backoff, redirect_target
from kvnet.net.url import MoqtUrl, parse_moqt_url
from kvnet.security.signing import TrustStore
from kvnet.security.tokens import KVNET_TOKEN_TYPE, read_token_file
from proto.errors import RequestErrorCode, UsageError
from proto.kvobject import BLOCK_GROUP_ID, MANIFEST_OBJECT_ID, MAX_MANIFEST_BYTES, block_track
from proto.messages import AliasType, AuthToken
from proto.session import SessionConfig

logger = logging.getLogger(__name__)


def node_session_config(url: MoqtUrl, tokens: tuple[AuthToken, ...] = ()) -> SessionConfig:
    """The MoQT session settings of a node's (or an engine's) session to its relay at ``url``."""
    return SessionConfig(
        is_client=True, path=url.path or None, authority=f"{url.host}:{url.port}",
        authorization_tokens=tokens,
        # The relay forwards many requests to us at once when it serves blocks from our store.
        max_requests_in_flight=16384,
        # A block's object 0 is its manifest: refused as its length arrives when it cannot be one,
        # instead of buffering up to max_object_size first.
        object_size_limits={(BLOCK_GROUP_ID, MANIFEST_OBJECT_ID): MAX_MANIFEST_BYTES},
    )


async def _open_session(cfg: RelayPeerConfig) -> MoqtConnection:
    """A MoQT session to the relay at ``cfg.relay_url`` with ``cfg``'s TLS settings, token and timeouts."""
    url = cfg.relay_url
    parsed = parse_moqt_url(url)
    tokens: tuple[AuthToken, ...] = ()
    if cfg.token_file is not None:
        value = read_token_file(cfg.token_file)
        tokens = (AuthToken(AliasType.USE_VALUE, token_type=KVNET_TOKEN_TYPE, value=value),)
    session_config = node_session_config(parsed, tokens)
    async with asyncio.timeout(cfg.request_timeout):
        return await connect(url, cfg.transport, cfg.tls, session_config)


class _FetchSession:
    """One fetch-only session of a ``RelayPeer`` (stripe ``1..N-1``): opened with the main session (and by
    a fetch that finds it down), let go when it ended or got a GOAWAY, and opened again no sooner than its
    ``backoff`` allows after a failed attempt or a session that ended within ``STABLE_SESSION_S`` (a node's
    own session's rule)."""

    def __init__(self) -> None:
        self.conn: MoqtConnection | None = None
        self.fetcher: BlockFetcher | None = None
        self.backoff = Backoff()
        self.retry_at = 0.0
        self.opened_at = 0.0

    @property
    def up(self) -> bool:
        return self.conn is not None and not self.conn.is_closed and self.conn.goaway is None


class RelayPeer:
    """The MoQT session to the relay (``kvnet.net.connection``), with the block server and fetcher, and the
    fetch-only sessions a fetch is striped over (``cfg.fetch_connections - 1`` of them).

    The server answers the relay's TRACK_STATUS/FETCH/SUBSCRIBE for our store in its own task for as long
    as the session lives; the fetcher sends our TRACK_STATUS/FETCH through the connection's helpers.
    """

    def __init__(
        self, conn: MoqtConnection, server: BlockServer, fetcher: BlockFetcher, cfg: RelayPeerConfig,
    ) -> None:
        self.conn = conn
        self.server = server
        self.fetcher = fetcher
        self.url = cfg.relay_url
        self._cfg = cfg
        self._fetch_sessions = [_FetchSession() for _ in range(cfg.fetch_connections - 1)]
        self._opening = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._tables_pushed = False
        """This session has pushed the tables of kvtc blocks into the relay (``push``)."""

    @classmethod
    async def connect(
        cls, cfg: RelayPeerConfig, store: BlockStore, cache: CacheWriter, trust: TrustStore, abr: KvAbr, *,
        fingerprint: bytes, namespace_id: str, block_shape: tuple[int, int, int, int], dtype: str,
        device: torch.device, announce: bool = True, locate_fingerprints: Sequence[bytes] = (),
        tables: TablesSource | None = None,
    ) -> RelayPeer:
        """Open the session to ``cfg.relay_url``, announce our namespace and serve ``store`` on it; fetched
        blocks are written into ``cache``. ``namespace_id`` is the namespace-id field of the block
        namespace. A session that only locates passes ``announce=False``: it holds no blocks, so the relay
        must not route requests for the namespace to it. ``locate_fingerprints``: whose tracks a locate
        needs a block in (``BlockFetcher``; by default ``fingerprint``'s own). ``tables``: the node's kvtc
        tables (served from ``tables.served``, fetched into it; a fresh one per session when None)."""
        conn = await _open_session(cfg)
        server = BlockServer(conn, store, fingerprint, namespace_id, block_shape[0],
                             tables=tables.served if tables is not None else None)
        fetcher = BlockFetcher(
            conn, cache, trust, fingerprint=fingerprint, namespace_id=namespace_id, shape=block_shape,
            dtype=dtype, abr=abr, trust_any=cfg.trust_any, timeout=cfg.request_timeout,
            window_bytes=cfg.fetch_window_bytes, device=device, verify_workers=cfg.fetch_verify_workers,
            relay=cfg.relay_url, locate_fingerprints=locate_fingerprints, tables=tables,
        )
        peer = cls(conn, server, fetcher, cfg)
        try:
            if announce:
                async with asyncio.timeout(cfg.request_timeout):
                    await server.announce()
        except RequestRejected as exc:
            # Still useful as a subscriber; a publisher then serves only what it pushed.
            logger.warning("relay refused PUBLISH_NAMESPACE (%s): not serving blocks on request", exc)
        except BaseException:
            await conn.close_session()
            raise
        loop = asyncio.get_running_loop()
        peer._tasks = [loop.create_task(server.serve()), loop.create_task(peer._watch())]
        if peer._fetch_sessions and announce:
            # Opened while the first request locates (a fetch waits for the rest); a locate-only session
            # (announce=False: it holds no blocks and fetches none) opens them only if it ever fetches.
            peer._tasks.append(loop.create_task(peer._open_fetch_sessions()))
        logger.info("connected to relay %s; namespace id %s", cfg.relay_url, namespace_id)
        return peer

    async def _watch(self) -> None:
        code, reason = await self.conn.wait_session_closed()
        if self._closing:
            return
        logger.warning("relay session ended (code %#x): %s", code, reason or "no reason given")

    @property
    def redirect(self) -> str | None:
        """Where the relay's GOAWAY asked us to reconnect (its New Session URI), if it named a relay."""
        goaway = self.conn.goaway
        return None if goaway is None else redirect_target(goaway.new_session_uri)

    async def abandon(self) -> None:
        """Let go of a session that ended or is going away, without waiting for pushes to drain."""
        self._closing = True
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                await self.conn.close_session()
        await self._close_fetch_sessions()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def connected(self) -> bool:
        """The session is up and takes new requests (not closed, no GOAWAY from the relay)."""
        return not self.conn.is_closed and self.conn.goaway is None

    async def locate(self, hashes: list[bytes], renditions: list[str]) -> Located:
        if not self.connected:
            raise ConnectionError("relay session is not up")
        return await self.fetcher.locate(hashes, renditions)

    async def fetch(
        self, expected: list[BlockIdentity], renditions: list[str], deadline: Deadline | None = None,
        *, outcome: FetchOutcome | None = None, on_loaded: Callable[[int], None] | None = None,
        beside_compute: bool = False,
    ) -> FetchOutcome:
        """Fetch, verify and load ``expected`` into the cache, striped over the sessions that are up
        (``kvnet.exchange.striping.fetch_striped``; one session: all blocks on the main session).
        ``beside_compute``: the tail of a split, fetched while the engine computes its head."""
        fetchers = await self.fetchers()
        return await fetch_striped(fetchers, expected, renditions, deadline, abr=self.fetcher.abr,
                                   outcome=outcome, on_loaded=on_loaded, beside_compute=beside_compute)

    async def fetchers(self) -> list[BlockFetcher]:
        """The fetchers of the sessions a fetch is striped over now: the main session first, then each
        fetch-only session that is up, opening (concurrently, within ``request_timeout``) those that are
        not and whose backoff allows. A session that cannot be opened only narrows the stripes."""
        if self._fetch_sessions and not self._closing:
            async with self._opening:
                loop = asyncio.get_running_loop()
                wanted = [fs for fs in self._fetch_sessions if not fs.up and loop.time() >= fs.retry_at]
                if wanted:
                    await asyncio.gather(*(self._open_fetch_session(fs, self._cfg) for fs in wanted))
        extra = [fs.fetcher for fs in self._fetch_sessions if fs.up and fs.fetcher is not None]
        return [self.fetcher, *extra]

    async def _open_fetch_sessions(self) -> None:
        await self.fetchers()

    async def _open_fetch_session(self, fs: _FetchSession, cfg: RelayPeerConfig) -> None:
        loop = asyncio.get_running_loop()
        old, fs.conn, fs.fetcher = fs.conn, None, None
        if old is not None:  # ended, or going away: let it go
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await old.close_session()
            if loop.time() - fs.opened_at >= STABLE_SESSION_S:
                fs.backoff.reset()
            else:  # it did not last (a draining relay sends GOAWAY at once): not again on every fetch
                fs.retry_at = loop.time() + fs.backoff.next_delay()
                return
        try:
            conn = await _open_session(cfg)
        except Exception as exc:  # any failure to connect: fewer stripes for now
            fs.retry_at = loop.time() + fs.backoff.next_delay()
            logger.warning("cannot open a fetch session to relay %s (%s); fetching over fewer sessions",
                           self.url, str(exc) or type(exc).__name__)
            return
        if self._closing:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1):
                    await conn.close_session()
            return
        main = self.fetcher
        fs.conn, fs.opened_at = conn, loop.time()
        fs.fetcher = BlockFetcher(
            conn, main.cache, main.trust, fingerprint=main.fingerprint, namespace_id=main.namespace_id,
            shape=main.shape, dtype=main.dtype, abr=main.abr, trust_any=main.trust_any, timeout=main.timeout,
            window_bytes=main.window_bytes, straggler_grace=main.straggler_grace,
            locate_fan_out=main.locate_fan_out, device=main.device, verify_workers=main.verify_workers,
            inflight=main.inflight, relay=main.relay, locate_fingerprints=main.locate_fingerprints,
            tables=main.tables,
        )

    async def push(self, blocks: list[StoredBlock]) -> int:
        if not self.connected or not blocks:
            return 0
        try:
            if self.server.tables and not self._tables_pushed:
                # Before the first blocks of the session: a relay that caches kvtc blocks can decode them
                # only with their tables, also after we left.
                self._tables_pushed = True
                await self.server.push_tables()
            return await self.server.push(blocks)
        except (MoqtConnectionError, UsageError) as exc:
            logger.warning("pushing blocks to the relay failed: %s", exc)
            return 0

    async def republish(self, max_bytes: int, probes: int = 32) -> tuple[int, int]:
        """Push again what the relay lacks of our store: up to ``max_bytes`` of the most recently used
        blocks, each asked for first with a TRACK_STATUS (at most ``probes`` in flight) and pushed only if
        the relay answers DOES_NOT_EXIST (it neither caches it nor can route to another holder; requests
        are never routed back to us). For a new session: a restarted relay starts with an empty cache.
        Returns (blocks checked, blocks pushed)."""
        candidates = self.server.store.recent(max_bytes)
        slots = asyncio.Semaphore(probes)

        async def lacks(block: StoredBlock) -> bool:
            ns, name = block_track(self.server.fingerprint, self.server.namespace_id, block.block_hash,
                                   block.rendition)
            async with slots:
                try:
                    async with asyncio.timeout(self.fetcher.timeout):
                        await self.conn.track_status(ns, name)
                except RequestRejected as exc:
                    return exc.code == RequestErrorCode.DOES_NOT_EXIST
                except (TimeoutError, MoqtConnectionError):
                    return False
            return False

        missing = await asyncio.gather(*(lacks(b) for b in candidates))
        pushed = await self.push([b for b, m in zip(candidates, missing, strict=True) if m])
        return len(candidates), pushed

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until the relay acknowledged everything we sent (before a one-shot publisher exits), at
        most ``timeout`` seconds."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.conn.wait_send_buffer_empty()

    async def close(self) -> None:
        # Blocks pushed just before exiting must reach the relay's cache first.
        await self.drain(timeout=10.0)
        await self.abandon()

    async def _close_fetch_sessions(self) -> None:
        async def close(conn: MoqtConnection) -> None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await conn.close_session()

        conns = [fs.conn for fs in self._fetch_sessions if fs.conn is not None]
        for fs in self._fetch_sessions:
            fs.conn = fs.fetcher = None
        await asyncio.gather(*(close(c) for c in conns))
