"""Tests of kvtc's entropy stage (kvnet.blocks.kvtc_entropy): the stream format, and its worker processes."""

from __future__ import annotations

import functools
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import constriction
import numpy as np
import pytest

from kvnet.blocks.kvtc_entropy import (
    _ESCAPE_MODEL,
    _FLAG_MODEL,
    _OFFSET_MIN,
    _OFFSET_MODEL,
    RANGE,
    EntropyProcesses,
    StreamJob,
    _choose_offsets,
    _class_model,
    _decode_coefficients,
    _stream_plan,
    class_of,
    decode_layer_streams,
    encode_stream,
)
from kvnet.errors import CodecError
from tests.helpers.waiting import wait_until

GOLDEN_WORDS = "fc4e027bcf1fbea4"


def _decoded(body: bytes, base: np.ndarray, t: int, sink_rows: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, constriction.stream.stack.AnsCoder]:
    coder = constriction.stream.stack.AnsCoder(np.frombuffer(body[:-4], dtype="<u4").astype(np.uint32))
    return (*_decode_coefficients(coder, base, t, sink_rows), coder)


def test_values_beyond_a_class_alphabet_travel_as_escapes() -> None:
    """A value the widest class the encoder may pick cannot hold (the offset is bounded) is an escape."""
    base = class_of(np.array([0.5, 0.5]))
    q = np.zeros((16, 2), dtype=np.int32)
    q[5, 1], q[9, 0] = 30000, -7
    shifts = np.zeros(16, dtype=np.int64)
    body = encode_stream(q, base, shifts, 0)
    offsets = _choose_offsets(q, base, shifts, 0)
    plan = _stream_plan(base + offsets, shifts)
    assert int(plan.half.max()) < 30000  # so the escape path was taken
    symbols, decoded_offsets, _, coder = _decoded(body, base, 16, 0)
    assert symbols.tolist() == q.reshape(-1).tolist() and decoded_offsets.tolist() == offsets.tolist()
    assert coder.is_empty()


def test_an_escape_holding_a_value_its_class_codes_is_refused() -> None:
    """Only values outside a class's alphabet are escaped; a stream that escapes another is not one an
    encoder writes, and is refused rather than decoded."""
    base = class_of(np.array([1.0, 1.0]))
    plan = _stream_plan(base, np.zeros(2, dtype=np.int64))  # both components at offset 0: one class
    (model, count), = plan.classes
    half = int(plan.half[0])
    forged = constriction.stream.stack.AnsCoder()
    forged.encode_reverse(np.array([RANGE + 1], dtype=np.int32), _ESCAPE_MODEL)  # the value 1, escaped
    forged.encode_reverse(np.array([2 * half + 1] + [half] * (count - 1), dtype=np.int32), model)
    forged.encode_reverse(np.array([-_OFFSET_MIN] * 2, dtype=np.int32), _OFFSET_MODEL)
    forged.encode_reverse(np.array([0], dtype=np.int32), _FLAG_MODEL)  # no token shifts
    with pytest.raises(CodecError, match="escaped"):
        _decode_coefficients(constriction.stream.stack.AnsCoder(forged.get_compressed()), base, 2, 0)


def test_the_bitstream_is_the_same_on_every_host() -> None:
    """Encoder and decoder may run on different CPUs and library builds: the entropy models are built
    in decimal arithmetic, so a fixed stream codes to the same words everywhere (a float exp that
    differed in its last bit between builds would give other words, and a receiver garbage)."""
    base = class_of(np.array([0.02, 0.3, 1.0, 2.5, 17.0, 400.0]))
    q = np.array([[0, 0, 1, -3, 40, -2000],
                  [0, 1, -1, 2, 9, 300],
                  [0, 0, 0, -1, -70, 900],
                  [0, 0, 2, 5, 3, 32767]], dtype=np.int32)
    shifts = np.array([2, 1, -3, 0])  # a sink row 2 halvings finer, then token shifts
    body = encode_stream(q, base, shifts, 1)
    offsets = _choose_offsets(q, base, shifts, 1)
    assert offsets.tolist() == [4, 0, -1, 4, 14, 15]  # the encoder's choice, sent
    assert hashlib.sha256(body[:-4]).hexdigest()[:16] == GOLDEN_WORDS
    symbols, decoded_offsets, decoded_shifts, coder = _decoded(body, base, 4, 1)
    assert symbols.tolist() == q.reshape(-1).tolist() and coder.is_empty()
    assert decoded_shifts.tolist() == shifts.tolist()
    assert decoded_offsets.tolist() == offsets.tolist()
    assert _class_model(0) is _class_model(0)  # built once per process


def _coded_bits(q: np.ndarray, column_classes: np.ndarray, shifts: np.ndarray) -> int:
    """What the coder spends on ``q``'s integers under ``column_classes`` (no offsets, shifts or CRC)."""
    plan = _stream_plan(column_classes, shifts)
    ordered = q.reshape(-1)[plan.order]
    indices = np.where(np.abs(ordered) > plan.half, plan.escape, ordered + plan.half).astype(np.int32)
    coder = constriction.stream.stack.AnsCoder()
    end = len(indices)
    for model, count in reversed(plan.classes):
        coder.encode_reverse(indices[end - count:end], model)
        end -= count
    return int(coder.num_bits())


@pytest.mark.parametrize(("scale", "mostly_zero"), [(0.05, False), (0.25, True), (0.4, True), (1.0, False),
                                                   (6.0, False)])
