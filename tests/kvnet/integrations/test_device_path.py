"""The device path between an engine's paged KV and host buffers (``kvnet.integrations.device_path``).

The engine caches are built as the layout tests build them (vLLM's GPU stride orders, its CPU kernels'
element offsets) and the expected bytes come from those tests' offset references, not from the module.
Everything runs on CPU tensors; the CUDA cases (side streams, pinned buffers, events) skip without CUDA
and run on a GPU host, as does ``benchmarks/device/bench_layouts.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvnet.integrations.cpu_layout import AmxLayout, CpuBlockLayout, LayoutError, VecLayout
from kvnet.integrations.device_path import (
    PinnedPool,
    PoolTimeoutError,
    StagedLoads,
    host_block_shape,
    load_blocks,
    save_blocks,
)
from kvnet.integrations.paged_layout import PagedLayerLayout
from tests.kvnet.integrations.test_cpu_layout import HEADS as CPU_HEADS
from tests.kvnet.integrations.test_cpu_layout import amx_offsets, place_by_offsets, vec_offsets
from tests.kvnet.integrations.test_paged_layout import (
    BLOCK_SIZE,
    BLOCKS,
    HEAD,
    HEADS,
    LAYERS,
    STRIDE_ORDERS,
    allocate,
    layer_view_order,
    layer_views,
    offsets,
)

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA (side streams, pinned buffers, events); benchmarks/device/bench_layouts.py runs "
    "the same paths on a GPU host",
)
PAGED = [pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}")
         for name in STRIDE_ORDERS for dtype in (torch.bfloat16, torch.float16)]
BACKEND_LAYOUTS = {
    # The KV cache layouts each GPU backend kvnet serves runs on in vLLM 0.32, NHD (LBNHC, BLNHC) and HND
    # (LBHNC, BLHNC): FlashAttention and Triton declare no preference (any layout, vLLM prefers LBNHC);
    # FlashInfer requires HND on SM100 and takes any layout elsewhere.
    "FLASH_ATTN": ("LBNHC", "BLNHC", "LBHNC", "BLHNC"),
    "TRITON_ATTN": ("LBNHC", "BLNHC", "LBHNC", "BLHNC"),
    "FLASHINFER": ("LBNHC", "BLNHC", "LBHNC", "BLHNC"),
}
CONNECTOR = [pytest.param(name, dtype, id=f"{backend}-{name}-{str(dtype)[6:]}")
             for backend, names in BACKEND_LAYOUTS.items() for name in names
             for dtype in (torch.bfloat16, torch.float16)]


def paged_cache(name: str, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, list[int]]:
    flat, strides = allocate(STRIDE_ORDERS[name], dtype)
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(seed)).to(dtype))
    return flat, strides


def expected_paged_block(flat: torch.Tensor, strides: list[int], block: int) -> torch.Tensor:
    """``[2, layers, block_size, heads, head]`` gathered at the stride order's flat offsets."""
    per_layer = []
    for layer in range(LAYERS):
        keys, values = offsets(strides, layer, block)
        per_layer.append(torch.stack([flat[torch.tensor(keys)], flat[torch.tensor(values)]]))
    return torch.stack(per_layer, dim=1).view(2, LAYERS, BLOCK_SIZE, HEADS, HEAD)


@pytest.mark.parametrize(("name", "dtype"), PAGED)
def test_save_gathers_every_layer_of_each_block_into_a_pooled_host_buffer(
    name: str, dtype: torch.dtype
) -> None:
    flat, strides = paged_cache(name, dtype)
    layers = layer_views(flat, strides)
    layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS[name]), HEAD)
    pool = PinnedPool(3, host_block_shape(layout, LAYERS), dtype)
    held, transfer = save_blocks(layout, layers, [3, 0], pool)
    transfer.wait()
    assert transfer.done() and transfer.event is None  # CPU: plain copies
    assert [h.tensor for h in held] == transfer.blocks and pool.in_use == 2
    for host, block in zip(held, [3, 0], strict=True):
        assert torch.equal(host.tensor, expected_paged_block(flat, strides, block))
        assert torch.equal(host.k, host.tensor[0]) and torch.equal(host.v, host.tensor[1])
    for host in held:
        host.release()
    assert pool.in_use == 0


