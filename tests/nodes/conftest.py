"""Fixtures for node tests: a per-test cluster of real processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nodes.cluster import Cluster, cluster


@pytest.fixture
def kv_cluster(tmp_path: Path) -> Iterator[Cluster]:
    with cluster(tmp_path) as c:
        yield c
