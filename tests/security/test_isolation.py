"""Tenant isolation: tenant B cannot locate, fetch or time-probe tenant A's cached prefixes.

* Node secrets: real publisher and subscriber processes. Salts derive from ``--node-secret`` and
  ``--tenant``; a subscriber of another tenant (same secret) or of the same tenant id under another
  secret computes other hashes, so A's blocks are not even located, and its output is still a verified
  recompute. Only the same secret and the same tenant hit.
* Node tokens: nodes present ``--token`` in SETUP; a relay requiring authorization serves a subscriber
  whose token covers the tenant's namespace and refuses one scoped to another namespace or without one.
* Relay authorization (``--auth-issuer-key``): B's token is scoped to B's namespace; a TRACK_STATUS or
  FETCH for A's exact track is refused with the same code whether or not A's track is cached, the
  publisher is never asked, and response times for cached and uncached tracks have the same median.
  Expired, forged, wrongly scoped and unknown-issuer tokens are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import ConnectionClosed, MoqtConnectionError, RequestRejected
from kvnet.node.config import NodeConfig
from kvnet.node.node import Node
from kvnet.security.tenancy import NodeSecret
from kvnet.security.tokens import IssuerKey, issue_token, make_claims
from proto.errors import RequestErrorCode, SessionErrorCode
from proto.kvobject import block_namespace
from proto.messages import AliasType, AuthToken, Location
from proto.session import SessionConfig
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir, RelayProcess
from tests.helpers.waiting import async_wait_until, scaled
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster
from tests.relay.conftest import RelayFactory
from tests.relay.peers import Publisher, fetch_track, track_objects

PROMPT = SHARED_PREFIX + "Question: which tenant asked this?"


# -- node secrets and tenants (nodes) ------------------------------------------------------------------


def secret_file(path: Path) -> str:
    NodeSecret.generate(path)
    return str(path)


def finish(c: Cluster, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The single JSON report of a one-prompt ``--verify`` subscriber that must exit 0."""
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0, f"subscriber rc={proc.returncode}: {c.log_of(proc)[-3000:]}"
    (report,) = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    assert report["verified"] is True, report
    return dict(report)


def assert_miss(report: dict[str, Any]) -> None:
    assert report["located_blocks"] == 0 and report["remote_hit_tokens"] == 0, report
    assert report["computed_tokens"] == report["prompt_tokens"]


def test_other_tenant_or_other_secret_never_hits(kv_cluster: Cluster, tmp_path: Path) -> None:
    c = kv_cluster
    s1, s2 = secret_file(tmp_path / "secret-1"), secret_file(tmp_path / "secret-2")
    c.start_relay()
    c.publish_and_exit([PROMPT], "--node-secret", s1, "--tenant", "a")
    verify = ("--verify", "--timeout", "5")
    # Both misses run at once: same secret, other tenant; same tenant id, other secret.
    other_tenant = c.start_subscriber([PROMPT], *verify, "--node-secret", s1, "--tenant", "b")
    other_secret = c.start_subscriber([PROMPT], *verify, "--node-secret", s2, "--tenant", "a")
    assert_miss(finish(c, other_tenant))
    assert_miss(finish(c, other_secret))
    # Positive control: the same secret and tenant reuse the prefix through the same relay.
    same = finish(c, c.start_subscriber([PROMPT], *verify, "--node-secret", s1, "--tenant", "a"))
    assert same["remote_hit_tokens"] > 0 and same["security_events"] == [], same


def test_tenant_needs_a_node_secret_and_salts_are_not_flags(kv_cluster: Cluster, tmp_path: Path) -> None:
    c = kv_cluster
    # Without a secret only the default tenant exists: another tenant would share its unsalted hashes.
    proc = c.start_subscriber([PROMPT], "--tenant", "b")
    proc.communicate(timeout=scaled(120))
    assert proc.returncode != 0
    assert "needs --node-secret" in c.log_of(proc), c.log_of(proc)[-2000:]
    # A salt cannot be given, only derived.
    proc = c.start_subscriber([PROMPT], "--salt", "chosen-by-the-client")
    proc.communicate(timeout=scaled(120))
    assert proc.returncode == 2 and "unrecognized arguments: --salt" in c.log_of(proc)
    # A secret file others can read is refused before anything starts.
    loose = tmp_path / "loose-secret"
    NodeSecret.generate(loose)
    os.chmod(loose, 0o644)
    proc = c.start_subscriber([PROMPT], "--node-secret", str(loose), "--tenant", "a")
    proc.communicate(timeout=scaled(120))
    assert proc.returncode != 0 and "group or others" in c.log_of(proc), c.log_of(proc)[-2000:]


