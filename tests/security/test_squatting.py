"""Sharing an attacker cannot squat: a relay with a trust set (``--trust``) never lets an earlier
publisher's empty, incomplete or untrusted copy of a block track keep a trusted publisher's copy out.

The attacker holds a valid relay session (what a publish token gives) and an untrusted signing key. It
goes first twice over: it PUBLISHes every block track of the prompt and sends nothing (the tracks stay
open, as if it were about to send), then pushes forged blocks of the same prompt (right hashes, parents
and token ids, altered K/V, its own signature) and announces the namespace to serve them on request.
Then the trusted publisher (a real ``python -m publisher`` process) publishes the same prefix, and a real
subscriber gets a verified remote hit of the whole prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.security.signing import Signer, generate_keypair
from proto.kvobject import block_track
from tests.helpers.connections import client_config, client_limits
from tests.helpers.waiting import async_wait_until, scaled
from tests.nodes.cluster import Cluster
from tests.security.test_poisoning import BLOCK, MODEL, PROMPT, forge_blocks, run_subscriber, serve_forged


def relay_metric(c: Cluster, prefix: str) -> float:
    return sum(v for k, v in c.relay_metrics().items() if k.startswith(prefix))


async def squat_empty(c: Cluster, tracks: list[tuple[tuple[bytes, ...], bytes]]) -> MoqtConnection:
    """PUBLISH every track and send nothing: the relay holds each as a live track of this session."""
    conn = await connect(c.url(), client_config(), TlsConfig(ca_file=c.ca), limits=client_limits())
    for alias, (ns, name) in enumerate(tracks, start=1):
        await conn.publish(ns, name, alias)
    return conn


async def test_attacker_first_cannot_squat_a_trusted_prefix(kv_cluster: Cluster, tmp_path: Path) -> None:
    c = kv_cluster
    trusted = generate_keypair(tmp_path / "trusted-keys")
    c.start_relay("--trust", str(trusted.public))
    node, forged = await asyncio.to_thread(forge_blocks, PROMPT, Signer.generate())
    tracks = [block_track(node.fingerprint, "default", b.block_hash, b.rendition) for b in forged]
    squatter = await squat_empty(c, tracks)
    poisoner, task = await serve_forged(c, node, forged)  # pushes every forged block, then serves them
    try:
        # Every forged copy was refused at the cache's door (its key is not in the relay's trust set).
        await async_wait_until(
            lambda: relay_metric(c, 'kvnet_relay_blocks_refused_total{reason="signature"') >= len(forged),
            "forged blocks refused by the relay",
        )
        assert relay_metric(c, "kvnet_relay_cache_tracks") == 0

        # The trusted publisher publishes the same prefix while the squatter's tracks are still open.
        c.publish_and_exit(
            [PROMPT], "--model", MODEL, "--block-size", str(BLOCK), "--key-dir", str(trusted.private.parent)
        )
        await async_wait_until(
            lambda: relay_metric(c, "kvnet_relay_cache_tracks") >= len(forged), "trusted blocks cached"
        )
        rc, report, log = await asyncio.to_thread(run_subscriber, c, PROMPT, "--trust", str(trusted.public))
        assert rc == 0, log[-3000:]
        assert report["verified"] is True, report
        usable = (report["prompt_tokens"] - 1) // BLOCK
        assert report["remote_hit_tokens"] == usable * BLOCK, report  # the whole prefix, remotely
        assert report["security_events"] == [] and report["fallback"] == [], report
        assert relay_metric(c, "kvnet_relay_blocks_refused_total") == len(forged)  # nothing else refused
        assert (
            not squatter.is_closed
        )  # the squat was not broken by closing the attacker: it just did not work
    finally:
        task.cancel()
        for conn in (squatter, poisoner):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close_session(), scaled(5))
