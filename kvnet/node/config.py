"""A node's configuration: ``NodeConfig`` and the command-line flags every node command shares.

Owns: ``NodeConfig`` (model, cache, relay, signing/trust and ABR knobs), ``add_node_arguments`` /
``node_config_from_cli`` (the flags of ``kvnet-publisher``, ``kvnet-subscriber`` and ``kvnet-node``), the
key-directory defaults (``resolve_keys``) and the token-file reader. Nothing here
builds a model or opens a connection; ``main()`` functions read the environment and pass it in. Nor does
it import torch (only ``--device`` other than cpu is checked with it), so the commands parse and check
their flags before they load it (tests/kvnet/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvnet.blocks.kvtc_entropy import MAX_DECODE_PROCESSES
from kvnet.config import size_arg
from kvnet.exchange.abr import QUALITY_ORDER
from kvnet.exchange.config import (
    CORES_PER_FETCH_CONNECTION,
    DEFAULT_FETCH_CONNECTIONS,
    DEFAULT_KVTC_DECODE_PROCESSES,
    DEFAULT_VERIFY_WORKERS,
    DEFAULT_WINDOW_BYTES,
    MAX_AUTO_FETCH_CONNECTIONS,
    MAX_AUTO_KVTC_DECODE_PROCESSES,
    MAX_AUTO_VERIFY_WORKERS,
    MAX_FETCH_CONNECTIONS,
    RelayPeerConfig,
    auto_fetch_connections,
    auto_kvtc_decode_processes,
    auto_verify_workers,
    check_fetch_settings,
)
from kvnet.logs import add_log_arguments
from kvnet.model.defaults import DEFAULT_MAX_RUNNING_SEQUENCES, DEFAULT_PREFILL_CHUNK, PRESET_NAMES
from kvnet.model.registry import MODELS, is_registered
from kvnet.net.config import DATAGRAM_SIZE_ETHERNET, DEFAULT_STACK, LINK_PRESETS, TlsConfig, TransportConfig
from kvnet.net.url import parse_moqt_url
from kvnet.security.certs import check_tls_files
from kvnet.security.signing import Signer, SigningError, TrustStore, generate_keypair, load_signer
from kvnet.security.tenancy import NodeSecret, TenancyError
from kvnet.security.tokens import read_token_file
from proto.kvobject import DEFAULT_DIGEST_ALGORITHM, DIGEST_ALGORITHMS, DTYPES

logger = logging.getLogger(__name__)

KNOWN_RENDITIONS = QUALITY_ORDER
DEFAULT_CACHE_BYTES = 512 << 20
"""KV bytes of the paged cache when ``--cache-blocks`` is not given."""
MAX_DEFAULT_CACHE_BLOCKS = 2048
# Chosen by measurement (docs/nodes.md, "Block size"): 64-token blocks fetched a 2k-token prefix of the
# bench preset 1.5x faster than 16-token blocks (fewer, larger objects and requests; better compression),
# at the cost of recomputing up to 63 shared tokens past the last full block.
DEFAULT_BLOCK_SIZE = 64
DEFAULT_TENANT = "default"
DEFAULT_MODEL = "smollm2"
"""The trained model every node command runs unless told otherwise (``--model``)."""
DTYPE_NAMES = sorted(DTYPES)
"""``--dtype`` values: the element dtypes a KV block can carry (``kvnet.dtypes.DTYPE_BY_NAME``'s names)."""


class RelayUnreachableError(Exception):
    """A one-shot command's relay could not be reached and ``--best-effort`` was not given (exit status 1)."""


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs: model, cache, relay, signing/trust and ABR knobs."""

    relay_url: str | None = None
    """``moqt://HOST:PORT`` (QUIC) or ``moqt+qmux://HOST:PORT`` (QMux over TLS/TCP) of the relay; None runs
    the node without a network (local cache only)."""
    ca_file: Path | None = None
    """CA certificate that the relay's certificate must chain to."""
    cert_file: Path | None = None
    """Our client certificate (mTLS), optional."""
    key_file: Path | None = None
    """Private key of ``cert_file``."""
    token_file: Path | None = None
    """File holding the authorization token (``kvnet token issue``) presented in SETUP's AUTHORIZATION TOKEN
    option; read at every connect, so a renewed token is picked up by the next session."""
    model: str = DEFAULT_MODEL
    """A trained model's name (``smollm2``, the default: `kvnet.model.registry`, converted on first use) or
    a built-in preset of random weights of a given shape (``tiny``, ``small``, ``bench``: tests and
    benchmarks that want speed over meaning name one)."""
    checkpoint: Path | None = None
    """A local Llama-layout checkpoint directory used instead of ``model``."""
    models_dir: Path | None = None
    """Where named models are converted and kept; None: `kvnet.model.registry.default_models_dir`."""
    seed: int = 0
    """Seed of the built-in deterministic weights (part of the fingerprint through the weights digest)."""
    dtype: str | None = None
    """Model and KV dtype; None follows the model (a checkpoint's ``dtype``, bfloat16 for SmolLM2;
    float32 for the presets)."""
    device: str = "cpu"
    """torch device."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block (part of the fingerprint)."""
    cache_blocks: int | None = None
    """Physical blocks in the paged KV cache; None: as many as fit ``DEFAULT_CACHE_BYTES``, at most
    ``MAX_DEFAULT_CACHE_BLOCKS`` (a fixed count would take GBs for a real model's wider KV)."""
    node_secret: Path | None = None
    """Operator's node secret file (``kvnet.security.tenancy``, mode 0600). With it the chain root is salted
    with ``derive_tenant_salt(secret, tenant)`` and the namespace carries
    ``tenant_namespace_id(secret, tenant)``; without it the salt is empty and the namespace carries the
    tenant id as given (single tenant only)."""
    publish_renditions: tuple[str, ...] = ("lossless",)
    """Renditions a publisher encodes and serves for every block."""
    acceptable_renditions: tuple[str, ...] = ("lossless",)
    """Renditions a subscriber accepts (quality floor); lossless only by default."""
    payload_digest: str = DEFAULT_DIGEST_ALGORITHM
    """What a publisher digests each layer payload with in its signed manifests: ``blake3`` (~4x
    SHA-256's rate per core; subscribers hash every byte they fetch) or ``sha256`` (a FIPS-approved hash).
    Subscribers verify either, whatever their own setting."""
    kvtc_tables: Path | None = None
    """The model's ``kvtc`` tables (a file ``kvnet kvtc calibrate`` writes), which publishing ``kvtc`` needs:
    the node signs them with its key and serves them beside its blocks. Subscribers need none (they fetch
    the tables a block names)."""
    kvtc_decode_processes: int = DEFAULT_KVTC_DECODE_PROCESSES
    """Processes that entropy-decode fetched ``kvtc`` layers (kvnet.blocks.kvtc_entropy: its coder holds the
    GIL, so threads cannot spread it over cores), started with the node when it accepts ``kvtc``; 0: on the
    fetch's threads or event loop. By default one per core, at most 8 (``auto_kvtc_decode_processes``)."""
    store_bytes: int = 512 << 20
    """Byte budget of the publisher-side block store."""
    cache_dir: Path | None = None
    """Persistent tier of the block store (``kvnet.storage.disk``): blocks are also kept here and served
    after a restart. None: memory only."""
    cache_dir_bytes: int = 1 << 30
    """Most bytes of block files kept in ``cache_dir``."""
    signing_key: Path | None = None
    """Ed25519 private key used to sign manifests; None generates an ephemeral key."""
    trust: tuple[Path, ...] = ()
    """Public key files (or directories of ``*.pub``) whose signatures a subscriber accepts."""
    trust_any: bool = False
    """Accept any correctly signed manifest whatever its key (development only; logged loudly)."""
    push: bool = True
    """Publisher: also PUBLISH blocks into the relay's cache (survives the publisher leaving)."""
    republish_bytes: int = 64 << 20
    """On every new relay session (a restarted relay starts empty), push again up to this many bytes of
    the block store's most recently used blocks that the relay cannot serve, in the background; 0: off."""
    fetch_window_bytes: int = DEFAULT_WINDOW_BYTES
    """Raw block bytes requested ahead during a fetch (``kvnet.exchange.fetching``: a few MB keeps loopback
    and LAN links busy without interleaving every block's delivery)."""
    fetch_verify_workers: int = DEFAULT_VERIFY_WORKERS
    """Threads that check digests and decode fetched layers while the event loop keeps reading the network
    (0: on the event loop); by default sized to the host's cores
    (``auto_verify_workers``)."""
    fetch_connections: int = DEFAULT_FETCH_CONNECTIONS
    """Relay sessions a fetch's blocks are split over (``kvnet.exchange.striping``): the node's session, which
    also serves its blocks, and ``fetch_connections - 1`` fetch-only sessions opened with it, each
    verifying its own blocks (with ``fetch_verify_workers`` threads each); at most
    ``MAX_FETCH_CONNECTIONS``; by default sized to the host's cores (``auto_fetch_connections``)."""
    request_timeout: float = 10.0
    """Seconds to wait for one locate or fetch before giving up (and recomputing)."""
    fetch_margin: float = 1.0
    """Seconds a fetch may cost beyond the recompute time of the blocks it delivered; past that it is
    abandoned and the rest recomputed (``kvnet.exchange.abr.FetchDeadline``)."""
    prior_throughput_bps: float = 100e6
    """ABR throughput prior (bytes/s) before anything was measured."""
    abr_mode: str = "auto"
    """``auto`` (fetch or recompute by estimate), ``fetch`` (always fetch located blocks), ``recompute``."""
    abr_overlap: bool = True
    """In ``auto`` mode, plans may compute the head of a located prefix while fetching its tail
    (``kvnet.node.overlap``); False: fetch a prefix and recompute the rest, one after the other."""
    max_new_tokens: int = 16
    """Default generation length."""
    tenant: str = DEFAULT_TENANT
    """Tenant this node computes for (set by the operator; never taken from a client)."""
    quic_stack: str = DEFAULT_STACK
    """QUIC implementation of the relay session (this node is its client). qh3 fetches ~30% faster on
    loopback but locates in 1-2 more round trips through an aioquic relay, so aioquic is the default
    (docs/performance.md, "Node fetch path")."""
    relay_idle_timeout: float = 5.0
    """Seconds without a packet from the relay before its session counts as lost (QUIC idle timeout; the
    node PINGs every third of it): how soon a killed relay is noticed and reconnecting starts (QUIC's
    15 s default would keep requests going to a dead session that long)."""
    max_datagram_size: int | None = None
    """Largest UDP payload of the relay session; None takes the stack's loopback size. Give 1452
    (``--link ethernet``) on a 1500-byte path and 8952 (``--link jumbo``) on jumbo frames."""
    max_running_sequences: int = DEFAULT_MAX_RUNNING_SEQUENCES
    """Sequences computed together at most (continuous batching); requests past it, or past what the KV
    pool can hold, are refused as busy (HTTP 503 with Retry-After)."""
    max_step_tokens: int = DEFAULT_PREFILL_CHUNK
    """Tokens of one batched forward (running decodes first, then prefill chunks): a long prompt is
    prefilled in chunks so it does not stall everyone's decode."""
    torch_threads: int = 1
    """Intra-op threads of torch. One by default: a node shares its cores with the relay and its own event
    loop, and OpenMP workers spin-waiting on a contended 2-core machine made a 5 ms prefill take 300 ms."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.cache_blocks is not None and self.cache_blocks <= 0:
            raise ValueError(f"cache_blocks must be positive, got {self.cache_blocks}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        for name in ("publish_renditions", "acceptable_renditions"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name}: at least one rendition is required")
            unknown = [r for r in values if r not in KNOWN_RENDITIONS]
            if unknown:
                raise ValueError(f"{name}: unknown rendition(s) {unknown}; known: {list(KNOWN_RENDITIONS)}")
        if self.payload_digest not in DIGEST_ALGORITHMS:
            raise ValueError(f"payload_digest must be one of {list(DIGEST_ALGORITHMS)}, got "
                             f"{self.payload_digest!r}")
        if "kvtc" in self.publish_renditions and self.kvtc_tables is None:
            raise ValueError("publish_renditions: kvtc needs the model's tables (--kvtc-tables FILE, from "
                             "'kvnet kvtc calibrate')")
        if not 0 <= self.kvtc_decode_processes <= MAX_DECODE_PROCESSES:
            raise ValueError(f"kvtc_decode_processes must be in [0, {MAX_DECODE_PROCESSES}], got "
                             f"{self.kvtc_decode_processes}")
        if self.store_bytes <= 0:
            raise ValueError(f"store_bytes must be positive, got {self.store_bytes}")
        if self.republish_bytes < 0:
            raise ValueError(f"republish_bytes must not be negative, got {self.republish_bytes}")
        if self.cache_dir_bytes <= 0:
            raise ValueError(f"cache_dir_bytes must be positive, got {self.cache_dir_bytes}")
        check_fetch_settings(self.fetch_window_bytes, self.fetch_verify_workers, self.fetch_connections)
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if not 0.3 <= self.relay_idle_timeout <= 3600:
            raise ValueError(
                f"relay_idle_timeout must be in [0.3, 3600] seconds, got {self.relay_idle_timeout}"
            )
        if not 0 < self.fetch_margin <= 3600:
            raise ValueError(f"fetch_margin must be in (0, 3600] seconds, got {self.fetch_margin}")
        if not 0 < self.prior_throughput_bps < math.inf:
            raise ValueError(f"the assumed throughput must be a positive number of bytes/s, got "
                             f"{self.prior_throughput_bps}")
        if self.abr_mode not in ("auto", "fetch", "recompute"):
            raise ValueError(f"abr_mode must be auto, fetch or recompute, got {self.abr_mode!r}")
        if self.max_running_sequences <= 0:
            raise ValueError(f"max_running_sequences must be positive, got {self.max_running_sequences}")
        if self.max_step_tokens <= 0:
            raise ValueError(f"max_step_tokens must be positive, got {self.max_step_tokens}")
        if self.torch_threads <= 0:
            raise ValueError(f"torch_threads must be positive, got {self.torch_threads}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.transport_config  # noqa: B018 (validates stack and datagram size, naming the field)
        if self.tenant != DEFAULT_TENANT and self.node_secret is None:
            # Different tenants must never share a chain root: that takes a salt, hence a node secret.
            raise ValueError("tenant: a tenant other than the default needs --node-secret (salted hashes)")
        if self.relay_url is not None and self.ca_file is None:
            raise ValueError("ca_file: a relay connection needs --ca to verify the relay (TLS is always on)")


    @property
    def transport_config(self) -> TransportConfig:
        """QUIC settings of the relay session (``TransportConfig.for_ethernet`` on 1500-byte paths), with
        ``relay_idle_timeout`` and a keep-alive PING every third of it."""
        if self.max_datagram_size == DATAGRAM_SIZE_ETHERNET:
            settings = TransportConfig.for_ethernet(self.quic_stack)
        else:
            settings = TransportConfig(max_datagram_size=self.max_datagram_size, stack=self.quic_stack)
        return dataclasses.replace(
            settings, idle_timeout=self.relay_idle_timeout, keepalive_interval=self.relay_idle_timeout / 3
        )

    def relay_peer_config(self, relay_url: str | None = None) -> RelayPeerConfig:
        """What this node's relay session is set up with, to ``relay_url`` instead of ``self.relay_url``
        where given (a GOAWAY's New Session URI)."""
        url = relay_url or self.relay_url
        if url is None:
            raise ValueError("relay_url: a relay session needs the relay's URL")
        return RelayPeerConfig(
            relay_url=url,
            tls=TlsConfig(ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file),
            transport=self.transport_config, token_file=self.token_file, request_timeout=self.request_timeout,
            trust_any=self.trust_any, fetch_window_bytes=self.fetch_window_bytes,
            fetch_verify_workers=self.fetch_verify_workers, fetch_connections=self.fetch_connections,
        )


def _datagram_size(args: argparse.Namespace) -> int | None:
    """``--max-datagram-size``, or the ``--link`` preset's size (``--ethernet`` is ``--link ethernet``)."""
    link = "ethernet" if args.ethernet else args.link
    return args.max_datagram_size if link is None else LINK_PRESETS[link]


def parse_renditions(text: str) -> tuple[str, ...]:
    return tuple(r.strip() for r in text.split(",") if r.strip())


def _count_or_auto(text: str, what: str, auto: Callable[[], int], low: int, high: int | None = None) -> int:
    """A flag's count of ``what`` within ``[low, high]`` (no upper bound: None), or ``auto()`` for ``auto``;
    ``argparse.ArgumentTypeError`` naming the problem otherwise."""
    if text.strip() == "auto":
        return auto()
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a {what} count or 'auto', got {text!r}") from None
    if high is not None and not low <= count <= high:
        raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {count}")
    return count


def verify_workers_arg(text: str) -> int:
    """``--fetch-verify-workers``: a thread count, or ``auto`` (``auto_verify_workers``; the range is the
    config's check)."""
    return _count_or_auto(text, "thread", auto_verify_workers, 0)


def kvtc_decode_processes_arg(text: str) -> int:
    """``--kvtc-decode-processes``: a process count in [0, ``MAX_DECODE_PROCESSES``], or ``auto``
    (``auto_kvtc_decode_processes``)."""
    return _count_or_auto(text, "process", auto_kvtc_decode_processes, 0, MAX_DECODE_PROCESSES)


def fetch_connections_arg(text: str) -> int:
    """``--fetch-connections``: a session count in [1, ``MAX_FETCH_CONNECTIONS``], or ``auto``
    (``auto_fetch_connections``)."""
    return _count_or_auto(text, "session", auto_fetch_connections, 1, MAX_FETCH_CONNECTIONS)


def add_node_arguments(parser: argparse.ArgumentParser, *, relay_required: bool) -> None:
    """Flags shared by the node commands."""
    g = parser.add_argument_group("relay")
    g.add_argument(
        "--relay", required=relay_required,
        help="relay URL: moqt://HOST:PORT (QUIC) or moqt+qmux://HOST:PORT (QMux over TLS/TCP)",
    )
    g.add_argument("--ca", type=Path, help="CA certificate (PEM) the relay's certificate must chain to")
    g.add_argument("--cert", type=Path, help="client certificate (PEM) for mTLS")
    g.add_argument("--key", type=Path, help="private key of --cert")
    g.add_argument("--token", type=Path, help="authorization token file presented to the relay in SETUP")
    g.add_argument(
        "--quic-stack", choices=["qh3", "aioquic"], default=DEFAULT_STACK,
        help="QUIC implementation of the relay session (qh3 fetches faster, locates in more round trips)",
    )
    g.add_argument(
        "--relay-idle-timeout", type=float, default=5.0,
        help="seconds of silence after which the relay session counts as lost and reconnecting starts "
        "(keep-alive PINGs every third of it)",
    )
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--max-datagram-size", type=int,
        help="largest UDP payload (default: the stack's loopback size; 1452 for a 1500-byte MTU path, "
        "8952 for 9000-byte jumbo frames)",
    )
    size.add_argument(
        "--link", choices=list(LINK_PRESETS),
        help="datagram size for the path to the relay: ethernet (1452, a 1500-byte MTU), jumbo (8952, "
        "9000-byte frames) or loopback (the stack's loopback size; 1452 off-host); never above what the "
        "relay advertises",
    )
    size.add_argument("--ethernet", action="store_true", help="same as --link ethernet")
    m = parser.add_argument_group("model and cache")
    m.add_argument(
        "--model", default=DEFAULT_MODEL,
        help="trained model name (smollm2) or built-in preset of random weights (tiny, small, bench: "
        "quick to start, meaningless output)",
    )
    m.add_argument("--checkpoint", type=Path, help="local checkpoint directory instead of --model")
    m.add_argument("--seed", type=int, default=0, help="seed of the built-in weights")
    m.add_argument(
        "--dtype", choices=DTYPE_NAMES,
        help="model and KV dtype (none given: the model's own, bfloat16 for smollm2; float32 for presets)",
    )
    m.add_argument("--device", default="cpu", help="torch device")
    m.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    m.add_argument(
        "--max-running-sequences", type=int, default=DEFAULT_MAX_RUNNING_SEQUENCES,
        help="sequences batched together at most; past it (or a full KV pool) requests are refused as busy",
    )
    m.add_argument(
        "--max-step-tokens", type=int, default=DEFAULT_PREFILL_CHUNK,
        help="tokens per batched forward (decodes first, then prefill chunks)",
    )
    m.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    m.add_argument(
        "--cache-blocks", type=int,
        help="blocks in the paged KV cache (none given: what fits 512 MiB of KV, at most 2048)",
    )
    m.add_argument(
        "--node-secret", type=Path,
        help="node secret file (mode 0600) from which the tenant's hash salt and namespace id derive",
    )
    m.add_argument(
        "--tenant", default=DEFAULT_TENANT,
        help="tenant this node computes for (needs --node-secret unless it is the default)",
    )
    k = parser.add_argument_group("blocks, signing, ABR")
    k.add_argument(
        "--renditions", type=parse_renditions, default=("lossless",),
        help="publisher: renditions to publish, comma-separated (lossless,plain,int8,int4,kvtc)",
    )
    k.add_argument(
        "--kvtc-tables", type=Path,
        help="publisher: the model's kvtc tables ('kvnet kvtc calibrate'), which --renditions kvtc needs",
    )
    k.add_argument(
        "--kvtc-decode-processes", type=kvtc_decode_processes_arg, default=DEFAULT_KVTC_DECODE_PROCESSES,
        metavar="N",
        help=f"subscriber accepting kvtc: processes that entropy-decode its layers (0: on the fetch's "
             f"threads; auto: one per core, at most {MAX_AUTO_KVTC_DECODE_PROCESSES}; default auto, "
             f"{DEFAULT_KVTC_DECODE_PROCESSES} on this host)",
    )
    k.add_argument(
        "--accept", type=parse_renditions, default=("lossless",),
        help="subscriber: acceptable renditions, comma-separated (default lossless only; plain is exact too)",
    )
    k.add_argument(
        "--payload-digest", choices=DIGEST_ALGORITHMS, default=DEFAULT_DIGEST_ALGORITHM,
        help="publisher: hash of each layer payload in the signed manifests (sha256 where a FIPS-approved "
             "hash is required); subscribers verify either",
    )
    k.add_argument("--store-bytes", type=size_arg, default="512M", help="publisher block store budget")
    k.add_argument("--cache-dir", type=Path, help="also keep published blocks on disk here (default: memory)")
    k.add_argument("--cache-dir-bytes", type=size_arg, default="1G", help="most bytes kept in --cache-dir")
    k.add_argument("--signing-key", type=Path, help="Ed25519 private key (PEM) to sign manifests")
    k.add_argument(
        "--trust", type=Path, action="append", default=[],
        help="trusted publisher public key (PEM) or directory of *.pub (repeatable)",
    )
    k.add_argument(
        "--trust-any", action="store_true",
        help="accept blocks signed by any key (development only: anyone could poison the cache)",
    )
    k.add_argument("--no-push", action="store_true", help="publisher: do not PUBLISH into the relay cache")
    k.add_argument(
        "--republish-bytes", type=size_arg, default="64M",
        help="on each new relay session, push again up to this many bytes of stored blocks the relay "
        "lacks (0: off)",
    )
    k.add_argument(
        "--fetch-window", type=size_arg, default=DEFAULT_WINDOW_BYTES,
        help="raw block bytes requested ahead while fetching",
    )
    k.add_argument(
        "--fetch-verify-workers", type=verify_workers_arg, default=DEFAULT_VERIFY_WORKERS, metavar="N",
        help=f"threads that verify and decode fetched layers (0: on the event loop; auto: every core but "
             f"two, at most {MAX_AUTO_VERIFY_WORKERS}; default auto, {DEFAULT_VERIFY_WORKERS} on this host)",
    )
    k.add_argument(
        "--fetch-connections", type=fetch_connections_arg, default=DEFAULT_FETCH_CONNECTIONS, metavar="N",
        help=f"relay sessions one request's blocks are split over, each verifying its own (at most "
             f"{MAX_FETCH_CONNECTIONS}; auto: one per {CORES_PER_FETCH_CONNECTION} cores, at most "
             f"{MAX_AUTO_FETCH_CONNECTIONS}; default auto, {DEFAULT_FETCH_CONNECTIONS} on this host)",
    )
    k.add_argument("--timeout", type=float, default=10.0, help="seconds per locate/fetch before recompute")
    k.add_argument(
        "--fetch-margin", type=float, default=1.0,
        help="seconds a fetch may cost beyond recomputing what it delivered before it is abandoned",
    )
    k.add_argument("--abr", default="auto", choices=["auto", "fetch", "recompute"], help="fetch policy")
    k.add_argument(
        "--no-overlap", action="store_true",
        help="--abr auto never computes the head of a located prefix while fetching its tail",
    )
    k.add_argument("--assume-throughput", type=float, default=100e6, help="ABR prior in bytes/s")
    k.add_argument(
        "--key-dir", type=Path,
        help="publisher keys directory: signs with KEY_DIR/publisher.key (created if missing) and, without "
        "--trust, trusts KEY_DIR/*.pub",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    add_log_arguments(parser)


def node_config_from_args(args: argparse.Namespace) -> NodeConfig:
    return NodeConfig(
        relay_url=args.relay,
        ca_file=args.ca,
        cert_file=args.cert,
        key_file=args.key,
        token_file=args.token,
        model=args.model,
        checkpoint=args.checkpoint,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        node_secret=args.node_secret,
        publish_renditions=tuple(args.renditions),
        acceptable_renditions=tuple(args.accept),
        payload_digest=args.payload_digest,
        kvtc_tables=args.kvtc_tables,
        kvtc_decode_processes=args.kvtc_decode_processes,
        store_bytes=args.store_bytes,
        cache_dir=args.cache_dir,
        cache_dir_bytes=args.cache_dir_bytes,
        signing_key=args.signing_key,
        trust=tuple(args.trust),
        trust_any=args.trust_any,
        push=not args.no_push,
        republish_bytes=args.republish_bytes,
        fetch_window_bytes=args.fetch_window,
        fetch_verify_workers=args.fetch_verify_workers,
        fetch_connections=args.fetch_connections,
        request_timeout=args.timeout,
        fetch_margin=args.fetch_margin,
        prior_throughput_bps=args.assume_throughput,
        abr_mode=args.abr,
        abr_overlap=not args.no_overlap,
        max_new_tokens=args.max_tokens,
        tenant=args.tenant,
        torch_threads=args.threads,
        max_running_sequences=args.max_running_sequences,
        max_step_tokens=args.max_step_tokens,
        quic_stack=args.quic_stack,
        relay_idle_timeout=args.relay_idle_timeout,
        max_datagram_size=_datagram_size(args),
    )


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prompt`` / ``--prompt-file`` of the one-shot commands."""
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-file", type=Path, action="append", default=[], help="prompt from a file")


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    """The prompts given with ``add_prompt_arguments``, texts first, then files in order."""
    prompts = list(args.prompt)
    for path in args.prompt_file:
        try:
            prompts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ValueError(f"--prompt-file {path}: {reason}") from None
    return prompts


def node_config_from_cli(
    args: argparse.Namespace, kvnet_home: str | None, models_dir: Path | None = None
) -> NodeConfig:
    """``node_config_from_args`` with keys resolved from ``--key-dir`` or ``$KVNET_HOME/keys`` and named
    models kept in `models_dir` (the caller's ``main`` reads the environment: ``default_models_dir``).
    Raises ValueError or OSError with a message for the user."""
    config = dataclasses.replace(node_config_from_args(args), models_dir=models_dir)
    return resolve_keys(config, args.key_dir or default_key_dir(kvnet_home))


def resolve_keys(config: NodeConfig, key_dir: Path | None) -> NodeConfig:
    """Check the node's secret files and fill in the default signing key and trust store from ``key_dir``
    (created on first use). Raises ``ValueError``/``OSError`` naming an unusable file.

    So that two shells on one machine reproduce a remote hit with no key flags: the publisher signs with
    ``key_dir/publisher.key`` and the subscriber trusts every ``key_dir/*.pub``.
    """
    check_startup_inputs(config)
    if config.node_secret is not None:
        try:  # refuse an unsafe or malformed secret file before anything starts
            NodeSecret.load(config.node_secret)
        except TenancyError as exc:
            raise ValueError(str(exc)) from None
    if config.token_file is not None:
        try:
            read_token_file(config.token_file)
        except OSError as exc:
            raise ValueError(f"--token {config.token_file}: {exc.strerror or exc}") from None
    if key_dir is None:
        return config
    signing_key = config.signing_key
    if signing_key is None:
        signing_key = key_dir / "publisher.key"
        if not signing_key.exists():
            try:
                generate_keypair(key_dir, "publisher")
                logger.info("created publisher signing key %s", signing_key)
            except SigningError:
                # Another process sharing this key directory created it first (the key file is put in
                # place in one step, so it is whole): use theirs.
                if not signing_key.exists():
                    raise
    trust = config.trust or (key_dir,)
    return dataclasses.replace(config, signing_key=signing_key, trust=trust)


def check_startup_inputs(config: NodeConfig) -> None:
    """Refuse, before anything starts, what would only fail later: a bad relay URL, unreadable or non-PEM
    TLS files, an unknown preset or device, a missing checkpoint, unreadable keys. ``ValueError`` naming
    the flag, the file and the reason. Imports no torch unless ``--device`` names something but ``cpu``."""
    if config.relay_url is not None:
        parse_moqt_url(config.relay_url)
    check_tls_files(config.ca_file, config.cert_file, config.key_file)
    if config.checkpoint is not None:
        if not config.checkpoint.is_dir():
            raise ValueError(f"--checkpoint {config.checkpoint}: not a directory")
    elif config.model not in PRESET_NAMES and not is_registered(config.model):
        known = ", ".join(sorted([*PRESET_NAMES, *MODELS]))
        raise ValueError(f"--model {config.model!r}: unknown preset; known: {known}")
    try:
        if config.signing_key is not None:
            load_signer(config.signing_key)
        TrustStore.from_paths(config.trust)
    except SigningError as exc:
        raise ValueError(str(exc)) from None
    if config.device != "cpu":
        # Only torch knows its device names; every check above ran without importing it (seconds).
        import torch

        try:
            torch.device(config.device)
        except RuntimeError:
            raise ValueError(
                f"--device {config.device!r}: not a torch device (cpu, cuda, cuda:1, ...)"
            ) from None


def load_signer_and_trust(config: NodeConfig) -> tuple[Signer | None, TrustStore]:
    """The configured signing key (None: none configured) and the trust store of accepted publisher keys,
    which always includes our own key. Raises ``SigningError`` naming an unreadable key file."""
    signer = load_signer(config.signing_key) if config.signing_key is not None else None
    trust = TrustStore.from_paths(config.trust)
    if signer is not None:
        trust.add(signer.public_key)  # a node always trusts what it signed itself
    if config.trust_any:
        logger.warning("--trust-any: accepting blocks signed by ANY key; the cache can be poisoned")
    elif not trust:
        logger.warning("no trusted publisher keys: every fetched block will be rejected (give --trust)")
    return signer, trust


def tenant_salt_and_namespace(tenant: str, node_secret: NodeSecret | None) -> tuple[bytes, str]:
    """The chain-root salt and the namespace-id field of ``tenant`` (``NodeConfig.node_secret``)."""
    if node_secret is not None:
        return node_secret.tenant_salt(tenant), node_secret.namespace_id(tenant)
    if tenant != DEFAULT_TENANT:
        raise ValueError("a tenant other than the default needs a node secret")
    return b"", tenant


# What TLS libraries say when a peer's certificate does not verify (OpenSSL through aioquic, qh3's rustls).
_CERTIFICATE_FAILURES = ("certificate", "unknownissuer", "unknown issuer", "badsignature")
_NO_ANSWER = ("idle timeout", "timed out", "connection refused")


def explain_relay_problem(config: NodeConfig, problem: str) -> str:
    """``problem`` (``Node.relay_problem``: the relay URL and why the last attempt failed) with what to do
    about it: a certificate that does not verify names ``--ca`` and its file, one that does not name the
    host dialled says how to issue one that does, silence names the UDP address that was tried and how long
    it was given. Anything else is returned as it is."""
    url = config.relay_url or "(none)"
    lowered = problem.lower()
    if "doesn't match" in lowered or "hostname mismatch" in lowered or "notvalidforname" in lowered:
        cause = problem.rpartition("failed: ")[2] or problem
        try:
            host = parse_moqt_url(url).host
        except ValueError:
            host = url
        return (
            f"relay {url}: its TLS certificate does not name {host} ({cause}); dial a name it lists "
            f"('kvnet certs show' prints them) or issue it with 'kvnet certs issue ... --host {host}'"
        )
    if any(marker in lowered for marker in _CERTIFICATE_FAILURES):
        cause = problem.rpartition(": ")[2] or problem
        return (
            f"relay {url}: its TLS certificate does not verify against --ca {config.ca_file} ({cause}); "
            "pass --ca the CA certificate that issued the relay's (ca.pem of the relay's 'kvnet certs' "
            "directory) and dial a host name the certificate was issued for"
        )
    if any(marker in lowered for marker in _NO_ANSWER):
        try:
            target = parse_moqt_url(url)
            where = f"UDP {target.host}:{target.port}"
        except ValueError:
            where = url
        return (
            f"relay {url} unreachable: a QUIC handshake to {where} got no answer within "
            f"{config.relay_idle_timeout:g} s (--relay-idle-timeout); check that kvnet-relay listens "
            "there (its --listen)"
        )
    return problem


def default_key_dir(kvnet_home: str | None) -> Path:
    """``$KVNET_HOME/keys`` or ``~/.kvnet/keys`` (the caller reads the environment)."""
    base = Path(kvnet_home) if kvnet_home else Path.home() / ".kvnet"
    return base / "keys"

