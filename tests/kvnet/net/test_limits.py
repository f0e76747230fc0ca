"""kvnet.net.limits: ``ConnectionLimits`` refuses a limit that could never be met."""

from __future__ import annotations

import pytest

from kvnet.net.limits import ConnectionLimits


@pytest.mark.parametrize(
    "field", ["max_outstanding_requests", "max_send_buffer", "max_receive_buffer", "max_incoming_queue"]
)
def test_a_count_or_size_limit_must_be_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**{field: 0})


def test_timeouts() -> None:
    with pytest.raises(ValueError, match="setup_timeout"):
        ConnectionLimits(setup_timeout=0)
    with pytest.raises(ValueError, match="publish_done_timeout"):
        ConnectionLimits(publish_done_timeout=-1)
    # No wait after PUBLISH_DONE is a valid choice: the subscription ends with it.
    assert ConnectionLimits(publish_done_timeout=0).publish_done_timeout == 0
