"""Micro benchmarks, one process, no network:

- hashing: ns per token of ``kvnet.cache.hashing.block_hashes`` (``bench_hashing.time_block_hashes``);
- codecs: compression ratio and encode/decode MB/s per rendition on the reference model's K/V
  (``bench_codecs.prefill_blocks`` / ``measure_codec``), bf16;
- import: copying fetched blocks into the paged KV cache (``PagedKVCache.import_block`` and the
  layer-by-layer ``begin_import`` / ``import_layer`` / ``finish_import``) vs a plain torch copy of the same
  bytes into a preallocated tensor;
- session: the sans-I/O MoQT data path alone (``proto.session.MoqtSession``): a publisher session
  serialising FETCH objects and a subscriber session parsing them from QUIC-sized chunks, in MB/s of
  payload, next to a plain ``bytes`` join/copy of the same data;
- requests: the sans-I/O request path alone: CPU microseconds per TRACK_STATUS round trip (request,
  reply, both sessions' parsing and request state machines), requests issued in batches as a locate does;
- attention: one layer of batched decode attention over per-sequence block tables, the engine's
  per-sequence loop (``kvnet.model.attention.BatchedPagedAttention``) against one padded ``[B, S_max]``
  gather with a key mask and a single SDPA call, for batches of 1, 4 and 16 sequences.

    python benchmarks/bench_micro.py [--quick] [--only hashing,codecs,import,session,requests,attention]

Every figure is the median of several runs, 1 torch thread, with the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

PARTS = ("hashing", "codecs", "import", "session", "requests", "attention")


# ---------------------------------------------------------------- hashing


def hashing(res: common.SuiteResult, tokens: int = 100_000, runs: int = 5) -> None:
    import numpy as np

    from kvnet.cache.hashing import canonical_fingerprint, root_hash

    bh = common.load_bench("bench_hashing")
    assert bh is not None
    root = root_hash(canonical_fingerprint({"model": "bench", "block_size": 0}))
    ids = np.random.default_rng(0).integers(0, 128_000, size=tokens, dtype=np.int64)
    for block_size in bh.BLOCK_SIZES:
        for label, arg in (("numpy", ids), ("list", ids.tolist())):
            secs = bh.time_block_hashes(arg, block_size, root, runs)
            res.add(f"hash block_size={block_size} ({label} input)", [s * 1e9 / tokens for s in secs],
                    "ns/token", f"{tokens} tokens; target <= 200")


# ---------------------------------------------------------------- codecs


def codecs(res: common.SuiteResult, prefix: int = 256, runs: int = 5, model_name: str = "small") -> None:
    import torch

    from kvnet.blocks.codecs import CODECS
    from kvnet.model.transformer import ModelArgs, Transformer

    bc = common.load_bench("bench_codecs")
    assert bc is not None
    torch.set_num_threads(1)
    model = Transformer(ModelArgs.from_name(model_name), device=torch.device("cpu"), dtype=torch.bfloat16,
                        seed=0)
    model.eval()
    blocks = bc.prefill_blocks(model, bc.prompt_tokens(prefix), 16)
    for name, codec in ((n, c) for n, c in CODECS.items() if n != "kvtc"):  # kvtc needs tables
        ratio, enc, dec, _ = bc.measure_codec(codec, blocks, runs)
        note = f"model {model_name} bf16, {len(blocks)} blocks of 16, ratio {ratio:.3f}"
        res.add(f"codec {name} encode", [enc], "MB/s", note)
        res.add(f"codec {name} decode", [dec], "MB/s", note)
        res.add(f"codec {name} ratio", [ratio], "x", note)


# ---------------------------------------------------------------- import into the paged cache


def import_bandwidth(res: common.SuiteResult, blocks: int = 256, runs: int = 5,
                     model_name: str = "bench", block_size: int | None = None) -> None:
    """Blocks of the ``model_name`` preset's shape (bf16, ``block_size`` tokens, default the nodes'
    block size) imported into a cache of ``blocks`` blocks, whole-block and layer by layer (the fetch
    path), against ``torch.Tensor.copy_`` of the same bytes."""
    import torch

    from kvnet.cache.paged_cache import BlockKV, CacheSpec, PagedKVCache
    from kvnet.model.transformer import ModelArgs
    from kvnet.node.config import NodeConfig

    torch.set_num_threads(1)
    a = ModelArgs.from_name(model_name)
    tokens = block_size or NodeConfig.block_size
    spec = CacheSpec(a.n_layers, a.n_kv_heads, a.head_dim, tokens, torch.bfloat16)
    device = torch.device("cpu")
    src = [BlockKV(torch.randn(spec.block_shape).to(torch.bfloat16), torch.randn(spec.block_shape).to(
        torch.bfloat16)) for _ in range(8)]
    nbytes = blocks * spec.bytes_per_block
    hashes = [i.to_bytes(4, "big") * 8 for i in range(blocks)]

    def whole() -> None:
        cache = PagedKVCache(spec, blocks, device)
        t0 = time.perf_counter()
        for i, h in enumerate(hashes):
            cache.import_block(h, src[i % len(src)])
        times.append(time.perf_counter() - t0)

    def layered() -> None:
        cache = PagedKVCache(spec, blocks, device)
        t0 = time.perf_counter()
        for i, h in enumerate(hashes):
            kv = src[i % len(src)]
            cache.begin_import(h)
            for layer in range(spec.num_layers):
                cache.import_layer(h, layer, kv.k[layer], kv.v[layer])
            cache.finish_import(h)
        times.append(time.perf_counter() - t0)

    def plain() -> None:
        # Zero-filled like the cache's own buffers, so neither side pays first-touch page faults.
        dst_k = torch.zeros((spec.num_layers, blocks, *spec.block_shape[1:]), dtype=torch.bfloat16)
        dst_v = torch.zeros_like(dst_k)
        t0 = time.perf_counter()
        for i in range(blocks):
            kv = src[i % len(src)]
            dst_k[:, i].copy_(kv.k)
            dst_v[:, i].copy_(kv.v)
        times.append(time.perf_counter() - t0)

    figures = {}
    for label, fn in (("torch copy", plain), ("import_block", whole), ("import_layer", layered)):
        times: list[float] = []
        fn()  # warm-up (allocation, first-touch page faults)
        times.clear()
        for _ in range(runs):
            fn()
        rates = [nbytes / t / 1e6 for t in times]
        figures[label] = common.median(rates)
        ratio = "" if label == "torch copy" else f", {figures[label] / figures['torch copy']:.2f}x torch copy"
        res.add(f"import {label}", rates, "MB/s",
                f"{blocks} blocks x {spec.bytes_per_block >> 10} KiB ({model_name} shape, bf16, "
                f"{tokens} tokens){ratio}; "
                "target >= 0.5x")


# ---------------------------------------------------------------- sans-I/O session data path


class _Streams:
    """Stream ids laid out as QUIC does (RFC 9000 section 2.1); every id is used at once."""

    def __init__(self, is_client: bool) -> None:
        self._next = {False: 0 if is_client else 1, True: 2 if is_client else 3}

    def get_next_available_stream_id(self, is_unidirectional: bool = False) -> int:
        sid = self._next[is_unidirectional]
        self._next[is_unidirectional] = sid + 4
        return sid


def _pair() -> tuple[Any, Any, Any]:
    from proto.session import MoqtSession, SendStreamData, SessionConfig

    client = MoqtSession(SessionConfig(is_client=True), _Streams(True))
    server = MoqtSession(SessionConfig(is_client=False), _Streams(False))

    def move(src: Any, dst: Any) -> bool:
        moved = False
        for t in src.transmit():
            if isinstance(t, SendStreamData):
                dst.receive_stream_data(t.stream_id, bytes(t.data), t.end_stream)
                moved = True
        return moved

    def run() -> None:
        while move(client, server) | move(server, client):
            pass

    client.initiate()
    server.initiate()
    run()
    return client, server, run


def session_datapath(res: common.SuiteResult, objects: int = 64, object_bytes: int = 1 << 20,
                     chunk: int = 16384, runs: int = 5) -> None:
    """Payload MB/s of the publisher side (``send_fetch_object`` + ``transmit``) and of the subscriber side
    (``receive_stream_data`` in ``chunk``-byte pieces + ``next_event``) of a FETCH of ``objects`` objects."""
    from proto.events import ObjectReceived
    from proto.messages import Location
    from proto.session import SendStreamData

    payload = os.urandom(object_bytes)
    total = objects * object_bytes
    send_t, recv_t, copy_t = [], [], []
    for _ in range(runs + 1):
        client, server, run = _pair()
        rid = client.fetch((b"kvnet", b"bench"), b"t", Location(0, 0), Location(0, objects))
        run()
        while server.next_event() is not None:
            pass
        server.accept_fetch(rid, True, Location(0, objects))
        run()
        while client.next_event() is not None:
            pass
        t0 = time.perf_counter()
        writes = []
        for i in range(objects):
            server.send_fetch_object(rid, 0, 0, i, payload)
            writes.extend(server.transmit())
        server.finish_fetch(rid)
        writes.extend(server.transmit())
        t1 = time.perf_counter()
        # What QUIC hands the receiver: the stream's bytes in chunk-sized pieces.
        stream: dict[int, list[bytes]] = {}
        fins = set()
        for w in writes:
            if isinstance(w, SendStreamData):
                stream.setdefault(w.stream_id, []).append(bytes(w.data))
                if w.end_stream:
                    fins.add(w.stream_id)
        pieces = []
        for sid, parts in stream.items():
            data = b"".join(parts)
            for off in range(0, len(data), chunk):
                pieces.append((sid, data[off:off + chunk], sid in fins and off + chunk >= len(data)))
        t2 = time.perf_counter()
        got = 0
        for sid, data, fin in pieces:
            client.receive_stream_data(sid, data, fin)
            while (ev := client.next_event()) is not None:
                if isinstance(ev, ObjectReceived):
                    got += len(ev.payload)
        t3 = time.perf_counter()
        if got != total:
            raise RuntimeError(f"session delivered {got} of {total} payload bytes")
        # Baseline: one copy of every received byte into an object-sized buffer (what any receiver does).
        t4 = time.perf_counter()
        for _, data, _ in pieces:
            buf = bytearray(data)
            del buf
        copy_t.append(time.perf_counter() - t4)
        send_t.append(t1 - t0)
        recv_t.append(t3 - t2)
    send_t, recv_t, copy_t = send_t[1:], recv_t[1:], copy_t[1:]
    note = f"{objects} x {object_bytes >> 10} KiB, received in {chunk}-byte chunks"
    res.add("session send (publisher)", [total / t / 1e6 for t in send_t], "MB/s", note)
    res.add("session receive (subscriber)", [total / t / 1e6 for t in recv_t], "MB/s", note)
    res.add("memcpy of the same chunks", [total / t / 1e6 for t in copy_t], "MB/s", "baseline")


def session_requests(res: common.SuiteResult, requests: int = 3000, batch: int = 100, runs: int = 5) -> None:
    """CPU time (``process_time``, so a loaded machine's waiting is not counted) per TRACK_STATUS round
    trip between two sessions: ``batch`` requests out, answered, replies read, ``requests`` in all."""
    from proto.events import TrackStatusOkReceived, TrackStatusReceived

    per_request = []
    for _ in range(runs + 1):
        client, server, run = _pair()
        answered = 0
        t0 = time.process_time()
        for _ in range(requests // batch):
            for _ in range(batch):
                client.track_status((b"kvnet", b"bench"), b"t")
            run()
            while (ev := server.next_event()) is not None:
                if isinstance(ev, TrackStatusReceived):
                    server.respond_track_status(ev.request_id)
            run()
            while (ev := client.next_event()) is not None:
                answered += isinstance(ev, TrackStatusOkReceived)
        per_request.append((time.process_time() - t0) / requests * 1e6)
        if answered != requests // batch * batch:
            raise RuntimeError(f"{answered} of {requests} TRACK_STATUS requests answered")
    res.add("session TRACK_STATUS round trip", per_request[1:], "us CPU",
            f"{requests} requests in batches of {batch}, both sessions")


def batch_attention(res: common.SuiteResult, runs: int = 5, context: int = 320, model_name: str = "small",
                    calls: int = 20) -> None:
    """Decode attention of B sequences (``context`` tokens each, distinct blocks) for one layer: the
    per-sequence loop the engine uses against a padded, masked single SDPA over ``[B, S_max]``."""
    import torch
    import torch.nn.functional as F

    from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
    from kvnet.model.attention import BatchedPagedAttention, BatchSegment
    from kvnet.model.transformer import ModelArgs

    torch.set_num_threads(1)
    a = ModelArgs.from_name(model_name)
    block_size = 16
    spec = CacheSpec(a.n_layers, a.n_kv_heads, a.head_dim, block_size)

    def measure(batch: int) -> None:
        per_seq = -(-context // block_size)
        cache = PagedKVCache(spec, batch * per_seq + 1, torch.device("cpu"))
        for buffer in cache.layer_buffers(0):  # any values: only the time is measured
            buffer.normal_()
        lengths = [context - 7 * i for i in range(batch)]  # ragged, as real batches are
        tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(batch)]
        q = torch.randn(batch, a.n_heads, a.head_dim)  # [B, H, D]: one decode query each
        k_new = torch.randn(batch, a.n_kv_heads, a.head_dim)
        slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                              for t, n in zip(tables, lengths, strict=True)])
        positions = torch.tensor([n - 1 for n in lengths])
        segments = tuple(BatchSegment(i, 1, tables[i], lengths[i]) for i in range(batch))
        loop = BatchedPagedAttention(cache, slots, positions, segments)
        k_layer, v_layer = cache.layer_buffers(0)
        padded_table = torch.stack(tables)  # [B, blocks]
        mask = torch.arange(per_seq * block_size)[None, :] < torch.tensor(lengths)[:, None]  # [B, S_max]
        group = a.n_heads // a.n_kv_heads

        def padded() -> torch.Tensor:
            cache.write(0, slots, k_new, k_new)
            k = k_layer[padded_table].flatten(1, 2).transpose(1, 2)  # [B, H_kv, S_max, D]
            v = v_layer[padded_table].flatten(1, 2).transpose(1, 2)
            return F.scaled_dot_product_attention(
                q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], enable_gqa=group > 1
            )

        def looped() -> torch.Tensor:
            return loop.attend(0, q, k_new, k_new)

        for name, fn in (("per-sequence loop", looped), ("padded + mask", padded)):
            times = common.timed(lambda fn=fn: [fn() for _ in range(calls)], runs)
            res.add(f"decode attention B={batch} {name}", [t / calls * 1e6 for t in times], "us per layer",
                    f"{model_name} shapes, context ~{context}")

    for batch in (1, 4, 16):
        measure(batch)


def run(quick: bool = False, only: tuple[str, ...] = PARTS) -> common.SuiteResult:
    res = common.SuiteResult("micro", "python benchmarks/bench_micro.py" + (" --quick" if quick else ""))
    runs = 3 if quick else 5
    if "hashing" in only:
        hashing(res, tokens=20_000 if quick else 100_000, runs=runs)
    if "codecs" in only:
        codecs(res, prefix=128 if quick else 256, runs=runs)
    if "import" in only:
        import_bandwidth(res, blocks=64 if quick else 256, runs=runs)
    if "session" in only:
        session_datapath(res, objects=16 if quick else 64, runs=runs)
    if "requests" in only:
        session_requests(res, requests=1000 if quick else 3000, runs=runs)
    if "attention" in only:
        batch_attention(res, runs=runs)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    args = ap.parse_args()
    only = tuple(p for p in args.only.split(",") if p)
    for p in only:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}")
    print(f"micro benchmarks, cores={os.cpu_count()}, load {common.load_average()}")
    run(args.quick, only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
