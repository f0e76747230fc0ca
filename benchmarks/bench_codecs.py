"""KV block codecs on the reference model's K/V: compression ratio, speed and quality.

Runs the reference model's prefill over a prompt, cuts the paged cache into blocks and, per codec and
dtype, prints the compression ratio, encode and decode MB/s and ms/MB (uncompressed bytes per second of
this thread's CPU time, median of ``--runs`` runs over all (block, layer) payloads; ``decode`` into new
tensors and ``decode_into`` preallocated ones, as the fetch path writes the cache's slots) and, for lossy
renditions, the quality after loading the decoded prefix into a fresh cache in place of the exact one:

- greedy agreement: fraction of ``--steps`` free-running greedy tokens equal to the exact run's tokens,
  and the index of the first divergence;
- cosine: mean and minimum cosine similarity of the final hidden states (after the last norm) over the
  suffix and the exact run's generated tokens, teacher-forced.

It also compares int8 scale layouts (per channel vs per (token, head), for keys and values) by relative
error per stored byte, which is how the default layout of the ``int8`` codec was chosen.

With a trained model (``--model smollm2``) it measures quality on real KV instead: for each plain-text
document in ``benchmarks/documents`` (512-2048 tokens with the model's tokenizer) the prompt's KV goes
through each rendition and the last ``--held-out`` tokens are scored teacher-forced, giving per rendition
the size vs raw, the mean KL divergence from the lossless output, the change in log-loss (nats/token) on
the held-out tokens and the top-1 agreement with lossless. The random presets' ratios and quality are
only indicative: a trained model's K/V has different statistics (outlier channels, smoother values).
Run: ``python benchmarks/bench_codecs.py [--model bench|smollm2] [--prefix 256] [--block-size 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from kvnet.blocks.codecs import CODECS, Codec, CodecError, Int8Codec
from kvnet.blocks.transform_codec import TransformCodec, token_shifts_from_importance
from kvnet.blocks.transform_tables import (
    TransformTables,
    parse_tables_body,
    sign_tables,
    verify_tables,
)
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.model.checkpoint import load_checkpoint
from kvnet.model.importance import token_importance
from kvnet.model.registry import default_models_dir, is_registered, resolve_model
from kvnet.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from kvnet.model.transformer import ModelArgs, Transformer
from kvnet.node.kvtc_calibration import (
    HELD_OUT_TOKENS,
    calibrate_model_tables,
    prefix_cache,
    scored_log_probs,
)
from kvnet.security.signing import Signer, TrustStore

DOCUMENTS = Path(__file__).resolve().parent / "documents"
CALIBRATION_TEXT = Path(__file__).resolve().parent / "kvtc-calibration.txt"
"""kvtc's calibration text: a frozen excerpt of the project's docs (never the scored documents), so the
tables, and the rows measured with them, do not drift as the docs change."""

TEXT = (
    "Media over QUIC carries named, immutable objects through caching relays. A KV cache block is such "
    "an object: computed once for a shared prefix, fetched by many inference nodes, verified against "
    "a signed manifest and loaded layer by layer into a paged cache. "
)

Blocks = list[list[tuple[torch.Tensor, torch.Tensor]]]  # [block][layer] -> (k, v): [block_size, H, D]


def prompt_tokens(n: int) -> list[int]:
    ids = ByteTokenizer().tokenize(TEXT * (n // len(TEXT) + 2))
    return ids[:n]


class HiddenCapture:
    """Forward hook on the final norm: keeps its last output ``[T, dim]``."""

    def __init__(self, model: Transformer) -> None:
        self.last: torch.Tensor | None = None
        model.norm.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.last = output.detach().float()


def new_cache(model: Transformer, block_size: int, num_tokens: int) -> PagedKVCache:
    a = model.args
    spec = CacheSpec(a.n_layers, a.n_kv_heads, a.head_dim, block_size, model.dtype)
    return PagedKVCache(spec, num_tokens // block_size + 4, model.device)


def run(model: Transformer, cache: PagedKVCache, seq_id: int, token_ids: list[int]) -> torch.Tensor:
    """Append ``token_ids`` to ``seq_id`` through the model; returns logits ``[T, vocab]``."""
    start = cache.num_tokens(seq_id)
    slots = cache.append_slots(seq_id, len(token_ids))
    positions = torch.arange(start, start + len(token_ids), device=model.device)
    tokens = torch.tensor(token_ids, dtype=torch.int64, device=model.device)
    return model(tokens, positions, cache, cache.block_table(seq_id), slots, start + len(token_ids))


def prefill_blocks(model: Transformer, prefix: list[int], block_size: int) -> Blocks:
    """The exact K/V of every block of ``prefix``, per layer, copied out of the paged cache."""
    cache = new_cache(model, block_size, len(prefix))
    cache.add_sequence(0, prefix, [])
    with torch.no_grad():
        run(model, cache, 0, prefix)
    table = cache.block_table(0).tolist()
    blocks: Blocks = []
    for block_id in table:
        layers = []
        for layer in range(model.args.n_layers):
            k_buf, v_buf = cache.layer_buffers(layer)
            layers.append((k_buf[block_id].clone(), v_buf[block_id].clone()))
        blocks.append(layers)
    return blocks


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    """Median CPU seconds of this thread over ``runs`` calls (wall time would count other work on a
    shared machine; the codecs run on this thread only, ``torch.set_num_threads(1)``)."""
    durations = []
    for _ in range(runs):
        start = time.thread_time()
        fn()
        durations.append(time.thread_time() - start)
    return statistics.median(durations)


class CodecSpeed(NamedTuple):
    """One codec's figures over all (block, layer) pairs; MB are uncompressed (raw K/V) megabytes."""

    ratio: float
    encode_mbps: float
    decode_mbps: float
    """``decode``: a new pair of tensors per layer."""
    into_mbps: float
    """``decode_into`` preallocated tensors: what the fetch path does with the paged cache's slots."""

    def columns(self) -> str:
        ms = [1000 / x for x in (self.encode_mbps, self.decode_mbps, self.into_mbps)]
        return (f"{self.ratio:6.3f} {self.encode_mbps:9.0f} {self.decode_mbps:9.0f} {self.into_mbps:9.0f} "
                f"{ms[0]:8.3f} {ms[1]:8.3f} {ms[2]:8.3f}")