def test_a_component_is_coded_under_the_class_of_its_laplace_scale_not_its_mean(scale: float,
                                                                                mostly_zero: bool) -> None:
    """The encoder's class for a component costs within a percent (or one coder word) of the best of all
    32 offsets, and for a mostly-zero component well below what the class of its mean magnitude costs
    (that mean is far below its Laplace scale)."""
    rng = np.random.default_rng(7)
    shifts = rng.integers(-2, 3, 400)
    q = np.round(rng.laplace(0.0, scale, (400, 1)) * np.exp2(shifts)[:, None]).astype(np.int32)
    base = class_of(np.array([1.0]))
    chosen = int(_choose_offsets(q, base, shifts, 0)[0])
    costs = {o: _coded_bits(q, base + o, shifts) for o in range(-16, 16)}
    assert costs[chosen] <= max(min(costs.values()) * 1.01, min(costs.values()) + 32)
    unshifted = np.abs(q[:, 0]) * np.exp2(-shifts.astype(np.float64))
    by_mean = min(15, max(-16, int(class_of(np.array([unshifted.mean()]))[0] - base[0])))
    if mostly_zero:  # (at 0.05 every class codes 400 zeros in a word or two)
        assert costs[chosen] < costs[by_mean] * 0.95


def _jobs(count: int, seed: int = 3) -> tuple[list[StreamJob], list[np.ndarray]]:
    """``count`` layers' K and V streams of Laplace integers with a sink row and token shifts, and the
    integers ``[2, 12, 6]`` each should decode to."""
    rng = np.random.default_rng(seed)
    base = class_of(np.array([0.1, 0.5, 1.0, 3.0, 20.0, 300.0]))
    jobs, expected = [], []
    for _ in range(count):
        shifts = np.concatenate(([3], rng.integers(-2, 3, 11)))
        q = np.round(rng.laplace(0.0, 1.0, (2, 12, 6)) * np.exp2(base / 4)[None, None, :]
                     * np.exp2(shifts)[None, :, None]).astype(np.int32)
        jobs.append(StreamJob((encode_stream(q[0], base, shifts, 1), encode_stream(q[1], base, shifts, 1)),
                              (base, base), 12, 1))
        expected.append(q)
    return jobs, expected


@pytest.fixture
def processes() -> Iterator[EntropyProcesses]:
    stage = EntropyProcesses(2)
    yield stage
    stage.close()


def test_processes_decode_what_the_thread_decodes(processes: EntropyProcesses) -> None:
    """The worker processes return each layer's integers and row shifts exactly as decoding in the
    calling thread does, in order."""
    jobs, expected = _jobs(5)
    here = [decode_layer_streams(job) for job in jobs]
    there = processes.decode(jobs)
    for (q, shifts), (q2, shifts2), want in zip(here, there, expected, strict=True):
        assert q.dtype == np.int16 and np.array_equal(q, want) and np.array_equal(q2, want)
        assert np.array_equal(shifts, shifts2) and shifts.dtype == np.int8
        assert shifts[:, 0].tolist() == [3, 3]


def test_a_corrupt_stream_decoded_in_a_process_is_refused_with_one_line(processes: EntropyProcesses) -> None:
    """A stream that fails its checks in a worker raises the same ``CodecError`` in the caller, and the
    workers go on decoding the next task."""
    jobs, expected = _jobs(3)
    body = bytearray(jobs[1].bodies[1])
    body[5] ^= 0x10
    bad = StreamJob((jobs[1].bodies[0], bytes(body)), jobs[1].bases, jobs[1].rows, jobs[1].sink_rows)
    with pytest.raises(CodecError, match=r"corrupt V bitstream") as info:
        processes.decode([jobs[0], bad, jobs[2]])
    assert "\n" not in str(info.value)
    (q, _), = processes.decode([jobs[2]])
    assert np.array_equal(q, expected[2])


def test_a_killed_worker_leaves_decoding_to_the_caller(processes: EntropyProcesses,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A worker that dies (the OOM killer, an operator) breaks the pool: that task and every later one
    are decoded in the calling thread, with one warning, never an error to the fetch."""
    processes.wait_started(timeout=60)
    jobs, expected = _jobs(2)
    executor = processes._executor
    assert executor is not None
    for pid in list(executor._processes):  # the pool's own table of its workers
        os.kill(pid, signal.SIGKILL)
    for _ in range(2):
        decoded = processes.decode(jobs)
        assert all(np.array_equal(q, want) for (q, _), want in zip(decoded, expected, strict=True))
    assert processes._executor is None
    assert sum("entropy processes stopped" in r.getMessage() for r in caplog.records) == 1


def test_workers_exit_with_their_parent() -> None:
    """A parent killed without closing its pool (SIGKILL) leaves no worker behind: each watches its
    parent and exits with it (otherwise it would wait on the pool's queue forever)."""
    script = ("import sys\n"
              "from kvnet.blocks.kvtc_entropy import EntropyProcesses\n"
              "stage = EntropyProcesses(2)\n"
              "stage.wait_started(timeout=60)\n"
              "print(*stage._executor._processes, flush=True)\n"
              "sys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert parent.stdout is not None
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2
    finally:
        parent.kill()
        parent.wait(timeout=30)
    for pid in workers:
        wait_until(functools.partial(_exited, pid), f"worker {pid} to exit with its parent", timeout=60)


def _exited(pid: int) -> bool:
    """Gone, or a zombie: it exited and whoever adopted it has not reaped it yet."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_decoding_goes_on_in_the_caller_once_the_processes_are_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node closes its processes at shutdown; a fetch still finishing then decodes in its own thread,
    without a warning (nothing broke)."""
    stage = EntropyProcesses(1)
    stage.close()
    jobs, expected = _jobs(2)
    decoded = stage.decode(jobs)
    assert all(np.array_equal(q, want) for (q, _), want in zip(decoded, expected, strict=True))
    assert stage.tasks_decoded == 0 and not caplog.records
