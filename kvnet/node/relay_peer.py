"""The node's one MoQT session to its relay: connect, announce, serve our blocks, locate and fetch.

Owns ``RelayPeer``: it opens the session (TLS settings, authorization token, SETUP limits), wires a
``BlockServer`` (answers the relay's requests for our store in its own task) and a ``BlockFetcher`` (our
locates and fetches) to it, pushes new blocks, and drains and closes it on shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvnet.blocks.identity import BlockIdentity
from kvnet.blocks.signing import TrustStore
from kvnet.dtypes import dtype_name
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from kvnet.net.reconnect import redirect_target
from kvnet.net.settings import TlsSettings
from kvnet.net.url import MoqtUrl, parse_moqt_url
from kvnet.node.abr import FetchDeadline, KvAbr
from kvnet.node.blockstore import BlockStore, StoredBlock
from kvnet.node.config import NodeConfig
from kvnet.node.fetching import BlockFetcher, CacheWriter, FetchOutcome
from kvnet.node.locate import Located
from kvnet.node.publishing import BlockServer
from kvnet.security.tokens import KVNET_TOKEN_TYPE, read_token_file
from proto.errors import RequestErrorCode, UsageError
from proto.kvobject import BLOCK_GROUP_ID, MANIFEST_OBJECT_ID, MAX_MANIFEST_BYTES, block_track
from proto.messages import AliasType, AuthToken
from proto.session import SessionConfig

if TYPE_CHECKING:
    from kvnet.node.node import Node

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

class RelayPeer:
    """The node's one MoQT session to its relay (``kvnet.net.connection``), with the block server and fetcher.

    The server answers the relay's TRACK_STATUS/FETCH/SUBSCRIBE for our store in its own task for as long
    as the session lives; the fetcher sends our TRACK_STATUS/FETCH through the connection's helpers.
    """

    def __init__(self, conn: MoqtConnection, server: BlockServer, fetcher: BlockFetcher, url: str) -> None:
        self.conn = conn
        self.server = server
        self.fetcher = fetcher
        self.url = url
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @classmethod
    async def open(cls, node: Node, url: str | None = None) -> RelayPeer:
        """The node's session to its relay, or to ``url`` instead (where a GOAWAY sent it)."""
        spec = node.cache.spec
        cfg = node.config if url is None else dataclasses.replace(node.config, relay_url=url)
        return await cls.connect(
            cfg, node.store, node.cache, node.trust, node.abr, fingerprint=node.fingerprint,
            namespace_id=node.namespace_id, block_shape=spec.block_shape, dtype=dtype_name(spec.dtype),
            device=node.device,
        )

    @classmethod
    async def connect(
        cls, cfg: NodeConfig, store: BlockStore, cache: CacheWriter, trust: TrustStore, abr: KvAbr, *,
        fingerprint: bytes, namespace_id: str, block_shape: tuple[int, int, int, int], dtype: str,
        device: torch.device, announce: bool = True,
    ) -> RelayPeer:
        """Open the session to ``cfg.relay_url``, announce our namespace and serve ``store`` on it; fetched
        blocks are written into ``cache`` (what ``open`` does for a ``Node``; engines that keep their own KV
        cache call this directly). ``namespace_id`` is the namespace-id field of the block namespace. A
        session that only locates passes ``announce=False``: it holds no blocks, so the relay must not
        route requests for the namespace to it."""
        assert cfg.relay_url is not None
        url = parse_moqt_url(cfg.relay_url)
        tokens: tuple[AuthToken, ...] = ()
        if cfg.token_file is not None:
            value = read_token_file(cfg.token_file)
            tokens = (AuthToken(AliasType.USE_VALUE, token_type=KVNET_TOKEN_TYPE, value=value),)
        session_config = node_session_config(url, tokens)
        tls = TlsSettings(ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_file)
        settings = cfg.transport_settings
        conn = await asyncio.wait_for(
            connect(cfg.relay_url, settings, tls, session_config), cfg.request_timeout
        )
        server = BlockServer(conn, store, fingerprint, namespace_id, block_shape[0])
        fetcher = BlockFetcher(
            conn, cache, trust, fingerprint=fingerprint, namespace_id=namespace_id, shape=block_shape,
            dtype=dtype, abr=abr, trust_any=cfg.trust_any, timeout=cfg.request_timeout,
            window_bytes=cfg.fetch_window_bytes, device=device, verify_workers=cfg.fetch_verify_workers,
        )
        peer = cls(conn, server, fetcher, cfg.relay_url)
        try:
            if announce:
                await asyncio.wait_for(server.announce(), cfg.request_timeout)
        except RequestRejected as exc:
            # Still useful as a subscriber; a publisher then serves only what it pushed.
            logger.warning("relay refused PUBLISH_NAMESPACE (%s): not serving blocks on request", exc)
        except BaseException:
            await conn.close_session()
            raise
        loop = asyncio.get_running_loop()
        peer._tasks = [loop.create_task(server.serve()), loop.create_task(peer._watch())]
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
            await asyncio.wait_for(self.conn.close_session(), 5)
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
        self, expected: list[BlockIdentity], renditions: list[str], deadline: FetchDeadline | None = None,
        *, outcome: FetchOutcome | None = None, on_loaded: Callable[[int], None] | None = None,
    ) -> FetchOutcome:
        """Fetch, verify and load ``expected`` into the cache (``BlockFetcher.fetch``)."""
        return await self.fetcher.fetch(expected, renditions, deadline, outcome=outcome, on_loaded=on_loaded)

    async def push(self, blocks: list[StoredBlock]) -> int:
        if not self.connected or not blocks:
            return 0
        try:
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
                    await asyncio.wait_for(self.conn.track_status(ns, name), self.fetcher.timeout)
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
            await asyncio.wait_for(self.conn.wait_send_buffer_empty(), timeout)

    async def close(self) -> None:
        # Blocks pushed just before exiting must reach the relay's cache first.
        await self.drain(timeout=10.0)
        self._closing = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close_session(), 5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