SPEED_HEADER = (f"{'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9} {'into MB/s':>9} {'enc ms/MB':>8} "
                f"{'dec ms/MB':>8} {'into ms/MB':>8}")


KVTC_TABLES: TransformTables | None = None
"""The model's kvtc tables for this run (``kvtc_tables``); kvtc is skipped without them."""
KVTC_UNIFORM = "kvtc-uniform"
"""``--renditions`` name of kvtc with every token at the tables' steps (no per-token steps), to compare."""


def kvtc_tables(model: Transformer, tokenizer: Tokenizer, block_size: int, path: Path, tokens: int,
                rel_step: float, layer_group: int = 0, key_metric: bool = True,
                scorer: Transformer | None = None) -> TransformTables:
    """kvtc tables calibrated on ``CALIBRATION_TEXT`` (never the scored documents); their body is cached at
    ``path`` (recalibrated when it is of another format). K is weighted by the queries' metric unless
    ``key_metric`` is false. With ``layer_group`` the steps are allocated by measured sensitivity, scored
    by ``scorer`` (``kvnet.node.kvtc_calibration.measure_step_scale``): the first ``tokens`` are calibrated
    on, the next 256 scored. Signed here under a throwaway key and verified as a node would (signature,
    digest, model fingerprint): the benchmark checks the codec, not the trust chain."""
    fingerprint = model.fingerprint(block_size)
    try:
        tables = parse_tables_body(path.read_bytes()) if path.is_file() else None
    except CodecError as exc:
        print(f"  recalibrating: {path}: {exc}", flush=True)
        tables = None
    if tables is None:
        all_ids = tokenizer.tokenize(CALIBRATION_TEXT.read_text(encoding="utf-8"))
        held = HELD_OUT_TOKENS if layer_group else 0
        ids = all_ids[:tokens + held]
        print(f"  calibrating kvtc tables on {len(ids) - held} tokens of {CALIBRATION_TEXT.name}", flush=True)
        tables = calibrate_model_tables(model, ids, block_size, rel_step, key_metric=key_metric,
                                        layer_group=layer_group, scorer=scorer, held_out=held)
        path.write_bytes(tables.body())
    signer = Signer.generate()
    trust = TrustStore()
    trust.add(signer.public_key)
    return verify_tables(sign_tables(tables, signer), trust, fingerprint, tables.digest)


