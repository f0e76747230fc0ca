"""Moving KV blocks between an engine's paged KV tensors and host memory: the device path.

An engine's paged cache lives on its device; kvnet encodes, signs, verifies and decodes blocks on the
host. ``save_blocks`` gathers blocks out of the engine's per-layer views into host buffers taken from a
``PinnedPool``, each buffer one block in kvnet's canonical layout (``[2, layers, block_size, kv_heads,
head_size]``: K then V); ``load_blocks`` writes such host blocks back into engine block slots. The layer's
layout object (``kvnet.integrations.paged_layout`` for vLLM's GPU backends, ``kvnet.integrations.cpu_layout``
for its CPU kernels) does the per-layer reordering.

On CUDA the copies run off the engine's compute stream, because writing into (or reading from) the
engine's tensors from another thread or stream without ordering races the forward:

* save: a side stream first waits for the compute stream (the blocks' K/V are written), then gathers each
  block's layers into a device staging buffer and copies it to a pinned host buffer (one copy per block);
  an event recorded after the last copy says when the host may read the buffers (``Transfer.wait``).
* load: a dedicated stream waits for the compute stream (the engine's block initialisation comes first),
  copies each host block to a device staging buffer and scatters its layers into the engine's slots; the
  load is finished when its event fires (``Transfer.done`` / ``wait``).

On a CPU the same functions are plain copies (no stream, no event), so every path runs in a CPU test. The
host buffers stay the caller's until it releases them (after encoding a save, after a load's event).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvnet.integrations.cpu_layout import LayoutError


class BlockLayout(Protocol):
    """What ``save_blocks`` / ``load_blocks`` need of a layer layout (``PagedLayerLayout``,
    ``CpuBlockLayout``)."""

    @property
    def canonical_shape(self) -> tuple[int, int, int]: ...

    def read_into(self, layer: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def write(self, layer: torch.Tensor, block_id: int, k: torch.Tensor, v: torch.Tensor) -> None: ...


class PoolTimeoutError(TimeoutError):
    """No host buffers came free within the caller's deadline."""


def host_block_shape(layout: BlockLayout, num_layers: int) -> tuple[int, int, int, int, int]:
    """Shape of one host block: ``[2, num_layers, block_size, kv_heads, head_size]`` (K, then V)."""
    return (2, num_layers, *layout.canonical_shape)


@dataclass(eq=False, slots=True)
class HostBlock:
    """One pooled host buffer holding one block, every layer's K and V."""

    tensor: torch.Tensor
    """``[2, layers, block_size, kv_heads, head_size]``; pinned where the pool pins."""
    pool: PinnedPool

    @property
    def k(self) -> torch.Tensor:
        """``[layers, block_size, kv_heads, head_size]``: the block's keys."""
        return self.tensor[0]

    @property
    def v(self) -> torch.Tensor:
        """``[layers, block_size, kv_heads, head_size]``: the block's values."""
        return self.tensor[1]

    def release(self) -> None:
        """Give the buffer back to its pool (only once nothing reads or writes it any more)."""
        self.pool.release([self])


