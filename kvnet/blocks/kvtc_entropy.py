"""kvtc's entropy stage: one stream of integers to rANS words and back, and processes that decode them.

A kvtc payload carries, per layer, a K and a V stream: a ``[t, C]`` block of integers (the quantized PCA
coefficients of kvnet.blocks.transform_codec) coded with rANS (``constriction``) under per-component
Laplace models, with each component's class offset and each row's shift in the stream and a CRC after it
(proto/KVOBJECT.md section 5 states the format for other implementations). This module is the stage
between words and integers and nothing else: numpy and constriction, no torch, so that a process running
it starts in a fifth of a second.

Why processes: the coder holds Python's GIL while it decodes (two threads decoding a stream each took as
long as one thread decoding both), so threads cannot spread kvtc's entropy decoding over a host's cores,
and on a node it shared one core with the event loop (docs/performance.md, "kvtc's entropy stage holds the
GIL"). ``EntropyProcesses`` decodes a task's streams in worker processes instead: payload bytes in,
integers out (int16, the coder's range), while the calling thread waits without the GIL.

The entropy models. Each coefficient is coded under a quantized Laplace whose scale is one of a fixed set
of classes, a quarter of an octave apart, and every class has one categorical model: the coder decodes a
class's symbols with a table search instead of evaluating a parametric CDF per symbol (4-8x faster). A
class's alphabet spans ``_TAIL`` scales either side of zero (at most ``_MAX_HALF``); a rarer value is an
escape symbol followed, after every class, by the value itself under a uniform model. Class bounds and the
models' transcendental values are computed in decimal arithmetic, whose results are exactly specified,
and the rest in float64 products, exact to the bit on every host, so an encoder and a decoder on different
CPUs or libraries build bit-identical models (a float ``exp`` may differ in its last bit between builds).

Which class a component uses is the encoder's choice, sent with the stream: its offset (in classes) from
the class of the tables' spread. The calibration text's spreads are not the served text's: on SmolLM2 the
coefficients of other documents were twice as wide as calibrated (median), and coding them under the
calibrated scales cost 1.5x the bits of their own (docs/performance.md, "kvtc's coder scales"). A row coded
``shift`` halvings finer has integers ``2**shift`` times larger, so its class is its component's plus
``4 * shift``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import operator
import os
import signal
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal, localcontext

import constriction
import numpy as np

from kvnet.errors import CodecError

__all__ = [
    "MAX_DECODE_PROCESSES",
    "RANGE",
    "SINK_SHIFT",
    "TOKEN_SHIFT_SPAN",
    "EntropyProcesses",
    "StreamJob",
    "build_models",
    "class_of",
    "decode_layer_streams",
    "encode_stream",
]

logger = logging.getLogger(__name__)

RANGE = 32767
"""The coder carries integers of at most this many steps either side of zero (an escape's uniform model)."""
SINK_SHIFT = 6
"""Sink rows are coded with steps at most this many halvings finer than the tables' (kvnet.blocks.
transform_codec)."""
TOKEN_SHIFT_SPAN = 3
"""Other rows may be coded up to this many halvings finer or coarser than the tables' steps; a stream says
whether it has such shifts (one flag) and, if so, codes one per row."""
MAX_DECODE_PROCESSES = 16
"""At most this many entropy processes per ``EntropyProcesses`` (each holds ~40 MB of interpreter and
models)."""

_SHIFT_MODEL = constriction.stream.model.Uniform(SINK_SHIFT + 1)
_TOKEN_SHIFT_MODEL = constriction.stream.model.Uniform(2 * TOKEN_SHIFT_SPAN + 1)
_FLAG_MODEL = constriction.stream.model.Uniform(2)
_CLASSES_PER_OCTAVE = 4
_CLASS_MIN, _CLASS_MAX = -32, 64  # scales 2**-8 .. 2**16
_TAIL = 64
_MAX_HALF = 8192
_ESCAPE_MODEL = constriction.stream.model.Uniform(2 * RANGE + 1)
_OFFSET_MIN, _OFFSET_COUNT = -16, 32  # a component's class offset: -4 .. +3.75 octaves
_OFFSET_MODEL = constriction.stream.model.Uniform(_OFFSET_COUNT)


def _class_scale(c: int) -> Decimal:
    return Decimal(2) ** (Decimal(c) / _CLASSES_PER_OCTAVE)


@functools.cache
def _class_bounds() -> np.ndarray:
    """Upper bound of each class's scales but the last (the geometric midpoints), as float64."""
    with localcontext() as ctx:
        ctx.prec = 40
        mids = [Decimal(2) ** ((Decimal(c) + Decimal("0.5")) / _CLASSES_PER_OCTAVE)
                for c in range(_CLASS_MIN, _CLASS_MAX)]
        return np.array([float(m) for m in mids], dtype=np.float64)


def class_of(scale: np.ndarray) -> np.ndarray:
    """The class of each scale (exact comparisons with the decimal bounds: the same on every host)."""
    return np.searchsorted(_class_bounds(), scale, side="left") + _CLASS_MIN


def _half_of(c: int) -> int:
    with localcontext() as ctx:
        ctx.prec = 40
        wide = (_class_scale(c) * _TAIL).to_integral_value(rounding=ROUND_CEILING)
        return min(_MAX_HALF, max(1, int(wide)))


@functools.cache
def _class_halves() -> np.ndarray:
    """Every class's alphabet half-width, indexed by ``class - _CLASS_MIN``."""
    return np.array([_half_of(c) for c in range(_CLASS_MIN, _CLASS_MAX + 1)], dtype=np.int32)


@functools.cache
def _class_model(c: int) -> constriction.stream.model.Categorical:
    """Class ``c``'s model: a quantized Laplace over ``[-half, half]`` (indices ``0 .. 2 half``) and the
    escape (index ``2 half + 1``) carrying the mass beyond."""
    half = int(_class_halves()[c - _CLASS_MIN])
    with localcontext() as ctx:
        ctx.prec = 40
        q = (Decimal(-1) / (2 * _class_scale(c))).exp()  # P(|x| > n) = q**(2n + 1) for an integer n >= 0
        p0, p1, r, escape = (float(x) for x in (1 - q, q * (1 - q * q) / 2, q * q, q ** (2 * half + 1)))
    # P(n) = P(n - 1) r for n >= 2: one float64 product each, in order (IEEE multiplication is exact to the
    # same bit everywhere; only the transcendental values above needed decimal arithmetic).
    side = [p0, *itertools.accumulate(itertools.repeat(r, half - 1), operator.mul, initial=p1)]
    probs = np.array(side[:0:-1] + side + [escape], dtype=np.float64)
    return constriction.stream.model.Categorical(probs, perfect=False)


def build_models() -> None:
    """Build every class's model now (~55 ms), rather than as the first streams that use them decode."""
    for c in range(_CLASS_MIN, _CLASS_MAX + 1):
        _class_model(c)


@dataclass(frozen=True, slots=True)
class _StreamPlan:
    """How one ``[t, C]`` coefficient stream is ordered for the coder: ``order`` lists its (row-major)
    positions in coding order, ``classes`` each class's model and symbol count in that order; ``half`` and
    ``escape`` give, per position in that order, its class's alphabet half-width and escape index."""

    order: np.ndarray
    classes: tuple[tuple[constriction.stream.model.Categorical, int], ...]
    half: np.ndarray
    escape: np.ndarray


def _stream_plan(column_classes: np.ndarray, shifts: np.ndarray) -> _StreamPlan:
    """The coding order of a stream whose components use ``column_classes`` and whose rows are coded
    ``shifts`` halvings finer than the tables' steps (``[t]``; a row's integers, hence its classes, grow
    by ``_CLASSES_PER_OCTAVE`` per halving): every coefficient by ascending class, so each class is one
    run for the coder; within a class, components by ascending class of their own (ties in component
    order), each component's rows top to bottom. ``column_classes`` are within ``[_CLASS_MIN,
    _CLASS_MAX]`` (the callers clip them) and shifts within ``[-TOKEN_SHIFT_SPAN, SINK_SHIFT]``."""
    c, t = len(column_classes), len(shifts)
    columns = np.argsort(column_classes, kind="stable")
    positions = (columns[:, None] + np.arange(t)[None, :] * c).reshape(-1)
    # int8 throughout (a class is -32 .. 64, a shift adds at most 4 x 6 either way): numpy's stable sort of
    # int8 is a radix sort, twice as fast as int16's; the decoder runs this for every stream.
    classes = np.add.outer(column_classes[columns].astype(np.int8),
                           (_CLASSES_PER_OCTAVE * shifts).astype(np.int8)).reshape(-1)
    np.clip(classes, _CLASS_MIN, _CLASS_MAX, out=classes)
    by_class = np.argsort(classes, kind="stable")
    counts = np.bincount(classes - np.int8(_CLASS_MIN), minlength=_CLASS_MAX - _CLASS_MIN + 1)
    present = np.flatnonzero(counts)
    runs = tuple(zip([_class_model(v + _CLASS_MIN) for v in present.tolist()], counts[present].tolist(),
                     strict=True))
    half = np.repeat(_class_halves()[present], counts[present])  # in coding order: class by class
    return _StreamPlan(positions[by_class], runs, half, 2 * half + 1)


def _choose_offsets(q: np.ndarray, base: np.ndarray, shifts: np.ndarray, sink_rows: int) -> np.ndarray:
    """Each component's class offset from ``base``: the class of the Laplace scale that fits the mean
    magnitude of its integers outside the sink rows (``q``, ``[t, C]``, row ``i`` ``shifts[i]`` halvings
    finer, each brought back to the tables' step). Under a class's model a component is non-zero with
    probability ``p = exp(-1 / (2 scale))`` and its mean magnitude is ``p / (1 - p**2)``, so the scale is
    found from the mean by inverting that, not taken to be the mean: for a component that is mostly zero
    the mean is well below the scale, and coding it under the mean's class made SmolLM2's blocks 1.2%
    larger (docs/performance.md, "kvtc's classes by their bits")."""
    body = q[sink_rows:]
    if not body.shape[0]:
        return np.zeros_like(base)
    unshifted = np.abs(body) * np.exp2(-shifts[sink_rows:].astype(np.float64))[:, None]
    mean = np.maximum(unshifted.mean(0), 1e-6)
    nonzero = 2 * mean / (np.sqrt(1 + 4 * mean * mean) + 1)  # p / (1 - p**2) = mean, solved for p
    wanted = class_of(-0.5 / np.log(nonzero))
    return np.clip(wanted - base, _OFFSET_MIN, _OFFSET_MIN + _OFFSET_COUNT - 1)


def encode_stream(q: np.ndarray, base: np.ndarray, shifts: np.ndarray, sink_rows: int) -> bytes:
    """One stream's body: the rANS words (u32 LE) of the integers ``q`` (``[t, C]`` int32, row ``i`` coded
    ``shifts[i]`` halvings finer; the ``sink_rows`` first rows share one shift) under the class offsets the
    encoder chooses from ``base`` (per component, the class of the tables' spread: ``_choose_offsets``),
    then the CRC-32 of what a decoder will have decoded (``_stream_crc``)."""
    t = q.shape[0]
    offsets = _choose_offsets(q, base, shifts, sink_rows)
    plan = _stream_plan(np.clip(base + offsets, _CLASS_MIN, _CLASS_MAX), shifts)
    ordered = q.reshape(-1)[plan.order]
    outside = np.abs(ordered) > plan.half
    indices = np.where(outside, plan.escape, ordered + plan.half).astype(np.int32)
    coder = constriction.stream.stack.AnsCoder()
    # A stack: what is decoded last is encoded first: the escaped values, the classes in reverse, the
    # offsets, the token shifts, then the sink shift (decoded first).
    escaped = ordered[outside].astype(np.int32) + RANGE
    if escaped.size:
        coder.encode_reverse(escaped, _ESCAPE_MODEL)
    end = len(indices)
    for model, count in reversed(plan.classes):
        coder.encode_reverse(indices[end - count:end], model)
        end -= count
    coder.encode_reverse((offsets - _OFFSET_MIN).astype(np.int32), _OFFSET_MODEL)
    token_shifts = shifts[sink_rows:]
    if token_shifts.any():
        coder.encode_reverse((token_shifts + TOKEN_SHIFT_SPAN).astype(np.int32), _TOKEN_SHIFT_MODEL)
    if t > sink_rows:
        coder.encode_reverse(np.array([int(token_shifts.any())], dtype=np.int32), _FLAG_MODEL)
    if sink_rows:
        coder.encode_reverse(np.array([shifts[0]], dtype=np.int32), _SHIFT_MODEL)
    crc = _stream_crc(q.reshape(-1), offsets, shifts, sink_rows)
    return coder.get_compressed().astype("<u4").tobytes() + crc.to_bytes(4, "little")


def _decode_coefficients(coder: constriction.stream.stack.AnsCoder, base: np.ndarray, t: int, sink_rows: int
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The integers (row-major int32), class offsets and row shifts ``[t]`` ``encode_stream`` coded;
    ``CodecError`` for an escape that holds a value its class's alphabet covers (no encoder writes one)."""
    shifts = np.zeros(t, dtype=np.int64)
    if sink_rows:
        shifts[:sink_rows] = int(coder.decode(_SHIFT_MODEL, 1)[0])
    if t > sink_rows and int(coder.decode(_FLAG_MODEL, 1)[0]):
        coded = coder.decode(_TOKEN_SHIFT_MODEL, t - sink_rows).astype(np.int64)
        shifts[sink_rows:] = coded - TOKEN_SHIFT_SPAN
        if not shifts[sink_rows:].any():
            raise CodecError("kvtc: token shifts flagged but all zero (no encoder writes that)")
    offsets = coder.decode(_OFFSET_MODEL, len(base)).astype(np.int64) + _OFFSET_MIN
    plan = _stream_plan(np.clip(base + offsets, _CLASS_MIN, _CLASS_MAX), shifts)
    indices = np.concatenate([coder.decode(model, count) for model, count in plan.classes])
    ordered = indices - plan.half
    outside = np.flatnonzero(indices == plan.escape)
    if outside.size:
        values = coder.decode(_ESCAPE_MODEL, outside.size).astype(np.int32) - RANGE
        if bool((np.abs(values) <= plan.half[outside]).any()):
            raise CodecError("kvtc: an escaped coefficient its class codes directly")
        ordered[outside] = values
    symbols = np.empty_like(ordered)
    symbols[plan.order] = ordered
    return symbols, offsets, shifts


def _stream_crc(symbols: np.ndarray, offsets: np.ndarray, shifts: np.ndarray, sink_rows: int) -> int:
    """CRC-32 of a stream's integers (int32 LE), its class offsets and its row shifts (int8 each), seeded
    with the sink-row count, so a changed Flags byte is refused too."""
    crc = zlib.crc32(symbols.astype("<i4", copy=False).tobytes(), sink_rows)
    crc = zlib.crc32(offsets.astype(np.int8).tobytes(), crc)
    return zlib.crc32(shifts.astype(np.int8).tobytes(), crc)


def _decode_stream(body: bytes | memoryview, base: np.ndarray, t: int, sink_rows: int, kind: str
                   ) -> tuple[np.ndarray, np.ndarray]:
    """One stream's integers (row-major int32) and row shifts, checked against its CRC."""
    words = np.frombuffer(body[:-4], dtype="<u4").astype(np.uint32)
    try:
        coder = constriction.stream.stack.AnsCoder(words)
        symbols, offsets, shifts = _decode_coefficients(coder, base, t, sink_rows)
        exhausted = coder.is_empty()
    except CodecError:
        raise
    except Exception as exc:  # the coder's own error types vary by input
        raise CodecError(f"kvtc: corrupt {kind} bitstream ({exc})") from None
    crc = _stream_crc(symbols, offsets, shifts, sink_rows)
    if not exhausted or crc != int.from_bytes(body[-4:], "little"):
        raise CodecError(f"kvtc: corrupt {kind} bitstream (checksum mismatch)")
    return symbols, shifts


@dataclass(frozen=True, slots=True)
class StreamJob:
    """What decoding one layer's K and V streams needs: their bodies (words and CRC; views into the payload
    where decoded in the caller, bytes where sent to a process), each component's base class (the class of
    the tables' spread, ``[C]`` per stream), the rows and the sink rows."""

    bodies: tuple[bytes | memoryview, bytes | memoryview]
    bases: tuple[np.ndarray, np.ndarray]
    rows: int
    sink_rows: int


def decode_layer_streams(job: StreamJob) -> tuple[np.ndarray, np.ndarray]:
    """A layer's integers ``[2, rows, C]`` (K, V; int16, which holds the coder's range) and row shifts
    ``[2, rows]`` (int8); ``CodecError`` with one line for a stream that does not decode or check."""
    channels = len(job.bases[0])
    q = np.empty((2, job.rows, channels), dtype=np.int16)
    shifts = np.empty((2, job.rows), dtype=np.int8)
    for kind in range(2):
        symbols, row_shifts = _decode_stream(job.bodies[kind], job.bases[kind], job.rows, job.sink_rows,
                                             "KV"[kind])
        q[kind] = symbols.reshape(job.rows, channels)
        shifts[kind] = row_shifts
    return q, shifts


def _decode_many(jobs: Sequence[StreamJob]) -> list[tuple[np.ndarray, np.ndarray] | CodecError]:
    """``decode_layer_streams`` of each job, its ``CodecError`` in its place (a worker's unit of work)."""
    out: list[tuple[np.ndarray, np.ndarray] | CodecError] = []
    for job in jobs:
        try:
            out.append(decode_layer_streams(job))
        except CodecError as exc:
            out.append(exc)
    return out


def _start_worker() -> None:
    """A worker's set-up: the models built before the first task; Ctrl-C left to the parent (which closes
    the pool), so a terminal's interrupt prints nothing here; and an exit as soon as the parent is gone, by
    whatever means (its queues stay open in the worker, which would otherwise wait on them forever)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is not None:
        sentinel = parent.sentinel

        def exit_with_parent() -> None:
            multiprocessing.connection.wait([sentinel])
            os._exit(0)

        threading.Thread(target=exit_with_parent, name="kvtc-parent-watch", daemon=True).start()
    build_models()


class EntropyProcesses:
    """Worker processes that entropy-decode kvtc streams (``decode``), started at once (spawned, not
    forked: the parent holds torch's threads, and each worker imports only this module and what the
    parent's main module imports). If the pool breaks (a worker killed), decoding goes on in the calling
    thread, with one warning."""

    def __init__(self, processes: int) -> None:
        if not 1 <= processes <= MAX_DECODE_PROCESSES:
            raise ValueError(f"kvtc decode processes must be in [1, {MAX_DECODE_PROCESSES}], got {processes}")
        self.processes = processes
        self.tasks_decoded = 0
        """``decode`` calls the workers answered (not those decoded in the caller after a break)."""
        self._executor: ProcessPoolExecutor | None = ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker)
        self._lock = threading.Lock()
        # One task per worker now, so that all of them start (and build their models) before the first
        # block needs them; their results are not waited for.
        self._started = [self._executor.submit(build_models) for _ in range(processes)]

    def decode(self, jobs: Sequence[StreamJob]) -> list[tuple[np.ndarray, np.ndarray]]:
        """``decode_layer_streams`` of every job, in order, on one worker (the caller's thread waits, without
        the GIL); the first job's ``CodecError`` is raised here."""
        executor = self._executor
        results: list[tuple[np.ndarray, np.ndarray] | CodecError]
        if executor is None:
            results = _decode_many(jobs)
        else:
            try:
                sent = [StreamJob((bytes(job.bodies[0]), bytes(job.bodies[1])), job.bases, job.rows,
                                  job.sink_rows) for job in jobs]  # a view does not pickle
                results = executor.submit(_decode_many, sent).result()
                self.tasks_decoded += 1
            except (BrokenProcessPool, RuntimeError, concurrent.futures.CancelledError) as exc:
                # RuntimeError: closed before the submit; CancelledError: closed while it was queued.
                self._broken(executor, exc)
                results = _decode_many(jobs)
        for result in results:
            if isinstance(result, CodecError):
                raise result
        return results  # type: ignore[return-value]  # no CodecError is left among them

    def _broken(self, executor: ProcessPoolExecutor, exc: BaseException) -> None:
        with self._lock:
            if self._executor is not executor:
                return  # closed, or another thread saw the break first
            self._executor = None
        reason = str(exc) or type(exc).__name__
        logger.warning("kvtc entropy processes stopped (%s); decoding kvtc on the fetch's threads", reason)
        executor.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the workers (what they run now is dropped); later ``decode`` calls run in the caller."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def wait_started(self, timeout: float | None = None) -> None:
        """Block until every worker has built its models (or ``timeout`` seconds): for a caller that
        measures, and for tests."""
        concurrent.futures.wait(self._started, timeout)
