"""Tests for kvnet.dtypes: the one dtype name table agrees with the KV object format."""

from __future__ import annotations

import pytest
import torch

from kvnet.dtypes import DTYPE_BY_NAME, dtype_from_name, dtype_name
from proto.kvobject import DTYPES


def test_table_is_the_object_formats_dtype_set() -> None:
    assert set(DTYPE_BY_NAME) == set(DTYPES)


@pytest.mark.parametrize("name", sorted(DTYPE_BY_NAME))
def test_names_round_trip(name: str) -> None:
    assert dtype_name(dtype_from_name(name)) == name


def test_unknown_dtypes_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'int8' is not one of"):
        dtype_from_name("int8")
    with pytest.raises(ValueError, match=r"torch\.int8 is not one of"):
        dtype_name(torch.int8)