@pytest.mark.parametrize(("name", "dtype"), PAGED)
def test_load_writes_host_blocks_into_other_slots_and_nowhere_else(name: str, dtype: torch.dtype) -> None:
    flat, strides = paged_cache(name, dtype)
    layers = layer_views(flat, strides)
    layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS[name]), HEAD)
    sources = [expected_paged_block(flat, strides, block).contiguous() for block in (0, 1)]
    expected = flat.clone()
    for source, target in zip(sources, (2, 3), strict=True):
        for layer in range(LAYERS):
            keys, values = offsets(strides, layer, target)
            expected[torch.tensor(keys)] = source[0, layer].reshape(-1)
            expected[torch.tensor(values)] = source[1, layer].reshape(-1)
    transfer = load_blocks(layout, layers, [2, 3], sources)
    transfer.wait()
    assert torch.equal(flat, expected)
    for view in layers:  # the engine's own view: slots 2, 3 now hold what 0, 1 hold
        assert torch.equal(view[2], view[0]) and torch.equal(view[3], view[1])


CPU_CASES = [
    pytest.param(VecLayout, vec_offsets, 32, 8, torch.float32, id="vec-fp32"),
    pytest.param(VecLayout, vec_offsets, 32, 8, torch.bfloat16, id="vec-bf16"),
    pytest.param(AmxLayout, amx_offsets, 32, 32, torch.bfloat16, id="amx-bf16"),
]


