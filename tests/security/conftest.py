"""Fixtures for security tests: the relay fixtures (dev CA, real relay processes) and the node cluster.

Everything here is a real process or a real QUIC peer on loopback; the fixtures come from the relay and
node test packages so that both suites start processes the same way.
"""

from __future__ import annotations

from tests.nodes.conftest import kv_cluster
from tests.relay.conftest import cert_dir, relay, relay_factory

__all__ = ["cert_dir", "kv_cluster", "relay", "relay_factory"]