class PinnedPool:
    """A bounded set of host buffers of one block each, pinned (page-locked) where CUDA is available, so
    device copies into and out of them are asynchronous DMA.

    Buffers are allocated on first use, at most ``capacity``; pinning is slow and page-locked memory is
    scarce, so they are kept and reused. ``acquire`` blocks while fewer than the requested buffers are
    free (all requested at once, so two callers holding half each cannot deadlock), up to its ``timeout``.
    """

    def __init__(
        self, capacity: int, block_shape: Sequence[int], dtype: torch.dtype, *, pin: bool | None = None
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"a pinned pool holds at least one buffer, not {capacity!r}")
        self.capacity = capacity
        """Most buffers this pool ever holds."""
        self.block_shape = tuple(int(n) for n in block_shape)
        """Shape of each buffer."""
        self.dtype = dtype
        """Element type of each buffer."""
        self.pinned = torch.cuda.is_available() if pin is None else pin
        """Whether the buffers are page-locked."""
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._lent: set[int] = set()
        self._changed = threading.Condition()

    @property
    def in_use(self) -> int:
        """Buffers acquired and not yet released."""
        with self._changed:
            return len(self._lent)

    def acquire(self, count: int = 1, timeout: float | None = None) -> list[HostBlock]:
        """``count`` buffers, waiting up to ``timeout`` seconds (None: for ever) until that many are
        free; ``PoolTimeoutError`` when they are not. Their contents are whatever was last in them."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"can acquire a non-negative number of buffers, not {count!r}")
        if count > self.capacity:
            raise ValueError(f"{count} buffers asked of a pool of {self.capacity}")

        def available() -> bool:
            return len(self._free) + self.capacity - self._allocated >= count

        with self._changed:
            if not self._changed.wait_for(available, timeout):
                raise PoolTimeoutError(
                    f"{count} host buffers not free within {timeout}s ({len(self._lent)} of "
                    f"{self.capacity} in use)"
                )
            taken = [self._free.pop() for _ in range(min(count, len(self._free)))]
            while len(taken) < count:
                taken.append(torch.empty(self.block_shape, dtype=self.dtype, pin_memory=self.pinned))
                self._allocated += 1
            self._lent.update(id(t) for t in taken)
        return [HostBlock(t, self) for t in taken]

    def release(self, blocks: Sequence[HostBlock]) -> None:
        """Give buffers back; releasing one this pool did not lend, or one twice, is a ``ValueError``."""
        with self._changed:
            ids = [id(block.tensor) for block in blocks]
            if any(block.pool is not self for block in blocks) or not self._lent.issuperset(ids) or (
                len(set(ids)) != len(ids)
            ):
                raise ValueError("released a host buffer this pool did not lend (or released it twice)")
            self._lent.difference_update(ids)
            self._free.extend(block.tensor for block in blocks)
            self._changed.notify_all()


@dataclass(eq=False, slots=True)
class Transfer:
    """Copies between an engine's blocks and host buffers, maybe still running on a CUDA stream."""

    blocks: list[torch.Tensor]
    """The host blocks, in the order of the block ids."""
    event: torch.cuda.Event | None = None
    """Recorded after the last copy on CUDA; None when the copies were synchronous."""
    _done: bool = field(default=False, repr=False)

    def done(self) -> bool:
        """Whether every copy has finished (never blocks)."""
        if not self._done:
            self._done = self.event is None or bool(self.event.query())
        return self._done

    def wait(self) -> None:
        """Block until every copy has finished: the host may read a save's buffers, and the engine's
        slots hold a load's blocks."""
        if not self._done and self.event is not None:
            self.event.synchronize()
        self._done = True

    def before(self, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current one) after the copies without blocking the host: the
        engine's forward may then use a load's blocks (no-op for synchronous copies)."""
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)


_streams: dict[tuple[str, int], torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def transfer_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The process's one CUDA stream for ``purpose`` (``"save"`` or ``"load"``) on ``device``: saves and
    loads each keep their own, so a load is never queued behind a save."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get((purpose, index))
        if stream is None:
            stream = _streams[(purpose, index)] = torch.cuda.Stream(device=index)
        return stream


def _check_blocks(layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> None:
    if not layers:
        raise LayoutError("no KV layers to copy blocks of")
    num_blocks = int(layers[0].shape[0])
    for block_id in block_ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < num_blocks:
            raise LayoutError(f"block id {block_id!r} is outside the engine's {num_blocks} blocks")


def _check_host(block: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    if tuple(block.shape) != shape or block.dtype != dtype or block.device.type != "cpu":
        raise LayoutError(
            f"host block {tuple(block.shape)} {block.dtype} on {block.device} is not {shape} {dtype} on cpu"
        )
    if not block.is_contiguous():
        raise LayoutError("a host block must be contiguous")


def save_blocks(
    layout: BlockLayout,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    pool: PinnedPool,
    *,
    timeout: float | None = None,
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Stream | None = None,
) -> tuple[list[HostBlock], Transfer]:
    """Copy the engine's blocks ``block_ids`` (every layer of ``layers``) into host buffers from ``pool``.

    Returns the buffers and the transfer; read them only after ``Transfer.wait()`` (or once ``done()``),
    then ``release`` them. On CUDA the copies run on ``stream`` (default: the device's save stream),
    ordered after the work already queued on ``after``, the stream that wrote the blocks (default: the
    calling thread's current stream, so call from the engine's forward thread or name its stream).
    Raises ``PoolTimeoutError`` when the pool has no buffers in time and ``LayoutError`` when the blocks
    do not fit.
    """
    _check_blocks(layers, block_ids)
    shape = host_block_shape(layout, len(layers))
    if pool.block_shape != shape or pool.dtype != layers[0].dtype:
        raise LayoutError(f"the pool's buffers {pool.block_shape} {pool.dtype} do not hold blocks "
                          f"{shape} {layers[0].dtype}")
    held = pool.acquire(len(block_ids), timeout)
    try:
        transfer = _gather([h.tensor for h in held], layout, layers, block_ids, stream, after)
    except BaseException:
        pool.release(held)
        raise
    return held, transfer


def _gather(
    hosts: list[torch.Tensor],
    layout: BlockLayout,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    stream: torch.cuda.Stream | None,
    after: torch.cuda.Stream | None,
) -> Transfer:
    device = layers[0].device
    if device.type != "cuda" or not hosts:
        for host, block_id in zip(hosts, block_ids, strict=True):
            for index, layer in enumerate(layers):
                layout.read_into(layer, block_id, host[0, index], host[1, index])
        return Transfer(hosts)
    side = stream if stream is not None else transfer_stream(device, "save")
    side.wait_stream(after if after is not None else torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        # One staging block on the side stream: the gathers of block i+1 queue behind block i's copy
        # to the host on the same stream, so reusing it is safe, and the host gets one large copy per
        # block instead of one small one per layer.
        staging = torch.empty(hosts[0].shape, dtype=hosts[0].dtype, device=device)
        for host, block_id in zip(hosts, block_ids, strict=True):
            for index, layer in enumerate(layers):
                layout.read_into(layer, block_id, staging[0, index], staging[1, index])
            host.copy_(staging, non_blocking=True)
        event = torch.cuda.Event()
        event.record(side)
    return Transfer(hosts, event)


def load_blocks(
    layout: BlockLayout,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    sources: Sequence[torch.Tensor],
    *,
    stream: torch.cuda.Stream | None = None,
    after: torch.cuda.Stream | None = None,
) -> Transfer:
    """Write host blocks ``sources`` (each ``host_block_shape``, contiguous, on the CPU) into the engine's
    slots ``block_ids`` of every layer.

    On CUDA the copies run on ``stream`` (default: the device's load stream), ordered after the work
    already queued on ``after`` (default: the calling thread's current stream), the engine's
    initialisation of those blocks included; the engine's slots hold the blocks, and the sources may be
    reused, once the returned transfer is done. Raises ``LayoutError`` when the blocks do not fit
    (nothing written).
    """
    _check_blocks(layers, block_ids)
    if len(sources) != len(block_ids):
        raise LayoutError(f"{len(sources)} host blocks for {len(block_ids)} engine blocks")
    shape = host_block_shape(layout, len(layers))
    for source in sources:
        _check_host(source, shape, layers[0].dtype)
    device = layers[0].device
    if device.type != "cuda" or not sources:
        for source, block_id in zip(sources, block_ids, strict=True):
            for index, layer in enumerate(layers):
                layout.write(layer, block_id, source[0, index], source[1, index])
        return Transfer(list(sources))
    side = stream if stream is not None else transfer_stream(device, "load")
    side.wait_stream(after if after is not None else torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        staging = torch.empty(shape, dtype=layers[0].dtype, device=device)
        for source, block_id in zip(sources, block_ids, strict=True):
            staging.copy_(source, non_blocking=True)
            for index, layer in enumerate(layers):
                layout.write(layer, block_id, staging[0, index], staging[1, index])
        event = torch.cuda.Event()
        event.record(side)
    return Transfer(list(sources), event)


@dataclass(eq=False, slots=True)
class _Staged:
    """One block being assembled in a host buffer, and the loads started from it."""

    host: HostBlock
    imports: int = 1
    """Imports of this block begun and not yet finished or aborted (two requests may fetch one block)."""
    loaded: set[int] = field(default_factory=set)
    """Engine blocks a load was started into."""
    transfers: list[Transfer] = field(default_factory=list)


class StagedLoads:
    """Verified blocks assembled in pooled host buffers, then loaded into engine blocks by ``load_blocks``.

    The fetch side calls ``begin`` / ``layer`` / ``finish`` (or ``abort``) per block, as it decodes;
    ``layer`` may run on decoding threads (each call fills its own layer). Two fetches of one block at once
    share its buffer (both write the same verified bytes); each ``finish`` loads the buffer into the engine
    blocks given that no load has covered yet, and the buffer goes back to the pool once every import of
    it ended and its loads are done. ``wait(block_ids)`` returns once the loads into those blocks are done.
    On CUDA the loads run on the load stream ordered after ``after()``, the engine's compute stream (None:
    the calling thread's current one); on a CPU they are plain copies, done at once.
    """

    def __init__(
        self,
        layout: BlockLayout,
        layers: Sequence[torch.Tensor],
        pool: PinnedPool,
        after: Callable[[], torch.cuda.Stream | None] = lambda: None,
    ) -> None:
        if pool.block_shape != host_block_shape(layout, len(layers)):
            raise LayoutError(f"the pool's buffers {pool.block_shape} do not hold this engine's blocks")
        self.layout = layout
        self.layers = layers
        self.pool = pool
        self.after = after
        self._assembling: dict[bytes, _Staged] = {}
        self._ended: list[_Staged] = []
        """Blocks whose imports all ended, holding their buffers until their loads are done."""
        self._lock = threading.Lock()  # begin/finish on the fetch loop, wait from another thread

    def begin(self, block_hash: bytes) -> None:
        """Start assembling ``block_hash`` (sharing the buffer of an import of it already running). With no
        buffer free, the oldest load is waited for (its copy is short) to free one; ``PoolTimeoutError``
        when every buffer is still being assembled."""
        with self._lock:
            running = self._assembling.get(block_hash)
            if running is not None:
                running.imports += 1
                return
        self._reap(block=False)
        try:
            held = self.pool.acquire(1, timeout=0)
        except PoolTimeoutError:
            if not self._reap(block=True):
                raise
            held = self.pool.acquire(1, timeout=0)
        with self._lock:
            running = self._assembling.get(block_hash)
            if running is None:
                self._assembling[block_hash] = _Staged(held[0])
                return
            running.imports += 1  # another import began meanwhile (from another thread)
        self.pool.release(held)

    def layer(self, block_hash: bytes, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy one verified layer (canonical ``[block_size, kv_heads, head_size]`` K and V) into the block's
        host buffer."""
        host = self._assembling[block_hash].host
        host.k[index].copy_(k)
        host.v[index].copy_(v)

    def finish(self, block_hash: bytes, block_ids: Sequence[int]) -> None:
        """One import of ``block_hash`` has every layer: load it into those of ``block_ids`` no load covered
        yet (none: nothing to do)."""
        with self._lock:
            staged = self._assembling[block_hash]
            new = [b for b in dict.fromkeys(block_ids) if b not in staged.loaded]
            staged.loaded.update(new)
        try:
            if new:
                transfer = load_blocks(
                    self.layout, self.layers, new, [staged.host.tensor] * len(new), after=self.after()
                )
                with self._lock:
                    staged.transfers.append(transfer)
        except BaseException:
            with self._lock:
                staged.loaded.difference_update(new)
            raise
        finally:
            self._end(block_hash)

    def abort(self, block_hash: bytes) -> None:
        """One import of ``block_hash`` failed before ``finish``: nothing is written for it."""
        self._end(block_hash)

    def wait(self, block_ids: Sequence[int]) -> None:
        """Block until every load started into any of ``block_ids`` is done (then the engine's slots hold
        them)."""
        wanted = set(block_ids)
        with self._lock:
            staged = [s for s in (*self._assembling.values(), *self._ended) if wanted & s.loaded]
            transfers = [t for s in staged for t in s.transfers]
        for transfer in transfers:
            transfer.wait()
        self._reap(block=False)

    def _end(self, block_hash: bytes) -> None:
        with self._lock:
            staged = self._assembling.get(block_hash)
            if staged is None:
                return
            staged.imports -= 1
            if staged.imports > 0:
                return
            del self._assembling[block_hash]
            self._ended.append(staged)
        self._reap(block=False)

    def _reap(self, *, block: bool) -> bool:
        """Give back the buffers of ended blocks whose loads are done; with ``block``, wait for the oldest
        first. Whether any buffer came back."""
        with self._lock:
            oldest = list(self._ended[0].transfers) if block and self._ended else []
        for transfer in oldest:
            transfer.wait()
        with self._lock:
            done = [s for s in self._ended if all(t.done() for t in s.transfers)]
            for s in done:
                self._ended.remove(s)
        if done:
            self.pool.release([s.host for s in done])
        return bool(done)