@pytest.mark.parametrize(("layout_class", "place", "block_size", "head_size", "dtype"), CPU_CASES)
def test_cpu_kernel_layouts_save_and_load_through_the_same_path(
    layout_class: type[CpuBlockLayout], place, block_size: int, head_size: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(3)
    num_layers, num_blocks = 2, 4
    shape = (block_size, CPU_HEADS, head_size)
    blocks = {
        (layer, block): (torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
        for layer in range(num_layers) for block in (0, 1)
    }
    layers = [torch.zeros(num_blocks, CPU_HEADS, block_size, 2 * head_size, dtype=dtype)
              for _ in range(num_layers)]
    for (layer, block), (k, v) in blocks.items():
        place_by_offsets(layers[layer], place, block, k, v)
    layout = layout_class.of(layers[0])
    pool = PinnedPool(2, host_block_shape(layout, num_layers), dtype, pin=False)
    held, transfer = save_blocks(layout, layers, [0, 1], pool)
    transfer.wait()
    for host, block in zip(held, (0, 1), strict=True):
        for layer in range(num_layers):
            assert torch.equal(host.k[layer], blocks[layer, block][0])
            assert torch.equal(host.v[layer], blocks[layer, block][1])
    load_blocks(layout, layers, [3, 2], [h.tensor for h in held]).wait()
    for cache in layers:
        assert torch.equal(cache[3], cache[0]) and torch.equal(cache[2], cache[1])


def test_the_pool_is_bounded_and_acquire_waits_for_a_release() -> None:
    pool = PinnedPool(2, (2, 1, 4, 1, 2), torch.float16, pin=False)
    first = pool.acquire(2)
    with pytest.raises(PoolTimeoutError, match=r"not free within 0\.01s"):
        pool.acquire(1, timeout=0.01)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.extend(pool.acquire(2, timeout=60)))
    waiter.start()
    first[0].release()  # one free is not enough for a request of two: all are taken at once
    assert pool.in_use == 1
    first[1].release()
    waiter.join(timeout=60)
    assert not waiter.is_alive() and len(got) == 2 and pool.in_use == 2
    # the buffers are reused, never more than the capacity
    assert {id(t.tensor) for t in first} == {id(t.tensor) for t in got}  # type: ignore[attr-defined]


def test_the_pool_refuses_what_it_could_never_give_and_foreign_releases() -> None:
    with pytest.raises(ValueError, match="at least one buffer"):
        PinnedPool(0, (1,), torch.float16)
    pool = PinnedPool(2, (4,), torch.float16, pin=False)
    with pytest.raises(ValueError, match="3 buffers asked of a pool of 2"):
        pool.acquire(3)
    [block] = pool.acquire(1)
    block.release()
    with pytest.raises(ValueError, match="did not lend"):
        block.release()
    [stranger] = PinnedPool(1, (4,), torch.float16, pin=False).acquire(1)
    with pytest.raises(ValueError, match="did not lend"):
        pool.release([stranger])
    assert not pool.pinned and pool.in_use == 0


def test_bad_blocks_are_refused_in_one_line_and_a_failed_save_gives_its_buffers_back() -> None:
    flat, strides = paged_cache("LBNHC", torch.bfloat16)
    layers = layer_views(flat, strides)
    layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS["LBNHC"]), HEAD)
    pool = PinnedPool(2, host_block_shape(layout, LAYERS), torch.bfloat16, pin=False)
    for bad in (BLOCKS, -1, True):
        with pytest.raises(LayoutError, match="outside the engine's 4 blocks") as caught:
            save_blocks(layout, layers, [0, bad], pool)
        assert "\n" not in str(caught.value)
    assert pool.in_use == 0
    other = PinnedPool(1, host_block_shape(layout, LAYERS), torch.float16, pin=False)
    with pytest.raises(LayoutError, match="do not hold blocks"):
        save_blocks(layout, layers, [0], other)
    with pytest.raises(LayoutError, match="2 host blocks for 1 engine blocks"):
        load_blocks(layout, layers, [1], [torch.zeros(host_block_shape(layout, LAYERS))] * 2)
    with pytest.raises(LayoutError, match="is not"):
        load_blocks(layout, layers, [1], [torch.zeros(host_block_shape(layout, LAYERS))])  # float32
    with pytest.raises(LayoutError, match="no KV layers"):
        load_blocks(layout, [], [], [])
    held, transfer = save_blocks(layout, layers, [], pool)  # nothing to move is not an error
    assert held == [] and transfer.done() and load_blocks(layout, layers, [], []).done()
    assert torch.equal(flat, paged_cache("LBNHC", torch.bfloat16)[0])  # nothing written


@NEEDS_CUDA
@pytest.mark.parametrize(("name", "dtype"), PAGED)
def test_cuda_save_and_load_match_the_cpu_path_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    flat, strides = paged_cache(name, dtype)
    device_flat = flat.cuda()
    cpu_layers, cuda_layers = layer_views(flat, strides), layer_views(device_flat, strides)
    order = layer_view_order(STRIDE_ORDERS[name])
    layout = PagedLayerLayout.of(cuda_layers[0], order, HEAD)
    pool = PinnedPool(2, host_block_shape(layout, LAYERS), dtype)
    assert pool.pinned
    held, transfer = save_blocks(layout, cuda_layers, [0, 1], pool)
    assert transfer.event is not None
    transfer.wait()
    assert all(h.tensor.is_pinned() for h in held)
    reference, _ = save_blocks(layout, cpu_layers, [0, 1], PinnedPool(2, pool.block_shape, dtype, pin=False))
    for got, want in zip(held, reference, strict=True):
        assert torch.equal(got.tensor, want.tensor)
    loaded = load_blocks(layout, cuda_layers, [2, 3], [h.tensor for h in held])
    loaded.before()  # the compute stream waits for the load, the host does not
    load_blocks(layout, cpu_layers, [2, 3], [h.tensor for h in reference]).wait()
    loaded.wait()
    assert torch.equal(device_flat.cpu(), flat)


