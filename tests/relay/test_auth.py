"""Relay authorization against relays in the test's own process (``tests.relay.inprocess``, real QUIC on
loopback): kvnet tokens in SETUP and in requests, per-namespace scopes, the draft's error codes, tenant
isolation, and relay-to-relay links with --upstream-token."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvnet.net.config import TlsConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.net.errors import ConnectionClosed, RequestRejected
from kvnet.security.tokens import Action, IssuerKey, issue_token, make_claims
from proto.errors import RequestErrorCode, SessionErrorCode
from proto.messages import AliasType, AuthToken, Location, MessageParameters
from proto.session import SessionConfig
from tests.helpers.connections import client_config, client_limits
from tests.helpers.processes import CertDir
from tests.relay.conftest import InProcessRelays
from tests.relay.inprocess import InProcessRelay
from tests.relay.peers import Publisher, fetch_track, track_objects

NS_A = (b"kvnet", b"v1", b"fp", b"tenant-a")
NS_B = (b"kvnet", b"v1", b"fp", b"tenant-b")


@dataclass
class Issuer:
    key: IssuerKey
    pub_path: Path

    def token(
        self, actions: list[str], prefixes: list[tuple[bytes, ...]], *, lifetime: float = 600, ago: float = 0
    ) -> bytes:
        claims = make_claims("test", "t", actions, prefixes, now=time.time() - ago, lifetime_s=lifetime)
        return issue_token(self.key, claims)


@pytest.fixture
def issuer(tmp_path: Path) -> Issuer:
    key = IssuerKey.generate()
    path = tmp_path / "issuer.pub"
    key.save_public(path)
    return Issuer(key, path)


def _tok(value: bytes) -> tuple[AuthToken, ...]:
    return (AuthToken(AliasType.USE_VALUE, token_type=0, value=value),)


def _params(value: bytes) -> MessageParameters:
    return MessageParameters(authorization_tokens=_tok(value))


async def _client(rp: InProcessRelay, cert_dir: CertDir, token: bytes | None = None) -> MoqtConnection:
    cfg = SessionConfig(is_client=True, authorization_tokens=_tok(token) if token else ())
    return await connect(rp.url, client_config(), TlsConfig(ca_file=cert_dir.ca), session_config=cfg,
                         limits=client_limits())


async def _code(coro: object) -> int:
    with pytest.raises(RequestRejected) as ei:
        await coro  # type: ignore[misc]
    return ei.value.code


async def test_scopes_codes_and_tenant_isolation(
    issuer: Issuer, cert_dir: CertDir, tmp_path: Path, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--auth-issuer-key", str(issuer.pub_path))
    objs = track_objects(b"blk", 3)
    pub_conn = await _client(rp, cert_dir, issuer.token(["publish"], [NS_A]))
    pub = await Publisher(pub_conn, {b"blk": objs}, namespace=NS_A).start()
    sub_a = await _client(rp, cert_dir, issuer.token(["subscribe"], [NS_A]))
    sub_b = await _client(rp, cert_dir, issuer.token(["subscribe"], [NS_B]))
    anon = await _client(rp, cert_dir)
    try:
        # Valid tokens work, and the track is now cached.
        assert await fetch_track(sub_a, b"blk", 3, ns=NS_A) == objs
        st = await sub_a.track_status(NS_A, b"blk")
        assert st.parameters.largest_object == Location(0, 2)
        # Tenant B knows the names but is out of scope: the same answer for a cached track and a miss.
        refused = []
        for name in (b"blk", b"never-published"):
            with pytest.raises(RequestRejected) as ei:
                await sub_b.track_status(NS_A, name)
            refused.append((ei.value.code, ei.value.reason))
            with pytest.raises(RequestRejected) as ei:
                await fetch_track(sub_b, name, 3, ns=NS_A)
            refused.append((ei.value.code, ei.value.reason))
        assert {r[0] for r in refused} == {RequestErrorCode.UNAUTHORIZED}
        assert refused[0] == refused[2] and refused[1] == refused[3]
        # A subscribe-only token cannot publish; no token at all is unauthorized.
        assert await _code(sub_a.publish_namespace(NS_A)) == RequestErrorCode.UNAUTHORIZED
        assert await _code(anon.track_status(NS_A, b"blk")) == RequestErrorCode.UNAUTHORIZED
        # A request's own token overrides the session's: expired, forged, garbage, then a good one.
        expired = issuer.token(["subscribe"], [NS_A], lifetime=10, ago=3600)
        code = await _code(anon.track_status(NS_A, b"blk", _params(expired)))
        assert code == RequestErrorCode.EXPIRED_AUTH_TOKEN
        good = issuer.token(["subscribe"], [NS_A])
        forged = good[:-1] + bytes([good[-1] ^ 1])
        code = await _code(anon.track_status(NS_A, b"blk", _params(forged)))
        assert code == RequestErrorCode.MALFORMED_AUTH_TOKEN
        assert (
            await _code(anon.track_status(NS_A, b"blk", _params(b"junk")))
            == RequestErrorCode.MALFORMED_AUTH_TOKEN
        )
        stranger = Issuer(IssuerKey.generate(), tmp_path / "x").token(["subscribe"], [NS_A])
        code = await _code(anon.track_status(NS_A, b"blk", _params(stranger)))
        assert code == RequestErrorCode.UNAUTHORIZED
        ok = await anon.track_status(NS_A, b"blk", _params(good))
        assert ok.parameters.largest_object == Location(0, 2)
        # Discovery is scoped too.
        assert await _code(sub_b.subscribe(NS_A, b"blk")) == RequestErrorCode.UNAUTHORIZED
        assert rp.value("auth_refusals_total", code="unauthorized") >= 7
    finally:
        await pub.stop()
        for c in (sub_a, sub_b, anon):
            await c.close_session()


async def test_bad_setup_token_closes_the_session(
    issuer: Issuer, cert_dir: CertDir, in_process_relays: InProcessRelays
) -> None:
    rp = await in_process_relays("--auth-issuer-key", str(issuer.pub_path))
    expired = issuer.token(["subscribe"], [NS_A], lifetime=10, ago=3600)
    cases = [(expired, SessionErrorCode.EXPIRED_AUTH_TOKEN), (b"junk", SessionErrorCode.MALFORMED_AUTH_TOKEN)]
    for token, code in cases:
        conn = await _client(rp, cert_dir, token)  # SETUP completes, then the relay checks the token
        try:
            got, _ = await conn.wait_session_closed()
            assert got == code
        finally:
            await conn.close_session()
        with pytest.raises(ConnectionClosed):
            await conn.track_status(NS_A, b"x")


async def test_edge_to_origin_needs_upstream_token(
    issuer: Issuer, cert_dir: CertDir, tmp_path: Path, in_process_relays: InProcessRelays
) -> None:
    origin = await in_process_relays("--auth-issuer-key", str(issuer.pub_path))
    token_file = tmp_path / "edge.token"
    token_file.write_bytes(base64.urlsafe_b64encode(issuer.token([Action.RELAY.value], [()])).rstrip(b"="))
    edge = await in_process_relays("--upstream", origin.url, "--upstream-token", str(token_file))
    bare = await in_process_relays("--upstream", origin.url)
    objs = track_objects(b"up", 3)
    pub_conn = await _client(origin, cert_dir, issuer.token(["publish"], [NS_A]))
    pub = await Publisher(pub_conn, {b"up": objs}, namespace=NS_A).start()
    via_edge = await _client(edge, cert_dir)
    via_bare = await _client(bare, cert_dir)
    try:
        assert await fetch_track(via_edge, b"up", 3, ns=NS_A) == objs
        assert await _code(via_bare.track_status(NS_A, b"up")) == RequestErrorCode.UNAUTHORIZED
        assert await _code(fetch_track(via_bare, b"up", 3, ns=NS_A)) == RequestErrorCode.UNAUTHORIZED
        assert pub.counts["fetch"] == 1
    finally:
        await pub.stop()
        await via_edge.close_session()
        await via_bare.close_session()
