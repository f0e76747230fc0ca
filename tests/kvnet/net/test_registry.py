"""Tests for kvnet.net.registry: stack names to stacks, the stack a URL picks, one-line refusals."""

from __future__ import annotations

import importlib
import sys

import pytest

from kvnet.net.config import STACKS, TransportConfig
from kvnet.net.registry import get_stack, stack_for
from kvnet.net.stack import Stack
from kvnet.net.url import parse_moqt_url


@pytest.mark.parametrize("name", STACKS)
def test_every_selectable_stack_is_registered_under_its_name(name: str) -> None:
    if name == "aiopquic" and sys.version_info < (3, 12):
        with pytest.raises(ValueError, match=r"needs Python >= 3\.12 \(this is 3\.\d+\)"):
            get_stack(name)
        return
    stack = get_stack(name)
    assert isinstance(stack, Stack) and stack.name == name
    assert stack is importlib.import_module(f"kvnet.net.{name}_stack").STACK
    assert get_stack(name) is stack  # imported and built once


def test_an_unknown_stack_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown QUIC stack 'quiche'; choose from"):
        get_stack("quiche")


def test_a_moqt_url_runs_on_the_stack_the_settings_name() -> None:
    for name in ("aioquic", "qh3"):
        assert stack_for(parse_moqt_url("moqt://h:1"), TransportConfig(stack=name)).name == name