def token_file(path: Path, value: bytes) -> str:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(value)
    return str(path)


def test_node_tokens_are_scoped_to_the_tenant_namespace(kv_cluster: Cluster, tmp_path: Path) -> None:
    c = kv_cluster
    secret_path = tmp_path / "secret"
    secret = NodeSecret.generate(secret_path)
    key = IssuerKey.generate()
    key.save_public(tmp_path / "issuer.pub")
    c.start_relay("--auth-issuer-key", str(tmp_path / "issuer.pub"))
    # Tokens name the block namespace, so the test computes the fingerprint of the nodes' model.
    fingerprint = Node.from_config(NodeConfig(model="tiny", block_size=TEST_BLOCK_SIZE)).fingerprint
    ns_a = block_namespace(fingerprint, secret.namespace_id("a"))
    ns_b = block_namespace(fingerprint, secret.namespace_id("b"))
    now = time.time()

    def tok(name: str, actions: list[str], ns: tuple[bytes, ...]) -> str:
        claims = make_claims(name, "a", actions, [ns], now=now, lifetime_s=600)
        return token_file(tmp_path / name, issue_token(key, claims))

    node = ("--model", "tiny", "--block-size", str(TEST_BLOCK_SIZE))
    tenant = (*node, "--node-secret", str(secret_path), "--tenant", "a")
    c.publish_and_exit([PROMPT], *tenant, "--token", tok("publisher", ["publish"], ns_a))
    verify = ("--verify", "--timeout", "5", *tenant)
    # Refused: a token for another tenant's namespace, and no token at all. The node recomputes.
    wrong = c.start_subscriber([PROMPT], *verify, "--token", tok("wrong-scope", ["subscribe"], ns_b))
    none = c.start_subscriber([PROMPT], *verify)
    assert_miss(finish(c, wrong))
    assert_miss(finish(c, none))
    refusals = sum(v for k, v in c.relay_metrics().items() if k.startswith("kvnet_relay_auth_refusals_total"))
    assert refusals >= 2, c.relay_metrics()
    # The tenant's own subscribe token reuses what its publisher pushed.
    good = finish(c, c.start_subscriber([PROMPT], *verify, "--token", tok("subscriber", ["subscribe"], ns_a)))
    assert good["remote_hit_tokens"] > 0, good


# -- relay authorization ----------------------------------------------------------------------------------

NS_A = (b"kvnet", b"v1", b"fp-sec", b"tenant-a")
NS_B = (b"kvnet", b"v1", b"fp-sec", b"tenant-b")
AUTH_FLAG = "--auth-issuer-key"


def token(
    issuer: IssuerKey,
    tenant: str,
    actions: list[str],
    prefix: tuple[bytes, ...],
    *,
    now: float | None = None,
    lifetime: float = 600,
) -> bytes:
    claims = make_claims(
        f"{tenant}-client", tenant, actions, [prefix], now=now or time.time(), lifetime_s=lifetime
    )
    return issue_token(issuer, claims)


async def connect_with(rp: RelayProcess, ca: Path, value: bytes | None) -> MoqtConnection:
    tokens = () if value is None else (AuthToken(AliasType.USE_VALUE, token_type=0, value=value),)
    cfg = SessionConfig(is_client=True, authority=f"127.0.0.1:{rp.port}", authorization_tokens=tokens)
    return await connect(rp.url, client_config(), TlsConfig(ca_file=ca), session_config=cfg,
                         limits=client_limits())