def measure_kvtc(codec: TransformCodec, blocks: Blocks, runs: int, token_shifts: np.ndarray | None = None
                 ) -> tuple[CodecSpeed, list[list[bytes]]]:
    """``measure_codec`` for kvtc: encoded block by block with the tables (and ``token_shifts``, ``[L, N]``
    for the prefix's N tokens, as a node codes them); decoded a block's layers at once (``decode_block``),
    which also stands for ``decode_into``."""
    assert KVTC_TABLES is not None
    tables = KVTC_TABLES
    raw = sum(2 * k.numel() * k.element_size() for layers in blocks for k, _ in layers)
    b = int(blocks[0][0][0].shape[0])

    stacked = [(torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers]))
               for layers in blocks]

    def encode() -> list[list[bytes]]:
        # The first block's first row is the sequence's first token, the attention sink: coded finer.
        return [codec.encode_block(k, v, tables, sink_rows=int(index == 0), first_position=index * b,
                                   token_shifts=None if token_shifts is None
                                   else token_shifts[:, index * b:(index + 1) * b])
                for index, (k, v) in enumerate(stacked)]

    payloads = encode()
    shape = tuple(blocks[0][0][0].shape)
    dtype = blocks[0][0][0].dtype
    enc = median_seconds(encode, runs)
    dec = median_seconds(lambda: [codec.decode_block(p, shape, dtype) for p in payloads], runs)  # type: ignore[arg-type]
    ratio = raw / sum(len(p) for ps in payloads for p in ps)
    return CodecSpeed(ratio, raw / enc / 1e6, raw / dec / 1e6, raw / dec / 1e6), payloads


def measure_codec(codec: Codec, blocks: Blocks, runs: int, token_shifts: np.ndarray | None = None
                  ) -> tuple[CodecSpeed, list[list[bytes]]]:
    """The codec's ratio and speeds (median of ``runs``), and its payloads (kvtc's with ``token_shifts``)."""
    if isinstance(codec, TransformCodec):
        return measure_kvtc(codec, blocks, runs, token_shifts)
    pairs = [kv for layers in blocks for kv in layers]
    raw = sum(2 * k.numel() * k.element_size() for k, _ in pairs)
    payloads = [[codec.encode(k, v) for k, v in layers] for layers in blocks]
    flat = [p for layer_payloads in payloads for p in layer_payloads]
    shape = tuple(pairs[0][0].shape)
    dtype = pairs[0][0].dtype
    k_out, v_out = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
    enc = median_seconds(lambda: [codec.encode(k, v) for k, v in pairs], runs)
    dec = median_seconds(lambda: [codec.decode(p, shape, dtype) for p in flat], runs)  # type: ignore[arg-type]

    def decode_all_into() -> None:
        for p in flat:
            codec.decode_into(p, k_out, v_out)

    into = median_seconds(decode_all_into, runs)
    speed = CodecSpeed(raw / sum(map(len, flat)), raw / enc / 1e6, raw / dec / 1e6, raw / into / 1e6)
    return speed, payloads


def load_prefix(
    model: Transformer, blocks: Blocks, block_size: int, total_tokens: int
) -> tuple[PagedKVCache, int]:
    """A fresh cache whose sequence 0 starts with the given prefix K/V (written through the seam)."""
    num_prefix = len(blocks) * block_size
    return prefix_cache(model, *layer_major(blocks), block_size, total_tokens - num_prefix), num_prefix


@torch.no_grad()
def greedy(model: Transformer, blocks: Blocks, block_size: int, suffix: list[int], steps: int) -> list[int]:
    cache, _ = load_prefix(model, blocks, block_size, len(blocks) * block_size + len(suffix) + steps)
    logits = run(model, cache, 0, suffix)
    out = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits = run(model, cache, 0, out[-1:])
        out.append(int(logits[-1].argmax()))
    return out


@torch.no_grad()
def hidden_states(
    model: Transformer, capture: HiddenCapture, blocks: Blocks, block_size: int, tokens: list[int]
) -> torch.Tensor:
    cache, _ = load_prefix(model, blocks, block_size, len(blocks) * block_size + len(tokens))
    run(model, cache, 0, tokens)
    assert capture.last is not None
    return capture.last