def staged_loads(name: str, dtype: torch.dtype, capacity: int) -> tuple[torch.Tensor, list[int], StagedLoads]:
    """An all-zero engine cache in layout ``name`` and the staged loader the connector puts over it."""
    flat, strides = allocate(STRIDE_ORDERS[name], dtype)
    layers = layer_views(flat, strides)
    layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS[name]), HEAD)
    pool = PinnedPool(capacity, host_block_shape(layout, LAYERS), dtype, pin=False)
    return flat, strides, StagedLoads(layout, layers, pool)


@pytest.mark.parametrize(("name", "dtype"), CONNECTOR)
def test_a_saved_block_staged_layer_by_layer_lands_in_every_target_and_nowhere_else(
    name: str, dtype: torch.dtype
) -> None:
    # The connector's round trip: save blocks 3 and 1 of one engine to host buffers; another engine's
    # fetch hands each block over layer by layer (canonical K, V), and it is loaded into the blocks
    # vLLM allocated there: block 3 into 0 and 2 (two requests loading one prefix), block 1 into 1.
    source, source_strides = paged_cache(name, dtype)
    source_layers = layer_views(source, source_strides)
    layout = PagedLayerLayout.of(source_layers[0], layer_view_order(STRIDE_ORDERS[name]), HEAD)
    pool = PinnedPool(2, host_block_shape(layout, LAYERS), dtype, pin=False)
    saved, transfer = save_blocks(layout, source_layers, [3, 1], pool)
    transfer.wait()
    flat, strides, staged = staged_loads(name, dtype, capacity=2)
    for host, key, targets in zip(saved, (b"three", b"one"), ([0, 2], [1]), strict=True):
        staged.begin(key)
        for layer in range(LAYERS):
            staged.layer(key, layer, host.k[layer].clone(), host.v[layer].clone())
        staged.finish(key, targets)
    staged.wait([0, 1, 2])
    assert staged.pool.in_use == 0
    expected = torch.zeros_like(flat)
    for source_block, target in ((3, 0), (3, 2), (1, 1)):
        want = expected_paged_block(source, source_strides, source_block)
        for layer in range(LAYERS):
            keys, values = offsets(strides, layer, target)
            expected[torch.tensor(keys)] = want[0, layer].reshape(-1)
            expected[torch.tensor(values)] = want[1, layer].reshape(-1)
    assert torch.equal(flat, expected)


def test_an_aborted_block_writes_nothing_and_gives_its_buffer_back() -> None:
    flat, _, staged = staged_loads("LBHNC", torch.bfloat16, capacity=1)
    staged.begin(b"a")
    staged.layer(b"a", 0, torch.ones(BLOCK_SIZE, HEADS, HEAD), torch.ones(BLOCK_SIZE, HEADS, HEAD))
    staged.abort(b"a")
    staged.abort(b"a")  # a second abort (the fetch's cleanup) is harmless
    assert staged.pool.in_use == 0 and not flat.any()
    staged.begin(b"b")
    staged.finish(b"b", [])  # every request that wanted it went away: nothing to load into
    assert staged.pool.in_use == 0 and not flat.any()


def test_a_full_pool_takes_back_finished_loads_and_refuses_only_when_all_are_being_assembled() -> None:
    flat, _, staged = staged_loads("LBNHC", torch.float16, capacity=2)
    ones = torch.ones(BLOCK_SIZE, HEADS, HEAD)
    for key, target in ((b"a", 0), (b"b", 1)):
        staged.begin(key)
        for layer in range(LAYERS):
            staged.layer(key, layer, ones * (target + 1), ones * (target + 1))
        staged.finish(key, [target])
    # Both buffers belong to finished loads nobody waited for yet: begin takes them back.
    staged.begin(b"c")
    staged.begin(b"d")
    with pytest.raises(PoolTimeoutError, match="2 of 2 in use"):
        staged.begin(b"e")
    staged.abort(b"c")
    staged.abort(b"d")
    assert staged.pool.in_use == 0
    assert flat.count_nonzero() == 2 * LAYERS * BLOCK_SIZE * HEADS * 2 * HEAD  # the two loads landed