async def refusal(rp: RelayProcess, ca: Path, value: bytes | None) -> int:
    """The code with which the relay refuses a session carrying ``value`` in SETUP (or its first request)."""
    try:
        conn = await connect_with(rp, ca, value)
    except MoqtConnectionError as exc:
        cause = exc.__cause__
        assert isinstance(cause, ConnectionClosed), exc
        return cause.error_code
    try:
        await asyncio.wait_for(conn.track_status(NS_A, b"cached"), scaled(10))
    except RequestRejected as exc:
        return exc.code
    except ConnectionClosed as exc:
        return exc.error_code
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close_session(), scaled(5))
    raise AssertionError("the relay served a request with this token")


@pytest.fixture
def issuer(tmp_path: Path) -> tuple[IssuerKey, Path]:
    key = IssuerKey.generate()
    pub = tmp_path / "issuer.pub"
    key.save_public(pub)
    return key, pub


async def start_tenant_a(rp: RelayProcess, ca: Path, key: IssuerKey) -> Publisher:
    conn = await connect_with(rp, ca, token(key, "a", ["publish", "subscribe"], NS_A))
    pub = await Publisher(
        conn, {b"cached": track_objects(b"cached"), b"uncached": track_objects(b"uncached")}, namespace=NS_A
    ).start()
    # Another client of tenant A reads one track, so the relay holds it in its cache.
    reader = await connect_with(rp, ca, token(key, "a", ["subscribe"], NS_A))
    try:
        assert await fetch_track(reader, b"cached", 4, NS_A) == pub.tracks[b"cached"]
    finally:
        await reader.close_session()
    return pub


async def probe(conn: MoqtConnection, name: bytes, fetch: bool) -> tuple[int, float]:
    started = time.perf_counter()
    try:
        if fetch:
            h = await conn.fetch(NS_A, name, Location(0, 0), Location(0, 4))
            await asyncio.wait_for(h.read_all(), scaled(10))
        else:
            await asyncio.wait_for(conn.track_status(NS_A, name), scaled(10))
    except RequestRejected as exc:
        return exc.code, time.perf_counter() - started
    raise AssertionError(f"tenant B got tenant A's track {name!r}")


async def test_scoped_token_cannot_locate_or_time_probe(
    cert_dir: CertDir, relay_factory: RelayFactory, issuer: tuple[IssuerKey, Path]
) -> None:
    key, pub_path = issuer
    rp = relay_factory(AUTH_FLAG, str(pub_path), "--log-level", "info")
    pub = await start_tenant_a(rp, cert_dir.ca, key)
    b = await connect_with(rp, cert_dir.ca, token(key, "b", ["subscribe"], NS_B))
    try:
        asked_before = dict(pub.counts)
        for fetch in (False, True):
            cached_code, _ = await probe(b, b"cached", fetch)
            uncached_code, _ = await probe(b, b"uncached", fetch)
            absent_code, _ = await probe(b, b"never-published", fetch)
            # One answer for all three: B cannot tell cached, publishable and absent tracks apart.
            assert cached_code == uncached_code == absent_code, (cached_code, uncached_code, absent_code)
            assert cached_code == RequestErrorCode.UNAUTHORIZED  # relay.auth checks scope before lookups
        # Refused before any lookup: nothing was forwarded to tenant A's publisher.
        assert dict(pub.counts) == asked_before

        # Timing: interleaved probes of the cached and the uncached track; equal medians within a loose
        # tolerance (a cache lookup would make the cached answer an upstream round trip faster or slower).
        cached: list[float] = []
        uncached: list[float] = []
        for _ in range(150):
            cached.append((await probe(b, b"cached", False))[1])
            uncached.append((await probe(b, b"uncached", False))[1])
        mc, mu = statistics.median(cached), statistics.median(uncached)
        assert abs(mc - mu) <= max(0.002, 0.35 * max(mc, mu)), (mc, mu)
        assert dict(pub.counts) == asked_before
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(b.close_session(), scaled(5))
        await pub.stop()


