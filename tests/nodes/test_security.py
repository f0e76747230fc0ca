"""Security wiring of the nodes against a real relay: authorization tokens in SETUP, the trust store, and
security events in the report and /metrics."""

from __future__ import annotations

import json
import time
from pathlib import Path

from kvnet.security import tokens as auth
from kvnet.security.signing import generate_keypair
from tests.helpers.waiting import scaled
from tests.nodes.cluster import SHARED_PREFIX, TEST_BLOCK_SIZE, Cluster

B = TEST_BLOCK_SIZE


def _token(issuer: auth.IssuerKey, path: Path, actions: list[str]) -> Path:
    claims = auth.make_claims("node", "default", actions, [(b"kvnet",)], now=time.time(), lifetime_s=600)
    path.write_bytes(auth.issue_token(issuer, claims))
    return path


def test_token_is_presented_in_setup(kv_cluster: Cluster) -> None:
    issuer = auth.IssuerKey.generate()
    issuer.save_public(kv_cluster.tmp / "issuer.pub")
    kv_cluster.start_relay("--auth-issuer-key", str(kv_cluster.tmp / "issuer.pub"))
    pub_token = _token(issuer, kv_cluster.tmp / "pub.token", ["publish"])
    sub_token = _token(issuer, kv_cluster.tmp / "sub.token", ["subscribe"])
    kv_cluster.start_publisher([SHARED_PREFIX], "--token", str(pub_token))
    prompt = SHARED_PREFIX + "who may read this?"
    (anonymous,) = kv_cluster.subscribe([prompt], "--verify")
    assert anonymous["remote_hit_tokens"] == 0 and anonymous["verified"]
    (authorized,) = kv_cluster.subscribe([prompt], "--token", str(sub_token), "--verify")
    assert authorized["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B
    assert authorized["verified"]


def test_untrusted_signer_is_a_security_event_unless_trust_any(kv_cluster: Cluster) -> None:
    kv_cluster.start_relay()
    key = generate_keypair(kv_cluster.tmp / "stranger", "evil")
    kv_cluster.start_publisher([SHARED_PREFIX], "--signing-key", str(key.private))
    prompt = SHARED_PREFIX + "x"
    (refused,) = kv_cluster.subscribe([prompt], "--verify")
    assert refused["remote_hit_tokens"] == 0 and refused["verified"]
    assert [e["kind"] for e in refused["security_events"]] == ["signature"]
    proc = kv_cluster.start_subscriber([prompt, prompt + "y"], "--trust-any")
    out, _ = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 0
    accepted = json.loads(out.decode().splitlines()[0])
    assert accepted["remote_hit_tokens"] == (len(SHARED_PREFIX) + 1) // B * B
    # Accepted, but no trusted publisher vouches for these K/V: never reported exact (nor, with --verify,
    # verified; docs/nodes.md "What verified means").
    assert accepted["security_events"] == [] and accepted["kv_exact"] is False
    assert "trust-any" in kv_cluster.log_of(proc) and "ANY key" in kv_cluster.log_of(proc)