def test_staging_refuses_a_pool_of_another_block_shape() -> None:
    flat, strides = allocate(STRIDE_ORDERS["LBNHC"], torch.bfloat16)
    layers = layer_views(flat, strides)
    layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS["LBNHC"]), HEAD)
    pool = PinnedPool(1, host_block_shape(layout, LAYERS + 1), torch.bfloat16, pin=False)
    with pytest.raises(LayoutError, match="do not hold this engine's blocks"):
        StagedLoads(layout, layers, pool)


@NEEDS_CUDA
@pytest.mark.parametrize(("name", "dtype"), PAGED)
def test_cuda_staged_loads_match_the_cpu_path_bit_for_bit(name: str, dtype: torch.dtype) -> None:
    source, source_strides = paged_cache(name, dtype)
    blocks = [expected_paged_block(source, source_strides, b) for b in (0, 1)]
    results = []
    for device in ("cpu", "cuda"):
        flat, strides = allocate(STRIDE_ORDERS[name], dtype)
        flat = flat.to(device)
        layers = layer_views(flat, strides)
        layout = PagedLayerLayout.of(layers[0], layer_view_order(STRIDE_ORDERS[name]), HEAD)
        staged = StagedLoads(layout, layers, PinnedPool(2, host_block_shape(layout, LAYERS), dtype))
        for index, block in enumerate(blocks):
            key = bytes([index])
            staged.begin(key)
            for layer in range(LAYERS):
                staged.layer(key, layer, block[0, layer], block[1, layer])
            staged.finish(key, [index + 2])
        staged.wait([2, 3])
        results.append(flat.cpu())
    assert torch.equal(results[0], results[1])


def test_two_imports_of_one_block_share_its_buffer_and_each_loads_only_new_targets() -> None:
    # Two requests fetch the same prefix at once: both imports write the same verified layers; the first
    # to finish loads every block registered so far, the second only those registered since.
    source, source_strides = paged_cache("BLHNC", torch.bfloat16)
    want = expected_paged_block(source, source_strides, 1)
    flat, strides, staged = staged_loads("BLHNC", torch.bfloat16, capacity=1)
    staged.begin(b"x")
    staged.begin(b"x")  # the second import needs no buffer of its own: the pool holds only one
    assert staged.pool.in_use == 1
    for _ in range(2):
        for layer in range(LAYERS):
            staged.layer(b"x", layer, want[0, layer], want[1, layer])
    staged.finish(b"x", [0])
    assert staged.pool.in_use == 1  # the other import still writes into it
    flat[:] = 0  # so a second load into block 0 would show: it must not happen
    staged.finish(b"x", [0, 3])
    staged.wait([0, 3])
    assert staged.pool.in_use == 0
    expected = torch.zeros_like(flat)
    for layer in range(LAYERS):
        keys, values = offsets(strides, layer, 3)
        expected[torch.tensor(keys)] = want[0, layer].reshape(-1)
        expected[torch.tensor(values)] = want[1, layer].reshape(-1)
    assert torch.equal(flat, expected)


def test_a_block_one_import_aborted_is_still_loaded_by_the_other() -> None:
    source, source_strides = paged_cache("LBHNC", torch.float16)
    want = expected_paged_block(source, source_strides, 2)
    flat, strides, staged = staged_loads("LBHNC", torch.float16, capacity=1)
    staged.begin(b"y")
    staged.begin(b"y")
    staged.layer(b"y", 0, want[0, 0], want[1, 0])
    staged.abort(b"y")  # the first import's fetch failed after one layer
    for layer in range(LAYERS):
        staged.layer(b"y", layer, want[0, layer], want[1, layer])
    staged.finish(b"y", [1])
    staged.wait([1])
    assert staged.pool.in_use == 0
    for layer in range(LAYERS):
        keys, values = offsets(strides, layer, 1)
        assert torch.equal(flat[torch.tensor(keys)], want[0, layer].reshape(-1))
        assert torch.equal(flat[torch.tensor(values)], want[1, layer].reshape(-1))
