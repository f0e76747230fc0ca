"""vLLM's CPU KV layouts <-> kvnet's canonical block layout (``kvnet.integrations.cpu_layout``).

The references place every element at the flat offset vLLM's cache-write op (``cpu_attn_reshape_and_cache``)
computes for its kernel, written out here from that op's loops and independently of the module's views.
``tests/integrations/test_vllm_cpu_layout.py`` checks the same layouts against vLLM's op itself.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvnet.integrations.cpu_layout import (
    CPU_LAYOUTS,
    AmxLayout,
    CpuBlockLayout,
    LayoutError,
    MlaLatentLayout,
    VecLayout,
    cpu_layout,
    cpu_layout_refusal,
)

BLOCKS, HEADS = 5, 3
Offsets = Callable[[int, int, int, int, int], tuple[int, int]]
"""(block_size, head_size, region base, token, dim) -> flat offsets of K[token, dim] and V[token, dim]."""


def vec_offsets(block_size: int, head_size: int, base: int, t: int, d: int) -> tuple[int, int]:
    # K transposed [dim, token], then V [token, dim].
    return base + d * block_size + t, base + block_size * head_size + t * head_size + d


def amx_offsets(block_size: int, head_size: int, base: int, t: int, d: int) -> tuple[int, int]:
    # vLLM's amx write, bf16: K in 32-bit lanes (dim pairs) per group of 16 tokens; V in groups of 16 dims,
    # each lane a pair of tokens.
    lanes_per_token = head_size // 2
    group, in_group = divmod(t, 16)
    lane = group * 16 * lanes_per_token + (d // 2) * 16 + in_group
    key = base + 2 * lane + d % 2
    dim_group, in_dim_group = divmod(d, 16)
    token_pair, in_pair = divmod(t, 2)
    value_base = base + block_size * head_size
    value = value_base + dim_group * block_size * 16 + token_pair * 32 + in_dim_group * 2 + in_pair
    return key, value


CASES = [
    pytest.param(VecLayout, vec_offsets, 32, 8, id="vec-32x8"),
    pytest.param(VecLayout, vec_offsets, 64, 80, id="vec16-64x80"),
    pytest.param(AmxLayout, amx_offsets, 128, 64, id="amx-128x64"),
    pytest.param(AmxLayout, amx_offsets, 32, 128, id="amx-32x128"),
    pytest.param(AmxLayout, amx_offsets, 64, 96, id="amx-64x96"),
]


def engine_tensor(block_size: int, head_size: int) -> torch.Tensor:
    return torch.zeros(BLOCKS, HEADS, block_size, 2 * head_size, dtype=torch.bfloat16)


def place_by_offsets(
    cache: torch.Tensor, offsets: Offsets, block: int, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write k, v ([token, head, dim]) at the flat offsets ``offsets`` gives, one index per element."""
    block_size, _, head_size = k.shape
    region = 2 * block_size * head_size
    targets, values = [], []
    for h in range(HEADS):
        base = (block * HEADS + h) * region
        for t in range(block_size):
            for d in range(head_size):
                key, value = offsets(block_size, head_size, base, t, d)
                targets += [key, value]
                values += [k[t, h, d], v[t, h, d]]
    assert len(set(targets)) == len(targets) == 2 * HEADS * block_size * head_size  # a permutation
    flat = cache.view(-1)
    flat[torch.tensor(targets)] = torch.stack(values)


def random_block(seed: int, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (block_size, HEADS, head_size)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


@pytest.mark.parametrize(("layout_class", "offsets", "block_size", "head_size"), CASES)
def test_read_follows_the_kernels_offsets(
    layout_class: type[CpuBlockLayout], offsets: Offsets, block_size: int, head_size: int
) -> None:
    cache = engine_tensor(block_size, head_size)
    k, v = random_block(1, block_size, head_size)
    place_by_offsets(cache, offsets, 3, k, v)
    layout = layout_class.of(cache)
    assert layout == layout_class(HEADS, block_size, head_size)
    got_k, got_v = layout.read(cache, 3)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert got_k.is_contiguous() and got_v.is_contiguous()


@pytest.mark.parametrize("as_views", [False, True], ids=["contiguous", "views"])
@pytest.mark.parametrize(("layout_class", "offsets", "block_size", "head_size"), CASES)
def test_write_places_at_the_kernels_offsets_and_touches_no_other_block(
    layout_class: type[CpuBlockLayout], offsets: Offsets, block_size: int, head_size: int, as_views: bool
) -> None:
    k, v = random_block(2, block_size, head_size)
    expected = engine_tensor(block_size, head_size)
    place_by_offsets(expected, offsets, 1, k, v)
    cache = engine_tensor(block_size, head_size)
    layout = layout_class.of(cache)
    if not as_views:
        layout.write(cache, 1, k, v)
        assert torch.equal(cache, expected)
        return
    # Canonical blocks that are views (a dim-major copy seen transposed, every other block of a batch)
    # take the element-wise path, not amx's 32-bit lanes: the same bytes either way, both directions.
    k_view = k.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    v_view = torch.stack([v, v], dim=1)[:, 1]
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    layout.write(cache, 1, k_view, v_view)
    assert torch.equal(cache, expected)
    out_k = torch.empty(head_size, block_size, HEADS, dtype=torch.bfloat16).permute(1, 2, 0)
    out_v = torch.empty_like(out_k)
    layout.read_into(cache, 1, out_k, out_v)
    assert torch.equal(out_k, k) and torch.equal(out_v, v)


@pytest.mark.parametrize(("layout_class", "offsets", "block_size", "head_size"), CASES)
def test_write_then_read_round_trips_every_block(
    layout_class: type[CpuBlockLayout], offsets: Offsets, block_size: int, head_size: int
) -> None:
    cache = engine_tensor(block_size, head_size)
    layout = layout_class.of(cache)
    blocks = [random_block(10 + b, block_size, head_size) for b in range(BLOCKS)]
    for b, (k, v) in enumerate(blocks):
        layout.write(cache, b, k, v)
    for b, (k, v) in enumerate(blocks):
        got_k, got_v = layout.read(cache, b)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)


