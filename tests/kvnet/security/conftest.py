"""Fixtures of the security tests."""

from __future__ import annotations

import pytest

from kvnet.security.tokens import IssuerKey


@pytest.fixture(scope="module")
def issuer() -> IssuerKey:
    return IssuerKey.generate()