def decoded_blocks(codec: Codec, payloads: list[list[bytes]], like: Blocks) -> Blocks:
    shape = tuple(like[0][0][0].shape)
    dtype = like[0][0][0].dtype
    if isinstance(codec, TransformCodec):
        return [codec.decode_block(layer_payloads, shape, dtype)  # type: ignore[arg-type]
                for layer_payloads in payloads]
    return [[codec.decode(p, shape, dtype) for p in layer_payloads]  # type: ignore[arg-type]
            for layer_payloads in payloads]


def rel_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.float() - y.float()).norm() / x.float().norm())


def int8_layouts(blocks: Blocks) -> None:
    print("\nint8 scale layout (keys, values): relative L2 error of K and V, ratio")
    pairs = [kv for layers in blocks for kv in layers]
    raw = sum(2 * k.numel() * k.element_size() for k, _ in pairs)
    shape, dtype = tuple(pairs[0][0].shape), pairs[0][0].dtype
    for kpc in (True, False):
        for vpc in (True, False):
            codec = Int8Codec(key_per_channel=kpc, value_per_channel=vpc)
            payloads = [codec.encode(k, v) for k, v in pairs]
            decoded = [codec.decode(p, shape, dtype) for p in payloads]  # type: ignore[arg-type]
            k_err = statistics.mean(rel_error(k, d[0]) for (k, _), d in zip(pairs, decoded, strict=True))
            v_err = statistics.mean(rel_error(v, d[1]) for (_, v), d in zip(pairs, decoded, strict=True))
            label = f"{'channel' if kpc else 'token':>7}, {'channel' if vpc else 'token':>7}"
            print(f"  {label}  K {k_err:.5f}  V {v_err:.5f}  ratio {raw / sum(map(len, payloads)):.3f}")