def test_read_returns_a_copy() -> None:
    cache = engine_tensor(32, 16)
    layout = AmxLayout.of(cache)
    k, v = random_block(3, 32, 16)
    layout.write(cache, 0, k, v)
    got_k, _ = layout.read(cache, 0)
    cache.zero_()
    assert torch.equal(got_k, k)


def test_the_layout_is_chosen_by_kernel_name() -> None:
    cache = engine_tensor(32, 64)
    assert type(cpu_layout("vec", cache)) is VecLayout
    assert type(cpu_layout("vec16", cache)) is VecLayout
    assert type(cpu_layout("amx", cache)) is AmxLayout
    assert type(cpu_layout("CPU_MLA", torch.zeros(BLOCKS, 16, 576))) is MlaLatentLayout
    assert cpu_layout("CPU_MLA", torch.zeros(BLOCKS, 1, 16, 576)) == MlaLatentLayout(1, 16, 288)
    assert set(CPU_LAYOUTS) == {"vec", "vec16", "amx", "CPU_MLA"}
    assert cpu_layout_refusal("amx", 128, 64) is None
    assert cpu_layout_refusal("CPU_MLA", 16, 0) is None


@pytest.mark.parametrize(
    ("kernel", "block_size", "head_size", "reason"),
    [
        ("neon", 128, 64, "does not know the KV layout of vLLM's CPU kernel 'neon'"),
        ("AMX_MLA", 32, 64, "does not know the KV layout of vLLM's CPU kernel 'AMX_MLA'"),
        ("amx", 48, 64, "block size multiple of 32"),
        ("amx", 128, 40, "head size multiple of 16"),
    ],
)
def test_a_kernel_or_geometry_kvnet_cannot_map_is_refused_in_one_line(
    kernel: str, block_size: int, head_size: int, reason: str
) -> None:
    refusal = cpu_layout_refusal(kernel, block_size, head_size)
    assert refusal is not None and reason in refusal and "\n" not in refusal
    with pytest.raises(LayoutError, match=reason.replace("(", r"\(")):
        cpu_layout(kernel, torch.zeros(2, 1, block_size, 2 * head_size, dtype=torch.bfloat16))


def test_the_amx_layout_holds_bfloat16_only() -> None:
    with pytest.raises(LayoutError, match="bfloat16"):
        AmxLayout.of(torch.zeros(2, 1, 32, 32, dtype=torch.float32))


@pytest.mark.parametrize("shape", [(4, 2, 32), (4, 2, 32, 15)])
def test_rejects_other_layouts(shape: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError):
        VecLayout.of(torch.zeros(shape))


def test_rejects_a_block_of_another_shape() -> None:
    cache = engine_tensor(32, 8)
    k = torch.zeros(32, HEADS + 1, 8, dtype=torch.bfloat16)
    with pytest.raises(LayoutError, match="does not fit"):
        VecLayout.of(cache).write(cache, 0, k, k)


# ---- CPU_MLA: one latent row per token, no heads

MLA_RANK, MLA_ROPE = 512, 64
"""DeepSeek-V2/V3's latent: ``kv_lora_rank`` compressed KV elements, then the rotary key part."""


def mla_cache_write(
    cache: torch.Tensor, slots: list[int], kv_c: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """vLLM's ``CPUMLAImpl.do_kv_cache_update``, written out: token ``i``'s latent row at slot ``slots[i]``
    of the flattened ``[blocks * block_size, latent]`` cache, compressed KV first."""
    flat = cache.view(-1, cache.shape[-1])
    for i, slot in enumerate(slots):
        flat[slot, :MLA_RANK] = kv_c[i]
        flat[slot, MLA_RANK:] = k_pe[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mla_latent_travels_as_one_head_whose_k_and_v_are_its_halves(dtype: torch.dtype) -> None:
    block_size, half = 16, (MLA_RANK + MLA_ROPE) // 2
    g = torch.Generator().manual_seed(7)
    kv_c = torch.randn(block_size, MLA_RANK, generator=g).to(dtype)
    k_pe = torch.randn(block_size, MLA_ROPE, generator=g).to(dtype)
    expected = torch.zeros(BLOCKS, 1, block_size, MLA_RANK + MLA_ROPE, dtype=dtype)  # as vLLM allocates it
    mla_cache_write(expected, [3 * block_size + t for t in range(block_size)], kv_c, k_pe)
    layout = MlaLatentLayout.of(expected)
    assert layout == MlaLatentLayout(1, block_size, half)
    k, v = layout.read(expected, 3)
    latent = torch.cat([kv_c, k_pe], dim=1)
    assert torch.equal(k[:, 0], latent[:, :half]) and torch.equal(v[:, 0], latent[:, half:])
    # Written back into another engine's cache (a view of a wider batch, as a load's buffer may be), the
    # block lands in its own rows only.
    cache = torch.zeros_like(expected)
    layout.write(cache, 3, torch.stack([k, k], dim=1)[:, 1], v)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("shape", [(4, 16, 575), (4, 2, 16, 576), (4, 1, 1, 16, 576)])
def test_the_mla_layout_rejects_other_tensors(shape: tuple[int, ...]) -> None:
    with pytest.raises(LayoutError, match="CPU MLA KV tensor"):
        MlaLatentLayout.of(torch.zeros(shape))
