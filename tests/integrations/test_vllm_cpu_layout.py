"""kvnet's CPU KV layouts against vLLM's own cache-write op (``ops.cpu_attn_reshape_and_cache``).

``vllm_cache_write.py`` runs in the vLLM environment (``scripts/setup-vllm``), without kvnet, and writes
random keys and values into a per-layer KV tensor through vLLM's op for each kernel and geometry below.
Here kvnet's layout for that kernel must read back exactly those keys and values, block by block, and
writing them itself must give the op's tensor byte for byte. A kernel whose op this CPU's build of vLLM
cannot run (``amx`` needs vLLM's AVX-512 build; an AVX2-only CPU loads the AVX2 one) skips with vLLM's
error; ``tests/kvnet/integrations/test_cpu_layout.py`` checks the same layouts against the op's offsets.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from kvnet.integrations.cpu_layout import cpu_layout
from tests.integrations.test_vllm import ENGINE_TIMEOUT, vllm_python

pytestmark = pytest.mark.slow  # imports vLLM in its own environment: tens of seconds

CASES = [
    ("vec", 128, 64, "bfloat16"),
    ("vec", 128, 64, "float32"),
    ("vec", 32, 128, "float16"),
    ("vec16", 64, 80, "bfloat16"),
    ("amx", 128, 64, "bfloat16"),
    ("amx", 32, 128, "bfloat16"),
    ("amx", 64, 96, "bfloat16"),
]
Case = tuple[str, int, int, str]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[Case, dict[str, Any]]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-cache-write")
    cases_path, out = tmp / "cases.json", tmp / "written.pt"
    keys = ("kernel", "block_size", "head_size", "dtype")
    cases_path.write_text(json.dumps([dict(zip(keys, case, strict=True)) for case in CASES]))
    # vLLM's environment with an empty PYTHONPATH: the writer cannot import kvnet.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    proc = subprocess.run(
        [python, str(Path(__file__).with_name("vllm_cache_write.py")), str(cases_path), str(out)],
        capture_output=True, text=True, timeout=ENGINE_TIMEOUT, cwd=tmp, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = torch.load(out, weights_only=True)
    return {(c["kernel"], c["block_size"], c["head_size"], c["dtype"]): c for c in cases}


@pytest.mark.parametrize(("kernel", "block_size", "head_size", "dtype"), CASES)
def test_kvnet_layout_matches_vllms_cache_write(
    written: dict[Case, dict[str, Any]], kernel: str, block_size: int, head_size: int, dtype: str
) -> None:
    case = written[(kernel, block_size, head_size, dtype)]
    if "error" in case:
        pytest.skip(f"vLLM's {kernel!r} cache write does not run on this CPU: {case['error']}")
    cache, k, v = case["cache"], case["k"], case["v"]
    layout = cpu_layout(kernel, cache)
    assert (layout.block_size, layout.head_size) == (block_size, head_size)
    mine = torch.zeros_like(cache)
    for i, block in enumerate(case["block_order"]):
        tokens = slice(i * block_size, (i + 1) * block_size)
        got_k, got_v = layout.read(cache, block)
        assert torch.equal(got_k, k[tokens]), f"block {block}: keys differ"
        assert torch.equal(got_v, v[tokens]), f"block {block}: values differ"
        layout.write(mine, block, k[tokens], v[tokens])
    assert cache.dtype == getattr(torch, dtype)
    assert torch.equal(mine.view(torch.uint8), cache.view(torch.uint8))  # the op's bytes, untouched block too