async def test_bad_tokens_are_refused(
    cert_dir: CertDir, relay_factory: RelayFactory, issuer: tuple[IssuerKey, Path]
) -> None:
    key, pub_path = issuer
    rp = relay_factory(AUTH_FLAG, str(pub_path), "--log-level", "info")
    pub = await start_tenant_a(rp, cert_dir.ca, key)
    try:
        good = token(key, "a", ["subscribe"], NS_A)
        expired = token(key, "a", ["subscribe"], NS_A, now=time.time() - 7200, lifetime=60)
        forged = bytearray(good)
        forged[-1] ^= 0x01  # signature no longer verifies
        other_issuer = token(IssuerKey.generate(), "a", ["subscribe"], NS_A)
        wrong_scope = token(key, "a", ["subscribe"], (*NS_A[:3], b"tenant-ab"))
        publish_only = token(key, "a", ["publish"], NS_A)

        expired_codes = (SessionErrorCode.EXPIRED_AUTH_TOKEN, RequestErrorCode.EXPIRED_AUTH_TOKEN)
        malformed_codes = (SessionErrorCode.MALFORMED_AUTH_TOKEN, RequestErrorCode.MALFORMED_AUTH_TOKEN)
        unauthorized = (SessionErrorCode.UNAUTHORIZED, RequestErrorCode.UNAUTHORIZED)
        assert await refusal(rp, cert_dir.ca, expired) in expired_codes
        assert await refusal(rp, cert_dir.ca, bytes(forged)) in malformed_codes
        assert await refusal(rp, cert_dir.ca, b"not a kvnet token") in malformed_codes
        assert await refusal(rp, cert_dir.ca, other_issuer) in unauthorized
        assert await refusal(rp, cert_dir.ca, wrong_scope) in unauthorized
        assert await refusal(rp, cert_dir.ca, publish_only) in unauthorized
        assert await refusal(rp, cert_dir.ca, None) in unauthorized

        # The good token works on the same relay, so the refusals above are about the tokens.
        ok = await connect_with(rp, cert_dir.ca, good)
        try:
            assert await fetch_track(ok, b"cached", 4, NS_A) == pub.tracks[b"cached"]
        finally:
            await ok.close_session()
    finally:
        await pub.stop()


async def test_token_is_refused_after_expiry_plus_the_clock_skew(
    cert_dir: CertDir, relay_factory: RelayFactory, issuer: tuple[IssuerKey, Path]
) -> None:
    """A token issued for 2 s works until ``expires + --auth-clock-skew`` and is refused from then on, both
    as the SETUP credential of a live session (rechecked on every request) and in a new SETUP."""
    key, pub_path = issuer
    skew = 1.0
    rp = relay_factory(AUTH_FLAG, str(pub_path), "--auth-clock-skew", str(skew), "--log-level", "info")
    pub = await start_tenant_a(rp, cert_dir.ca, key)
    claims = make_claims("a-client", "a", ["subscribe"], [NS_A], now=time.time(), lifetime_s=2)
    assert claims.expires - claims.not_before == 2
    refused_from = claims.expires + skew
    value = issue_token(key, claims)
    conn = await connect_with(rp, cert_dir.ca, value)
    try:
        last_served = 0.0

        async def refused() -> int | None:
            nonlocal last_served
            asked_at = time.time()
            try:
                await asyncio.wait_for(conn.track_status(NS_A, b"cached"), scaled(10))
            except RequestRejected as exc:
                # The relay refused no later than now: refusing before ``refused_from`` would show here.
                answered_at = time.time()
                assert answered_at >= refused_from, f"refused {answered_at - claims.expires:.2f}s past expiry"
                return exc.code
            # Served: the relay checked the token no earlier than we asked, so it was still valid then.
            assert asked_at < refused_from, f"served {asked_at - claims.expires:.2f} s after expiry"
            last_served = asked_at
            return None

        code = await async_wait_until(refused, "expired SETUP credential refused", timeout=30, interval=0.1)
        assert code == RequestErrorCode.EXPIRED_AUTH_TOKEN
        assert last_served > 0, "the token was never accepted while valid"
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(conn.close_session(), scaled(5))
    # A new session presenting the same token in SETUP is closed with the session code.
    assert await refusal(rp, cert_dir.ca, value) == SessionErrorCode.EXPIRED_AUTH_TOKEN
    await pub.stop()
