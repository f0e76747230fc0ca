"""The ``kvnet`` command: certificates, authorization tokens, the link emulator, model conversion and
kvtc tables.

Each subcommand registers itself with ``_add_<name>(subparsers)`` and sets ``func`` on its parser; ``main``
parses argv and dispatches. Only this module reads the command line; everything below gets plain arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvnet.config import config_parser, parse_config
from kvnet.logs import add_log_arguments, setup_logging_from_args
from kvnet.progress import Progress
from kvnet.security import certs

logger = logging.getLogger("kvnet")
T = TypeVar("T")


def _cmd_certs_init(args: argparse.Namespace) -> int:
    paths = certs.create_ca(
        args.dir, common_name=args.common_name, valid_days=args.days, overwrite=args.force
    )
    print(f"CA certificate: {paths.cert}")
    print(f"CA key:         {paths.key} (mode 0600)")
    return 0


def _cmd_certs_issue(args: argparse.Namespace) -> int:
    issued = certs.issue_cert(args.dir, args.name, args.host, valid_days=args.days, overwrite=args.force)
    print(f"certificate: {issued.cert}")
    print(f"key:         {issued.key} (mode 0600)")
    print(f"CA:          {issued.ca}")
    return 0


def _cmd_certs_show(args: argparse.Namespace) -> int:
    print(certs.describe(args.file))
    return 0


def _add_certs(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("certs", help="development CA and certificates")
    csub = p.add_subparsers(dest="certs_cmd", required=True)
    init = csub.add_parser("init", help="create a development CA (ca.pem, ca-key.pem)")
    init.add_argument("--dir", type=Path, required=True, help="certificate directory")
    init.add_argument("--common-name", default="kvnet development CA")
    init.add_argument("--days", type=int, default=certs.MAX_VALID_DAYS, help="validity in days")
    init.add_argument("--force", action="store_true", help="overwrite existing files")
    init.set_defaults(func=_cmd_certs_init)
    issue = csub.add_parser("issue", help="issue a leaf certificate signed by the CA in --dir")
    issue.add_argument("--dir", type=Path, required=True, help="certificate directory holding the CA")
    issue.add_argument("--name", required=True, help="file stem: writes NAME.pem and NAME-key.pem")
    issue.add_argument(
        "--host", action="append", required=True, help="DNS name or IP for subjectAltName (repeatable)"
    )
    issue.add_argument("--days", type=int, default=825, help="validity in days")
    issue.add_argument("--force", action="store_true", help="overwrite existing files")
    issue.set_defaults(func=_cmd_certs_issue)
    show = csub.add_parser("show", help="print subject, hosts and expiry of a PEM certificate file")
    show.add_argument("file", type=Path)
    show.set_defaults(func=_cmd_certs_show)


def _cmd_token_issuer(args: argparse.Namespace) -> int:
    from kvnet.security import tokens as auth

    key = auth.IssuerKey.generate()
    key.save(args.key, overwrite=args.force)
    key.save_public(args.public)
    print(f"issuer key:        {args.key} (mode 0600; keep it off relays)")
    print(f"issuer public key: {args.public} (give it to relays: --auth-issuer-key)")
    print(f"key id:            {key.key_id.hex()}")
    return 0


def _cmd_token_issue(args: argparse.Namespace) -> int:
    import time

    from kvnet.security import tokens as auth

    issuer = auth.IssuerKey.load(args.issuer_key)
    claims = auth.make_claims(
        args.subject,
        args.tenant,
        args.action,
        [auth.parse_namespace(text) for text in args.prefix],
        now=time.time(),
        lifetime_s=args.lifetime,
    )
    token = auth.issue_token(issuer, claims)
    # A token is a bearer credential: create the file owner-only, and refuse to clobber one by accident.
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if args.force else os.O_EXCL)
    fd = os.open(args.out, flags, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(token)
    print(f"token: {args.out} ({len(token)} bytes, expires in {int(args.lifetime)} s)")
    return 0


def _add_token(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvnet.security.tokens import Action

    p = sub.add_parser("token", help="authorization tokens for relays (AUTHORIZATION TOKEN)")
    tsub = p.add_subparsers(dest="token_cmd", required=True)
    issuer = tsub.add_parser("issuer", help="create an Ed25519 token issuer key pair")
    issuer.add_argument("--key", type=Path, required=True, help="private key file to write (0600)")
    issuer.add_argument("--public", type=Path, required=True, help="public key file to write")
    issuer.add_argument("--force", action="store_true", help="overwrite an existing private key")
    issuer.set_defaults(func=_cmd_token_issuer)
    issue = tsub.add_parser("issue", help="issue a signed, expiring token")
    issue.add_argument("--issuer-key", type=Path, required=True, help="issuer private key file")
    issue.add_argument("--subject", required=True, help="who the token is for (logged by relays)")
    issue.add_argument("--tenant", required=True, help="authenticated tenant id")
    issue.add_argument(
        "--action",
        action="append",
        required=True,
        choices=[a.value for a in Action],
        help="allowed action (repeatable): publish, subscribe (also fetch and track status), relay",
    )
    issue.add_argument(
        "--prefix",
        action="append",
        required=True,
        help="allowed namespace prefix in the draft's text form, fields joined by '-' (repeatable)",
    )
    issue.add_argument("--lifetime", type=float, default=3600.0, help="validity in seconds")
    issue.add_argument("--out", type=Path, required=True, help="token file to write (0600)")
    issue.add_argument("--force", action="store_true", help="overwrite an existing token file")
    issue.set_defaults(func=_cmd_token_issue)


def _cmd_linkemu(args: argparse.Namespace) -> int:
    from kvnet.tools import linkemu

    up = linkemu.LinkParams(
        delay_ms=args.delay_ms,
        jitter_ms=args.jitter_ms,
        loss=args.loss,
        loss_burst=args.loss_burst,
        reorder=args.reorder,
        rate_bps=args.rate,
        burst_bytes=args.burst,
        queue_packets=args.queue_packets,
    )
    down = linkemu.LinkParams(
        delay_ms=args.delay_ms if args.down_delay_ms is None else args.down_delay_ms,
        jitter_ms=args.jitter_ms,
        loss=args.loss if args.down_loss is None else args.down_loss,
        loss_burst=args.loss_burst,
        reorder=args.reorder,
        rate_bps=args.rate if args.down_rate is None else args.down_rate,
        burst_bytes=args.burst,
        queue_packets=args.queue_packets,
    )
    config = linkemu.EmulatorConfig(
        listen=linkemu.parse_hostport(args.listen),
        target=linkemu.parse_hostport(args.target),
        upstream=up,
        downstream=down,
        seed=args.seed,
    )
    return asyncio.run(linkemu.run_forever(config, stats_interval=args.stats_interval))


def _add_linkemu(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "linkemu",
        help="userspace UDP link emulator (delay, jitter, loss, reordering, rate)",
        description="Forward UDP from --listen to --target, shaping each direction. Parameters apply to both "
        "directions unless a --down-* flag overrides the target->client direction.",
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to receive client datagrams on ([v6]:port ok)")
    p.add_argument("--target", required=True, help="HOST:PORT of the real server")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform extra delay 0..jitter")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss probability 0..1")
    p.add_argument(
        "--loss-burst", type=float, default=1.0, help="mean loss burst length in packets (1 = independent)"
    )
    p.add_argument("--reorder", type=float, default=0.0, help="probability a packet skips the delay queue")
    p.add_argument("--rate", type=float, default=0.0, help="rate limit in bytes/s (0 = unlimited)")
    p.add_argument("--burst", type=float, default=0.0,
                   help="token bucket depth of the rate in bytes, sent at once after idling (0 = none)")
    p.add_argument("--queue-packets", type=int, default=1000, help="per-direction queue bound")
    p.add_argument("--down-delay-ms", type=float, default=None)
    p.add_argument("--down-loss", type=float, default=None)
    p.add_argument("--down-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible runs")
    p.add_argument("--stats-interval", type=float, default=0.0, help="log counters every N seconds")
    p.set_defaults(func=_cmd_linkemu)


def _with_progress(desc: str, work: Callable[[], T]) -> T:
    """Run ``work`` in a thread under a progress bar (on a terminal); its messages are log lines above it."""

    async def run() -> T:
        async with Progress.for_command().activity(desc):
            return await asyncio.to_thread(work)

    return asyncio.run(run())


def _cmd_model_convert(args: argparse.Namespace) -> int:
    from kvnet.model.gguf import convert_gguf

    result = _with_progress(f"converting {args.gguf_file.name}", lambda: convert_gguf(
        args.gguf_file, args.dir, expected_sha256=args.sha256, run_dtype=args.dtype, overwrite=args.force,
        progress=logger.info,
    ))
    print(f"checkpoint: {result.directory} ({result.num_tensors} tensors, input sha256 {result.sha256})")
    return 0


def _cmd_model_path(args: argparse.Namespace) -> int:
    from kvnet.model.registry import default_models_dir, resolve_model

    models_dir = default_models_dir(os.environ)
    directory = _with_progress(
        f"model {args.name}", lambda: resolve_model(args.name, models_dir, progress=logger.info)
    )
    print(directory)
    return 0


def _cmd_model_list(args: argparse.Namespace) -> int:
    from kvnet.model.registry import MODELS

    for model in MODELS.values():
        print(f"{model.name}: {model.description} (package: {model.install})")
    return 0


def _add_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("model", help="trained models: convert GGUF files, resolve model names")
    msub = p.add_subparsers(dest="model_cmd", required=True)
    convert = msub.add_parser(
        "convert", help="convert a Llama-architecture GGUF file into a checkpoint directory",
        description="Writes config.json, model.safetensors (float32, dequantized), tokenizer.json and "
        "tokenizer_config.json (with the chat template) into DIR.",
    )
    convert.add_argument("gguf_file", type=Path, metavar="GGUF_FILE")
    convert.add_argument("dir", type=Path, metavar="DIR", help="checkpoint directory to create")
    convert.add_argument("--sha256", help="expected SHA-256 (hex) of GGUF_FILE; refuse to convert otherwise")
    convert.add_argument(
        # Checked against kvnet.dtypes by convert_gguf: no torch import just to build the parser.
        "--dtype", default="bfloat16",
        help="dtype config.json names, which nodes run the model and keep KV in (a torch dtype name "
        "such as float16; default bfloat16)",
    )
    convert.add_argument("--force", action="store_true", help="replace DIR if it exists")
    convert.set_defaults(func=_cmd_model_convert)
    path = msub.add_parser(
        "path", help="print the checkpoint directory of a named model (converted on first use)"
    )
    path.add_argument("name", help="model name, e.g. smollm2")
    path.set_defaults(func=_cmd_model_path)
    listing = msub.add_parser("list", help="list the named models")
    listing.set_defaults(func=_cmd_model_list)


def _cmd_kvtc_calibrate(args: argparse.Namespace) -> int:
    import dataclasses

    import torch

    from kvnet.model.registry import default_models_dir
    from kvnet.node.config import NodeConfig
    from kvnet.node.kvtc_calibration import (
        DEFAULT_LAYER_GROUP,
        DEFAULT_REL_STEP,
        calibrate_model_tables,
        tokens_to_predict,
    )
    from kvnet.node.node import build_model

    if args.out.exists() and not args.force:
        raise FileExistsError(0, "exists", str(args.out))
    text = "\n".join(path.read_text(encoding="utf-8") for path in args.text)
    config = NodeConfig(model=args.model, checkpoint=args.checkpoint, seed=args.seed, dtype=args.dtype,
                        block_size=args.block_size)

    def work() -> tuple[int, bytes, bytes, int, int, int]:
        models_dir = default_models_dir(os.environ)
        model, tokenizer = build_model(config, models_dir)
        # The allocation scores in float32: bfloat16 arithmetic has a KL floor that would drown it.
        group = DEFAULT_LAYER_GROUP if args.layer_group is None else args.layer_group
        scorer = model if model.dtype == torch.float32 or not group else \
            build_model(dataclasses.replace(config, dtype="float32"), models_dir)[0]
        ids = tokenizer.tokenize(text)[:args.tokens]
        rel_step = DEFAULT_REL_STEP if args.rel_step is None else args.rel_step
        tables = calibrate_model_tables(model, ids, args.block_size, rel_step, layer_group=group,
                                        scorer=scorer)
        return (len(ids), tables.body(), tables.fingerprint, sum(tables.predicted_layers), tables.num_layers,
                tokens_to_predict(tables))

    tokens, body, fingerprint, predicted, layers, needed = _with_progress("calibrating kvtc tables", work)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(body)
    os.replace(tmp, args.out)
    print(f"kvtc tables: {args.out} ({len(body):,} bytes, {tokens} tokens, {predicted} of {layers} layers "
          f"predicted from the layer before, model fingerprint {fingerprint.hex()[:16]}); publish with: "
          f"kvnet-node --renditions kvtc --kvtc-tables {args.out}")
    if not predicted:
        print(f"kvtc tables: no layer is predicted from the one before (give at least {needed:,} tokens of "
              "text: the blocks would be smaller)")
    return 0


def _add_kvtc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvnet.node.config import DEFAULT_BLOCK_SIZE, DEFAULT_MODEL

    p = sub.add_parser("kvtc", help="tables of the kvtc rendition (transform-coded KV)")
    ksub = p.add_subparsers(dest="kvtc_cmd", required=True)
    cal = ksub.add_parser(
        "calibrate", help="calibrate a model's kvtc tables on text, for kvnet-node --kvtc-tables",
        description="Runs the model's prefill over the text and writes its kvtc tables (PCA basis, "
        "quantizer steps, coder scales, the key weight, each layer's predictor from the layer before), "
        "bound to the model's fingerprint: use the model, "
        "dtype and block size the nodes run. Nodes sign the tables with their key and serve them.",
    )
    cal.add_argument("--text", type=Path, action="append", required=True,
                     help="calibration text file, ordinary text of the kind the nodes serve (repeatable)")
    cal.add_argument("--out", type=Path, required=True, help="tables file to write")
    cal.add_argument("--model", default=DEFAULT_MODEL, help="model name or built-in preset (as kvnet-node)")
    cal.add_argument("--checkpoint", type=Path, help="local checkpoint directory instead of --model")
    cal.add_argument("--seed", type=int, default=0, help="seed of a built-in preset's weights")
    cal.add_argument("--dtype", help="model and KV dtype, as kvnet-node runs it")
    cal.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    cal.add_argument("--tokens", type=int, default=4096, help="most tokens of the text to calibrate on")
    cal.add_argument("--rel-step", type=float,
                     help="quantizer step relative to each layer's RMS (larger: smaller and coarser; default "
                     "the step measured in docs/performance.md)")
    cal.add_argument("--layer-group", type=int,
                     help="allocate the steps by the model's measured sensitivity per group of this many "
                     "layers, K and V apart (default 5; 0: the same relative step everywhere); the last "
                     "tokens of the text (at most 256) are scored for it, by the model in float32")
    cal.add_argument("--force", action="store_true", help="replace --out if it exists")
    cal.set_defaults(func=_cmd_kvtc_calibrate)


def build_parser() -> argparse.ArgumentParser:
    parser = config_parser("kvnet", "kvnet tools", config_file=False)
    add_log_arguments(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_certs(sub)
    _add_token(sub)
    _add_linkemu(sub)
    _add_model(sub)
    _add_kvtc(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_config(build_parser(), argv)
    setup_logging_from_args(args)
    try:
        rc: int = args.func(args)
    except FileExistsError as exc:
        # Every subcommand that writes files takes --force to replace them.
        print(f"kvnet: error: {exc.filename} already exists (--force replaces it)", file=sys.stderr)
        return 2
    except OSError as exc:
        reason = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
        print(f"kvnet: error: {reason}", file=sys.stderr)
        return 2
    except (certs.CertError, ValueError) as exc:
        print(f"kvnet: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc


if __name__ == "__main__":
    sys.exit(main())
