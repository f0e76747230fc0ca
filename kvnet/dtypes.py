"""The one table of element-dtype names: what a manifest, a config file or a flag calls a torch dtype.

Names are torch's own without the ``torch.`` prefix, and exactly the set the KV object format allows
(``proto.kvobject.DTYPES``); the model, the paged cache, the codecs' manifests and the command line all
read them here. Knows nothing else.
"""

from __future__ import annotations

from typing import Final

import torch

DTYPE_BY_NAME: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""Every element dtype a KV block can carry, by name."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; ValueError for a dtype no KV block can carry."""
    name = str(dtype).removeprefix("torch.")
    if DTYPE_BY_NAME.get(name) is not dtype:
        raise ValueError(f"dtype {dtype} is not one of {sorted(DTYPE_BY_NAME)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; ValueError naming the known names for anything else."""
    try:
        return DTYPE_BY_NAME[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPE_BY_NAME)}") from None