def layer_major(blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix's K and V ``[L, N, H, D]`` (what ``scored_log_probs`` reads) from per-block layers."""
    layers = range(len(blocks[0]))
    return (torch.stack([torch.cat([block[layer][0] for block in blocks]) for layer in layers]),
            torch.stack([torch.cat([block[layer][1] for block in blocks]) for layer in layers]))


def real_kv_quality(
    model: Transformer, tokenizer: Tokenizer, block_size: int, held_out: int, runs: int,
    renditions: set[str] | None = None, scorer: Transformer | None = None,
) -> list[tuple[str, float, float, float, float, int, float, float]]:
    """Per rendition over all documents: (name, size vs raw, mean KL vs lossless, delta log-loss, top-1
    agreement, positions scored, encode MB/s, decode MB/s), for ``renditions`` (all when None; lossless,
    the reference, always). Log-loss is the mean NLL of each held-out
    token's successor; the speeds are position-weighted means over the documents."""
    codecs: dict[str, Codec] = {name: codec for name, codec in CODECS.items()
                                if name == "lossless" or renditions is None or name in renditions}
    # kvtc needs the tables (--kvtc-tables); its rows at equal steps only where asked for by name.
    if KVTC_TABLES is not None and (renditions is None or TransformCodec.name in renditions):
        codecs[TransformCodec.name] = TransformCodec()
    if KVTC_TABLES is not None and renditions is not None and KVTC_UNIFORM in renditions:
        codecs[KVTC_UNIFORM] = TransformCodec()
    totals: dict[str, list[float]] = {name: [0.0] * 7 for name in codecs}
    positions = 0
    for path in sorted(DOCUMENTS.glob("*.txt")):
        ids = tokenizer.tokenize(path.read_text(encoding="utf-8"))
        num_prefix = (len(ids) - held_out) // block_size * block_size
        prefix, scored = ids[:num_prefix], ids[num_prefix:num_prefix + held_out]
        print(f"  {path.name}: {len(ids)} tokens, prefix {num_prefix}, scoring {len(scored) - 1}", flush=True)
        blocks = prefill_blocks(model, prefix, block_size)
        token_shifts = None
        if TransformCodec.name in codecs:  # a node's steps per token: from the prefix's last queries
            cache, _ = load_prefix(model, blocks, block_size, num_prefix)
            token_shifts = token_shifts_from_importance(
                token_importance(model, cache, cache.block_table(0), prefix))
        targets = torch.tensor(scored[1:])
        reference: torch.Tensor | None = None
        for name, codec in codecs.items():  # lossless first: the others are compared with it
            speed, payloads = measure_codec(codec, blocks, runs,
                                            token_shifts if name == TransformCodec.name else None)
            ratio = speed.ratio
            print(f"    {name}: {SPEED_HEADER}\n    {name}: {speed.columns()}", flush=True)
            k, v = layer_major(decoded_blocks(codec, payloads, blocks))
            log_probs = scored_log_probs(scorer or model, k, v, scored, block_size)
            if reference is None:
                reference = log_probs
            kl = (reference.exp() * (reference - log_probs)).sum(-1)
            nll = -log_probs.gather(1, targets[:, None])[:, 0]
            ref_nll = -reference.gather(1, targets[:, None])[:, 0]
            agree = (log_probs.argmax(-1) == reference.argmax(-1)).float()
            n = len(targets)
            for index, value in enumerate((ratio * n, float(kl.sum()), float((nll - ref_nll).sum()),
                                           float(agree.sum()), float(nll.sum()), speed.encode_mbps * n,
                                           speed.decode_mbps * n)):
                totals[name][index] += value
        positions += len(targets)
    return [
        (name, t[0] / positions, t[1] / positions, t[2] / positions, t[3] / positions, positions,
         t[5] / positions, t[6] / positions)
        for name, t in totals.items()
    ]


def load_trained(name: str, dtype_name: str) -> tuple[Transformer, Tokenizer]:
    """A named trained model (converted on first use) in `dtype_name`, and its tokenizer."""
    directory = resolve_model(name, default_models_dir(os.environ), progress=print)
    tokenizer = load_tokenizer(directory)
    model = load_checkpoint(directory, device=torch.device("cpu"), dtype=getattr(torch, dtype_name),
                            tokenizer_identity=tokenizer.identity())
    return model.eval(), tokenizer


def main_real(args: argparse.Namespace) -> None:
    print(f"model {args.model}; block size {args.block_size}; {args.held_out} held-out tokens per document "
          f"scored after its prompt KV went through each rendition; load average {os.getloadavg()[0]:.1f}")
    global KVTC_TABLES
    rows = []
    for dtype_name in args.dtypes.split(","):
        model, tokenizer = load_trained(args.model, dtype_name)
        scorer = model if args.score_dtype in ("same", dtype_name) else \
            load_trained(args.model, args.score_dtype)[0]
        print(f"== {dtype_name} (scored by the model in {scorer.dtype})", flush=True)
        KVTC_TABLES = None
        if args.kvtc_tables:
            KVTC_TABLES = kvtc_tables(model, tokenizer, args.block_size,
                                      Path(f"{args.kvtc_tables}.{dtype_name}"), args.kvtc_calibration_tokens,
                                      args.kvtc_rel_step, args.kvtc_layer_group,
                                      key_metric=not args.kvtc_unweighted_keys, scorer=scorer)
        renditions = set(args.renditions.split(",")) if args.renditions else None
        rows += [(dtype_name, *row) for row in real_kv_quality(model, tokenizer, args.block_size,
                                                               args.held_out, args.runs, renditions, scorer)]
    print("\n| model dtype | rendition | size vs raw | mean KL vs lossless | Δ log-loss (nats/token) "
          "| top-1 agreement | encode MB/s | decode MB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype_name, name, ratio, kl, delta, agree, _, enc, dec in rows:
        print(f"| {dtype_name} | {name} | {ratio:.2f}x | {kl:.1e} | {delta:+.4f} | {agree:.3f} | {enc:.0f} "
              f"| {dec:.0f} |")
    print(f"\n(positions scored per dtype: {rows[0][6]}; load average {os.getloadavg()[0]:.1f})")
    if args.json:
        for dtype_name, name, ratio, kl, delta, agree, _, enc, dec in rows:
            print(json.dumps({"dtype": dtype_name, "rendition": name, "ratio": ratio, "kl": kl,
                              "delta_log_loss": delta, "top1": agree, "encode_mb_s": enc,
                              "decode_mb_s": dec}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default="bench", help="model preset (ModelArgs.from_name) or trained model name (smollm2)"
    )
    parser.add_argument("--prefix", type=int, default=256, help="prefix tokens (rounded down to blocks)")
    parser.add_argument("--suffix", type=int, default=16, help="tokens prefilled after the prefix")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps for the quality check")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--json", action="store_true",
                        help="trained model: also one JSON line per (dtype, rendition)")
    parser.add_argument("--kvtc-tables", default="", help="trained model: kvtc tables file prefix "
                        "(calibrated and written when missing; kvtc is skipped without it)")
    parser.add_argument("--kvtc-calibration-tokens", type=int, default=1024)
    parser.add_argument("--kvtc-rel-step", type=float, default=0.15)
    parser.add_argument("--kvtc-unweighted-keys", action="store_true", help="trained model: code kvtc's K "
                        "without the queries' metric (the comparison: K's own MSE instead of the logits')")
    parser.add_argument("--kvtc-layer-group", type=int, default=0, help="trained model: allocate kvtc's "
                        "steps by the KL measured per group of this many layers, K and V apart (0: equal)")
    parser.add_argument("--renditions", default="", help="trained model: comma-separated renditions to "
                        "measure besides lossless (default all; kvtc needs --kvtc-tables; kvtc-uniform: "
                        "kvtc without its per-token steps)")
    parser.add_argument("--no-quality", action="store_true", help="skip the model quality check")
    parser.add_argument("--held-out", type=int, default=256, help="trained model: tokens scored per document")
    parser.add_argument("--score-dtype", default="float32", choices=("float32", "same"),
                        help="trained model: the dtype of the model that scores the decoded KV (KL, "
                        "log-loss, top-1; the KV itself stays in --dtypes). In bfloat16 arithmetic any "
                        "change to the KV at all, even noise of 1e-3 of each value, costs ~1.6e-3 of KL: "
                        "a floor that hides the codecs' differences ('same' measures with it)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # per-core figures
    if is_registered(args.model):
        main_real(args)
        return

    margs = ModelArgs.from_name(args.model)
    num_prefix = args.prefix // args.block_size * args.block_size
    tokens = prompt_tokens(num_prefix + args.suffix)
    prefix, suffix = tokens[:num_prefix], tokens[num_prefix:]
    print(f"model {args.model}: {margs.n_layers} layers, H_kv {margs.n_kv_heads}, head_dim "
          f"{margs.head_dim}; prefix {num_prefix} tokens = {num_prefix // args.block_size} blocks of "
          f"{args.block_size}; median of {args.runs} runs, 1 thread")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = Transformer(margs, device=torch.device("cpu"), dtype=dtype, seed=0)
        model.eval()
        capture = HiddenCapture(model)
        blocks = prefill_blocks(model, prefix, args.block_size)
        print(f"\n== {dtype_name} ==")
        print(f"{'codec':>9} {SPEED_HEADER}  quality vs exact prefix")
        reference_tokens: list[int] = []
        reference_hidden: torch.Tensor | None = None
        if not args.no_quality:
            reference_tokens = greedy(model, blocks, args.block_size, suffix, args.steps)
            reference_hidden = hidden_states(model, capture, blocks, args.block_size,
                                             suffix + reference_tokens)
        for name, codec in CODECS.items():  # kvtc needs a trained model's tables (--model smollm2)
            speed, payloads = measure_codec(codec, blocks, args.runs)
            quality = ""
            if not args.no_quality and reference_hidden is not None:
                loaded = decoded_blocks(codec, payloads, blocks)
                got = greedy(model, loaded, args.block_size, suffix, args.steps)
                agree = sum(a == b for a, b in zip(got, reference_tokens, strict=True)) / len(got)
                first = next((i for i, (a, b) in enumerate(zip(got, reference_tokens, strict=True))
                              if a != b), len(got))
                hidden = hidden_states(model, capture, loaded, args.block_size, suffix + reference_tokens)
                cos = torch.nn.functional.cosine_similarity(hidden, reference_hidden, dim=-1)
                quality = (f"greedy agree {agree:.3f} (first diff {first}/{len(got)}), cosine mean "
                           f"{float(cos.mean()):.6f} min {float(cos.min()):.6f}")
            print(f"{name:>9} {speed.columns()}  {quality}")
        int8_layouts(blocks)


if __name__ == "__main__":
    main()
