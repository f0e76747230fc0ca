"""A kvnet inference node: model + paged KV cache + block publishing + prefix fetching.

Owns: ``NodeConfig`` and the command-line flags every node command shares (``add_node_arguments``), and
``Node``, used by all three processes (``kvnet-publisher``, ``kvnet-subscriber``, ``kvnet-node``):

* ``Node.publish_prompt`` — prefill a prompt into the paged cache, encode and sign its full blocks in the
  configured renditions, keep them in the bounded ``BlockStore`` and (optionally) PUBLISH them into the
  relay's cache; the ``BlockServer`` keeps answering for them while the node runs.
* ``Node.complete`` — hash the prompt, take local cache hits first, locate the longest remote prefix
  (bounded fan-out search: two round trips up to 4096 blocks), let the KV ABR pick per block a rendition
  or recompute, fetch + verify + load the chosen blocks layer by layer, prefill only the remainder and
  generate. Returns a ``RequestReport``.

Model work runs in a worker thread (torch releases the GIL) so the event loop keeps serving the relay
while a prompt is computed; one asyncio lock serialises every touch of the paged cache.
Nothing here reads the command line or the environment: ``main()`` functions build a ``NodeConfig``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvnet.blocks.signing import Signer, TrustStore, generate_keypair, load_signer
from kvnet.cache.hashing import block_hashes, root_hash
from kvnet.cache.paged_cache import PagedKVCache
from kvnet.model.generate import cache_spec_for, generate
from kvnet.model.tokenizer import ByteTokenizer, Tokenizer
from kvnet.model.transformer import Transformer
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect, freeze_startup_objects
from kvnet.net.errors import MoqtConnectionError, RequestRejected
from kvnet.net.quic import (
    DATAGRAM_SIZE_ETHERNET,
    DEFAULT_STACK,
    TlsSettings,
    TransportSettings,
    parse_moqt_url,
)
from kvnet.node.abr import QUALITY_ORDER, AbrConfig, AbrPlan, KvAbr
from kvnet.node.blockstore import BlockStore, StoredBlock
from kvnet.node.fetching import (
    DEFAULT_WINDOW_BYTES,
    BlockFetcher,
    BlockSink,
    ExpectedBlock,
    FetchOutcome,
    Located,
    expected_blocks,
)
from kvnet.node.publishing import BlockServer, BlockSource, dtype_name, encode_blocks
from kvnet.security.tenancy import NodeSecret, TenancyError
from kvnet.security.tokens import DEFAULT_MAX_TOKEN_SIZE, KVNET_TOKEN_TYPE
from proto.errors import UsageError
from proto.messages import AliasType, AuthToken
from proto.session import SessionConfig

logger = logging.getLogger(__name__)

KNOWN_RENDITIONS = QUALITY_ORDER
# Chosen by measurement (docs/nodes.md, "Block size"): 64-token blocks fetched a 2k-token prefix of the
# bench preset 1.5x faster than 16-token blocks (fewer, larger objects and requests; better compression),
# at the cost of recomputing up to 63 shared tokens past the last full block.
DEFAULT_BLOCK_SIZE = 64
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node needs: model, cache, relay, signing/trust and ABR knobs."""

    relay_url: str | None = None
    """``moqt://HOST:PORT`` of the relay; None runs the node without a network (local cache only)."""
    ca_file: Path | None = None
    """CA certificate that the relay's certificate must chain to."""
    cert_file: Path | None = None
    """Our client certificate (mTLS), optional."""
    key_file: Path | None = None
    """Private key of ``cert_file``."""
    token_file: Path | None = None
    """File holding the authorization token (``kvnet token issue``) presented in SETUP's AUTHORIZATION TOKEN
    option; read at every connect, so a renewed token is picked up by the next session."""
    model: str = "small"
    """Built-in model preset (``tiny``, ``small``, ``bench``). ``small`` by default: on ``tiny`` a CPU
    prefills faster than any network fetch, so the ABR would (rightly) never reuse a remote prefix."""
    checkpoint: Path | None = None
    """A local Llama-layout checkpoint directory used instead of the preset."""
    seed: int = 0
    """Seed of the built-in deterministic weights (part of the fingerprint through the weights digest)."""
    dtype: str = "float32"
    """Model and KV dtype."""
    device: str = "cpu"
    """torch device."""
    block_size: int = DEFAULT_BLOCK_SIZE
    """Tokens per KV block (part of the fingerprint)."""
    cache_blocks: int = 2048
    """Physical blocks in the paged KV cache."""
    node_secret: Path | None = None
    """Operator's node secret file (``kvnet.security.tenancy``, mode 0600). With it the chain root is salted
    with ``derive_tenant_salt(secret, tenant)`` and the namespace carries
    ``tenant_namespace_id(secret, tenant)``; without it the salt is empty and the namespace carries the
    tenant id as given (single tenant only)."""
    publish_renditions: tuple[str, ...] = ("lossless",)
    """Renditions a publisher encodes and serves for every block."""
    acceptable_renditions: tuple[str, ...] = ("lossless",)
    """Renditions a subscriber accepts (quality floor); lossless only by default."""
    store_bytes: int = 512 << 20
    """Byte budget of the publisher-side block store."""
    signing_key: Path | None = None
    """Ed25519 private key used to sign manifests; None generates an ephemeral key."""
    trust: tuple[Path, ...] = ()
    """Public key files (or directories of ``*.pub``) whose signatures a subscriber accepts."""
    trust_any: bool = False
    """Accept any correctly signed manifest whatever its key (development only; logged loudly)."""
    push: bool = True
    """Publisher: also PUBLISH blocks into the relay's cache (survives the publisher leaving)."""
    fetch_window_bytes: int = DEFAULT_WINDOW_BYTES
    """Raw block bytes requested ahead during a fetch (``kvnet.node.fetching``: a few MB keeps loopback and
    LAN links busy without interleaving every block's delivery)."""
    request_timeout: float = 10.0
    """Seconds to wait for one locate or fetch before giving up (and recomputing)."""
    prior_throughput_bps: float = 100e6
    """ABR throughput prior (bytes/s) before anything was measured."""
    abr_mode: str = "auto"
    """``auto`` (fetch or recompute by estimate), ``fetch`` (always fetch located blocks), ``recompute``."""
    max_new_tokens: int = 16
    """Default generation length."""
    tenant: str = DEFAULT_TENANT
    """Tenant this node computes for (set by the operator; never taken from a client)."""
    quic_stack: str = DEFAULT_STACK
    """QUIC implementation of the relay session (this node is its client). qh3 fetches ~30% faster on
    loopback but locates in 1-2 more round trips through an aioquic relay, so aioquic is the default
    (docs/performance.md, "Node fetch path")."""
    max_datagram_size: int | None = None
    """Largest UDP payload of the relay session; None takes the stack's loopback size. Give 1452
    (``--ethernet``) on a 1500-byte path and 8952 on jumbo frames."""
    torch_threads: int = 1
    """Intra-op threads of torch. One by default: a node shares its cores with the relay and its own event
    loop, and OpenMP workers spin-waiting on a contended 2-core machine made a 5 ms prefill take 300 ms."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.cache_blocks <= 0:
            raise ValueError(f"cache_blocks must be positive, got {self.cache_blocks}")
        for name in ("publish_renditions", "acceptable_renditions"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name}: at least one rendition is required")
            unknown = [r for r in values if r not in KNOWN_RENDITIONS]
            if unknown:
                raise ValueError(f"{name}: unknown rendition(s) {unknown}; known: {list(KNOWN_RENDITIONS)}")
        if self.store_bytes <= 0:
            raise ValueError(f"store_bytes must be positive, got {self.store_bytes}")
        if self.fetch_window_bytes <= 0:
            raise ValueError(f"fetch_window_bytes must be positive, got {self.fetch_window_bytes}")
        if self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout}")
        if self.abr_mode not in ("auto", "fetch", "recompute"):
            raise ValueError(f"abr_mode must be auto, fetch or recompute, got {self.abr_mode!r}")
        if self.torch_threads <= 0:
            raise ValueError(f"torch_threads must be positive, got {self.torch_threads}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        self.transport_settings  # noqa: B018 (validates stack and datagram size, naming the field)
        if self.tenant != DEFAULT_TENANT and self.node_secret is None:
            # Different tenants must never share a chain root: that takes a salt, hence a node secret.
            raise ValueError("tenant: a tenant other than the default needs --node-secret (salted hashes)")
        if self.relay_url is not None and self.ca_file is None:
            raise ValueError("ca_file: a relay connection needs --ca to verify the relay (TLS is always on)")


    @property
    def transport_settings(self) -> TransportSettings:
        """QUIC settings of the relay session (``TransportSettings.for_ethernet`` on 1500-byte paths)."""
        if self.max_datagram_size == DATAGRAM_SIZE_ETHERNET:
            return TransportSettings.for_ethernet(self.quic_stack)
        return TransportSettings(max_datagram_size=self.max_datagram_size, stack=self.quic_stack)


def _renditions(text: str) -> tuple[str, ...]:
    return tuple(r.strip() for r in text.split(",") if r.strip())


def _size(text: str) -> int:
    """``512M``, ``2G``, ``1000000`` -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_node_arguments(parser: argparse.ArgumentParser, *, relay_required: bool) -> None:
    """Flags shared by the node commands."""
    g = parser.add_argument_group("relay")
    g.add_argument("--relay", required=relay_required, help="relay URL, moqt://HOST:PORT")
    g.add_argument("--ca", type=Path, help="CA certificate (PEM) the relay's certificate must chain to")
    g.add_argument("--cert", type=Path, help="client certificate (PEM) for mTLS")
    g.add_argument("--key", type=Path, help="private key of --cert")
    g.add_argument("--token", type=Path, help="authorization token file presented to the relay in SETUP")
    g.add_argument(
        "--quic-stack", choices=["qh3", "aioquic"], default=DEFAULT_STACK,
        help=f"QUIC implementation of the relay session (default {DEFAULT_STACK}; qh3 fetches faster, "
        "locates in more round trips)",
    )
    size = g.add_mutually_exclusive_group()
    size.add_argument(
        "--max-datagram-size", type=int,
        help="largest UDP payload (default: the stack's loopback size; 1452 for a 1500-byte MTU path, "
        "8952 for 9000-byte jumbo frames)",
    )
    size.add_argument(
        "--ethernet", action="store_true",
        help="size datagrams for a 1500-byte Ethernet path (same as --max-datagram-size 1452)",
    )
    m = parser.add_argument_group("model and cache")
    m.add_argument(
        "--model", default="small", help="built-in model preset: tiny, small, bench (default small)"
    )
    m.add_argument("--checkpoint", type=Path, help="local checkpoint directory instead of the preset")
    m.add_argument("--seed", type=int, default=0, help="seed of the built-in weights")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--device", default="cpu")
    m.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    m.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    m.add_argument("--cache-blocks", type=int, default=2048, help="blocks in the paged KV cache")
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
        "--renditions", type=_renditions, default=("lossless",),
        help="publisher: renditions to publish, comma-separated (lossless,int8,int4)",
    )
    k.add_argument(
        "--accept", type=_renditions, default=("lossless",),
        help="subscriber: acceptable renditions, comma-separated (default lossless only)",
    )
    k.add_argument("--store-bytes", type=_size, default=512 << 20, help="publisher block store budget")
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
        "--fetch-window", type=_size, default=DEFAULT_WINDOW_BYTES,
        help="raw block bytes requested ahead while fetching (default 4M)",
    )
    k.add_argument("--timeout", type=float, default=10.0, help="seconds per locate/fetch before recompute")
    k.add_argument("--abr", default="auto", choices=["auto", "fetch", "recompute"], help="fetch policy")
    k.add_argument("--assume-throughput", type=float, default=100e6, help="ABR prior in bytes/s")
    k.add_argument(
        "--key-dir", type=Path,
        help="publisher keys directory: signs with KEY_DIR/publisher.key (created if missing) and, without "
        "--trust, trusts KEY_DIR/*.pub",
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


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
        store_bytes=args.store_bytes,
        signing_key=args.signing_key,
        trust=tuple(args.trust),
        trust_any=args.trust_any,
        push=not args.no_push,
        fetch_window_bytes=args.fetch_window,
        request_timeout=args.timeout,
        prior_throughput_bps=args.assume_throughput,
        abr_mode=args.abr,
        max_new_tokens=args.max_tokens,
        tenant=args.tenant,
        torch_threads=args.threads,
        quic_stack=args.quic_stack,
        max_datagram_size=DATAGRAM_SIZE_ETHERNET if args.ethernet else args.max_datagram_size,
    )


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prompt`` / ``--prompt-file`` of the one-shot commands."""
    parser.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    parser.add_argument("--prompt-file", type=Path, action="append", default=[], help="prompt from a file")


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    """The prompts given with ``add_prompt_arguments``, texts first, then files in order."""
    return list(args.prompt) + [f.read_text(encoding="utf-8") for f in args.prompt_file]


def node_config_from_cli(args: argparse.Namespace, kvnet_home: str | None) -> NodeConfig:
    """``node_config_from_args`` with keys resolved from ``--key-dir`` or ``$KVNET_HOME/keys`` (the caller's
    ``main`` reads the environment). Raises ValueError or OSError with a message for the user."""
    return resolve_keys(node_config_from_args(args), args.key_dir or default_key_dir(kvnet_home))


def resolve_keys(config: NodeConfig, key_dir: Path | None) -> NodeConfig:
    """Check the node's secret files and fill in the default signing key and trust store from ``key_dir``
    (created on first use). Raises ``ValueError``/``OSError`` naming an unusable file.

    So that two shells on one machine reproduce a remote hit with no key flags: the publisher signs with
    ``key_dir/publisher.key`` and the subscriber trusts every ``key_dir/*.pub``.
    """
    if config.node_secret is not None:
        try:  # refuse an unsafe or malformed secret file before anything starts
            NodeSecret.load(config.node_secret)
        except TenancyError as exc:
            raise ValueError(str(exc)) from None
    if config.token_file is not None:
        read_token(config.token_file)
    if key_dir is None:
        return config
    signing_key = config.signing_key
    if signing_key is None:
        signing_key = key_dir / "publisher.key"
        if not signing_key.exists():
            generate_keypair(key_dir, "publisher")
            logger.info("created publisher signing key %s", signing_key)
    trust = config.trust or (key_dir,)
    return dataclasses.replace(config, signing_key=signing_key, trust=trust)


def read_token(path: Path) -> bytes:
    """The authorization token in ``path`` (as ``kvnet token issue`` writes it); ValueError if unusable."""
    with path.open("rb") as f:
        value = f.read(DEFAULT_MAX_TOKEN_SIZE + 1)
    if not value or len(value) > DEFAULT_MAX_TOKEN_SIZE:
        raise ValueError(f"{path}: a token has 1..{DEFAULT_MAX_TOKEN_SIZE} bytes")
    return value


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model(config: NodeConfig) -> Transformer:
    """The built-in preset (deterministic weights) or a local checkpoint directory."""
    device = torch.device(config.device)
    dtype = _DTYPES[config.dtype]
    if config.checkpoint is not None:
        from kvnet.model.checkpoint import load_checkpoint

        return load_checkpoint(config.checkpoint, device=device, dtype=dtype)
    return Transformer.from_name(config.model, device=device, dtype=dtype, seed=config.seed)


@dataclass
class Timings:
    """Seconds spent in each phase of one request."""

    hash_s: float = 0.0
    locate_s: float = 0.0
    fetch_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0

    def to_json(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self.__dict__.items()}


@dataclass
class RequestReport:
    """Everything one completion did; ``to_json`` is the subscriber's ``--json`` output."""

    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    located_blocks: int = 0
    bytes_fetched: int = 0
    renditions: dict[str, int] = field(default_factory=dict)
    timings: Timings = field(default_factory=Timings)
    output_token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    finish_reason: str = "length"
    abr: dict[str, Any] = field(default_factory=dict)
    locate: dict[str, int] = field(default_factory=dict)
    """What the locate searched and cost: ``blocks, located, probes, rounds, fan_out``."""
    fallback: list[str] = field(default_factory=list)
    security_events: list[dict[str, str]] = field(default_factory=list)
    """Blocks refused by verification: ``{"kind": "signature" | "content", "detail": ...}``."""
    published_blocks: int = 0
    verified: bool | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "local_hit_tokens": self.local_hit_tokens,
            "remote_hit_tokens": self.remote_hit_tokens,
            "computed_tokens": self.computed_tokens,
            "located_blocks": self.located_blocks,
            "bytes_fetched": self.bytes_fetched,
            "renditions": dict(self.renditions),
            "timings": self.timings.to_json(),
            "output_token_ids": list(self.output_token_ids),
            "output_text": self.output_text,
            "finish_reason": self.finish_reason,
            "abr": self.abr,
            "locate": dict(self.locate),
            "fallback": list(self.fallback),
            "security_events": [dict(e) for e in self.security_events],
            "published_blocks": self.published_blocks,
        }
        if self.verified is not None:
            out["verified"] = self.verified
        return out


@dataclass
class PublishReport:
    """What ``publish_prompt`` did."""

    prompt_tokens: int
    computed_tokens: int
    blocks: int
    objects_bytes: int
    pushed: int
    prefill_s: float
    encode_s: float
    push_s: float

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


@dataclass
class NodeCounters:
    """Monotonic counters exported on /metrics."""

    requests: int = 0
    prompt_tokens: int = 0
    local_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    computed_tokens: int = 0
    bytes_fetched: int = 0
    blocks_rejected: int = 0
    security_signature_failures: int = 0
    """Blocks refused because they were unsigned or not signed by a trusted key."""
    security_content_failures: int = 0
    """Signed blocks whose manifest or payload disagreed with our prompt (poisoning or corruption)."""
    fetch_fallbacks: int = 0
    published_blocks: int = 0


class Node:
    """Model, paged cache, block store, ABR and (when connected) the relay session of one process."""

    def __init__(
        self,
        config: NodeConfig,
        model: Transformer,
        *,
        tokenizer: Tokenizer | None = None,
        signer: Signer | None = None,
        trust: TrustStore | None = None,
        node_secret: NodeSecret | None = None,
    ) -> None:
        """``node_secret`` derives the tenant's salt and namespace id (``NodeConfig.node_secret``)."""
        self.config = config
        self.model = model.eval()
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self.device = torch.device(config.device)
        spec = cache_spec_for(model, config.block_size)
        self.cache = PagedKVCache(spec, config.cache_blocks, self.device)
        # The fingerprint hashes every weight: once per process.
        self.fingerprint = model.fingerprint(config.block_size)
        if node_secret is not None:
            salt = node_secret.tenant_salt(config.tenant)
            self.tenant_namespace = node_secret.namespace_id(config.tenant)
        elif config.tenant != DEFAULT_TENANT:
            raise ValueError("a tenant other than the default needs a node secret")
        else:
            salt, self.tenant_namespace = b"", config.tenant
        self.root = root_hash(self.fingerprint, salt)
        self.store = BlockStore(config.store_bytes)
        self.signer = signer or Signer.generate()
        # Never "accept anything": without a trust store a node trusts only its own key, and accepting
        # other keys takes the explicit config.trust_any (logged loudly by the fetcher).
        self.trust = trust if trust is not None else TrustStore()
        if trust is None:
            self.trust.add(self.signer.public_key)
        acceptable = tuple(r for r in QUALITY_ORDER if r in config.acceptable_renditions)
        self.abr = KvAbr(
            AbrConfig(
                acceptable=acceptable,
                prior_throughput_bps=config.prior_throughput_bps,
                allow_recompute=config.abr_mode != "fetch",
                force_recompute=config.abr_mode == "recompute",
            )
        )
        self.counters = NodeCounters()
        self.lock = asyncio.Lock()
        self.peer: RelayPeer | None = None
        self._next_seq = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dtype_name = dtype_name(spec.dtype)

    @classmethod
    def from_config(cls, config: NodeConfig) -> Node:
        model = build_model(config)
        signer = load_signer(config.signing_key) if config.signing_key is not None else None
        trust = TrustStore.from_paths(config.trust)
        if signer is not None:
            trust.add(signer.public_key)  # a node always trusts what it signed itself
        if config.trust_any:
            logger.warning("--trust-any: accepting blocks signed by ANY key; the cache can be poisoned")
        elif not trust:
            logger.warning("no trusted publisher keys: every fetched block will be rejected (give --trust)")
        secret = NodeSecret.load(config.node_secret) if config.node_secret is not None else None
        return cls(config, model, signer=signer, trust=trust, node_secret=secret)

    # -- helpers ----------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def model_name(self) -> str:
        return self.config.model if self.config.checkpoint is None else self.config.checkpoint.name

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _seq_id(self) -> int:
        self._next_seq += 1
        return self._next_seq

    def calibrate(self, tokens: int = 64) -> float:
        """Warm the kernels and measure local prefill speed for the ABR; returns seconds per token."""
        ids = [(i * 7919) % 256 for i in range(max(tokens, 2))]
        warm = False
        # The first run pays one-off kernel set-up: run it, then measure two sizes (slope + overhead).
        for n in (len(ids), len(ids) // 2, len(ids)):
            cache = PagedKVCache(self.cache.spec, -(-n // self.block_size) + 1, self.device)
            started = time.perf_counter()
            generate(self.model, cache, ids[:n], 0, root=self.root, commit_prompt=False)
            elapsed = time.perf_counter() - started
            if warm:
                self.abr.prefill.add(n, elapsed)
            warm = True
        return self.abr.prefill.per_token_s

    def _block_sources(self, ids: list[int], hashes: list[bytes], start: int, stop: int) -> list[BlockSource]:
        b = self.block_size
        return [
            BlockSource(
                block_hash=hashes[i],
                parent_hash=self.root if i == 0 else hashes[i - 1],
                token_ids=tuple(ids[i * b : (i + 1) * b]),
                block_index=i,
            )
            for i in range(start, stop)
        ]

    async def _encode_and_store(self, ids: list[int], hashes: list[bytes]) -> tuple[list[Any], float]:
        """Encode and store the blocks of ``hashes`` that the store does not hold yet (lock held)."""
        started = time.perf_counter()
        first = self.config.publish_renditions[0]
        all_sources = self._block_sources(ids, hashes, 0, len(hashes))
        sources = [s for s in all_sources if self.store.peek(s.block_hash, first) is None]
        if not sources:
            # Still refresh the chain so a hot prefix stays in the store.
            self.store.touch_chain([(h, first) for h in hashes])
            return [], time.perf_counter() - started
        blocks = await asyncio.to_thread(
            encode_blocks,
            self.cache,
            sources,
            fingerprint=self.fingerprint,
            renditions=self.config.publish_renditions,
            signer=self.signer,
        )
        self.store.put_chain(blocks)
        self.counters.published_blocks += len(sources)
        return blocks, time.perf_counter() - started

    # -- roles ------------------------------------------------------------------------------------

    async def publish_prompt(self, text: str) -> PublishReport:
        """Prefill ``text``, then encode, sign, store and (if connected and enabled) push its full blocks."""
        ids = self.encode_prompt(text)
        async with self.lock:
            started = time.perf_counter()
            result = await asyncio.to_thread(
                generate, self.model, self.cache, ids, 0, root=self.root, seq_id=self._seq_id()
            )
            prefill_s = time.perf_counter() - started
            hashes = list(result.block_hashes)
            blocks, encode_s = await self._encode_and_store(ids, hashes)
        push_s, pushed = 0.0, 0
        if self.peer is not None and self.config.push:
            t = time.perf_counter()
            pushed = await self.peer.push(blocks)
            push_s = time.perf_counter() - t
        return PublishReport(
            prompt_tokens=len(ids),
            computed_tokens=result.computed_tokens,
            blocks=len(hashes),
            objects_bytes=sum(b.nbytes for b in blocks),
            pushed=pushed,
            prefill_s=prefill_s,
            encode_s=encode_s,
            push_s=push_s,
        )

    async def complete(
        self,
        text: str,
        max_tokens: int | None = None,
        *,
        publish: bool = False,
        verify: bool = False,
        use_remote: bool = True,
    ) -> RequestReport:
        """Answer one prompt reusing every prefix block it can find; see the module docstring."""
        max_new = self.config.max_new_tokens if max_tokens is None else max_tokens
        report = RequestReport()
        t0 = time.perf_counter()
        ids = self.encode_prompt(text)
        report.prompt_tokens = len(ids)
        b = self.block_size
        hashes = block_hashes(ids, b, self.root)
        usable = max(len(ids) - 1, 0) // b  # the last prompt token is always computed (its logits)
        report.timings.hash_s = time.perf_counter() - t0
        async with self.lock:
            local_blocks = self.cache.match_prefix(hashes[:usable])
            report.local_hit_tokens = local_blocks * b
            # A node told to always recompute has no use for a locate round trip.
            remote = use_remote and self.config.abr_mode != "recompute"
            if remote and self.peer is not None and local_blocks < usable:
                await self._remote_prefix(ids, hashes, local_blocks, usable, report)
            gen_started = time.perf_counter()
            result = await asyncio.to_thread(
                generate,
                self.model,
                self.cache,
                ids,
                max_new,
                root=self.root,
                seq_id=self._seq_id(),
                stop_token_ids=(self.tokenizer.eos_id,),
                commit_prompt=True,
            )
            gen_done = time.perf_counter()
            if result.computed_tokens > 0:
                self.abr.prefill.add(result.computed_tokens, result.prefill_seconds)
            # What the cache actually reused is the truth (a block evicted meanwhile is recomputed).
            hit_tokens = result.cached_tokens
            report.remote_hit_tokens = max(hit_tokens - report.local_hit_tokens, 0)
            if hit_tokens < report.local_hit_tokens:
                report.local_hit_tokens = hit_tokens
            report.computed_tokens = result.computed_tokens
            report.timings.prefill_s = result.prefill_seconds
            report.timings.decode_s = result.decode_seconds
            report.timings.ttft_s = (gen_started - t0) + result.prefill_seconds
            report.output_token_ids = list(result.token_ids)
            report.output_text = self.tokenizer.decode(result.token_ids)
            if result.token_ids and result.token_ids[-1] == self.tokenizer.eos_id:
                report.finish_reason = "stop"
            if publish:
                blocks, _ = await self._encode_and_store(ids, list(result.block_hashes))
                report.published_blocks = len({x.block_hash for x in blocks})
                if blocks and self.peer is not None and self.config.push:
                    # Pushing is an optimisation: it must not delay this request's answer.
                    self._background(self.peer.push(blocks))
        report.timings.total_s = gen_done - t0
        if verify:
            output = report.output_token_ids
            report.verified = await asyncio.to_thread(self.verify_output, ids, max_new, output)
        c = self.counters
        c.requests += 1
        c.prompt_tokens += report.prompt_tokens
        c.local_hit_tokens += report.local_hit_tokens
        c.remote_hit_tokens += report.remote_hit_tokens
        c.computed_tokens += report.computed_tokens
        c.bytes_fetched += report.bytes_fetched
        return report

    def verify_output(self, ids: list[int], max_new: int, output: list[int]) -> bool:
        """True when ``output`` equals a full local recompute in a fresh cache (no reuse at all)."""
        fresh = PagedKVCache(self.cache.spec, -(-(len(ids) + max_new) // self.block_size) + 1, self.device)
        reference = generate(
            self.model, fresh, ids, max_new, root=self.root, stop_token_ids=(self.tokenizer.eos_id,),
            commit_prompt=False,
        )
        return reference.token_ids == output

    async def _remote_prefix(
        self, ids: list[int], hashes: list[bytes], start: int, usable: int, report: RequestReport
    ) -> None:
        """Locate, plan and fetch blocks ``start..usable-1`` into the cache (lock held by the caller)."""
        peer = self.peer
        assert peer is not None
        renditions = list(self.abr.config.acceptable)
        t = time.perf_counter()
        try:
            found = await peer.locate(hashes[start:usable], renditions)
        except Exception as exc:  # the relay is gone or misbehaved: recompute, never fail the request
            logger.warning("locate failed (%r); recomputing the whole prompt", exc)
            report.fallback.append(f"locate failed: {exc!r}")
            report.timings.locate_s = time.perf_counter() - t
            return
        report.timings.locate_s = time.perf_counter() - t
        located = found.available
        report.located_blocks = len(located)
        report.locate = found.to_json()
        if not located:
            return
        plan: AbrPlan = self.abr.plan(
            located, self.block_size, self.cache.spec.bytes_per_block, len(ids) - start * self.block_size
        )
        report.abr = plan.to_json()
        if plan.fetch_blocks == 0:
            return
        expected = expected_blocks(ids, self.block_size, hashes, self.root, start, start + plan.fetch_blocks)
        chosen = [plan.rendition_of(i) for i in range(plan.fetch_blocks)]
        logger.info(
            "located %d of %d missing blocks; fetching %d (%s)", len(located), usable - start,
            plan.fetch_blocks, ",".join(sorted(set(chosen))),
        )
        t = time.perf_counter()
        outcome = await peer.fetch(expected, chosen, self)
        report.timings.fetch_s = time.perf_counter() - t
        report.timings.load_s = outcome.load_s
        report.bytes_fetched = outcome.bytes
        report.renditions = dict(outcome.renditions)
        if outcome.error is not None:
            self.counters.fetch_fallbacks += 1
            if outcome.rejected:
                kind = outcome.rejected_kind or "content"
                self.counters.blocks_rejected += 1
                if kind == "signature":
                    self.counters.security_signature_failures += 1
                else:
                    self.counters.security_content_failures += 1
                report.security_events.append({"kind": kind, "detail": outcome.error or ""})
                logger.warning("SECURITY: fetched block refused (%s): %s", kind, outcome.error)
            msg = (
                f"fetch stopped at block {start + outcome.loaded} of {start + plan.fetch_blocks}: "
                f"{outcome.error}; recomputing from there"
            )
            logger.warning(msg)
            report.fallback.append(msg)

    async def connect(self) -> None:
        """Open the relay session; on failure the node still works, recomputing everything."""
        try:
            self.peer = await RelayPeer.open(self)
        except Exception as exc:
            logger.warning("cannot reach relay %s (%s); continuing without it", self.config.relay_url, exc)

    async def close(self) -> None:
        for task in list(self._tasks):
            await asyncio.gather(task, return_exceptions=True)
        if self.peer is not None:
            await self.peer.close()
            self.peer = None

    # -- block sink used by the fetcher (called with the lock held) ----------------------------------

    def begin_import(self, block_hash: bytes) -> bool:
        return self.cache.begin_import(block_hash)

    def import_layer(self, block_hash: bytes, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cache.import_layer(block_hash, layer, k, v)

    def finish_import(self, block_hash: bytes) -> None:
        self.cache.finish_import(block_hash)

    def abort_import(self, block_hash: bytes) -> None:
        self.cache.abort_import(block_hash)

    # -- introspection ----------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        st = self.cache.stats()
        return {
            "model": self.model_name,
            "fingerprint": self.fingerprint.hex(),
            "block_size": self.block_size,
            "relay_connected": self.peer is not None and self.peer.connected,
            "cache_blocks": st.num_blocks,
            "cached_blocks": st.cached_blocks,
            "store_entries": len(self.store),
        }

    def metrics(self) -> dict[str, float]:
        st = self.cache.stats()
        out: dict[str, float] = {f"{k}_total": v for k, v in self.counters.__dict__.items()}
        out.update(
            cache_blocks=st.num_blocks,
            cache_used_blocks=st.used_blocks,
            cache_cached_blocks=st.cached_blocks,
            store_bytes=self.store.nbytes,
            store_entries=len(self.store),
            store_evicted_total=self.store.stats.evicted,
            abr_throughput_bps=self.abr.throughput.estimate(),
            abr_rtt_seconds=self.abr.rtt.estimate(),
            abr_prefill_seconds_per_token=self.abr.prefill.per_token_s,
        )
        if self.peer is not None:
            out.update(self.peer.metrics())
        return out


def setup_logging(verbose: bool) -> None:
    """Progress and warnings on stderr, so ``--json`` output on stdout stays machine-readable."""
    import sys

    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # The transport's per-packet debug output drowns everything else.
    logging.getLogger("quic").setLevel(logging.WARNING)


def default_key_dir(kvnet_home: str | None) -> Path:
    """``$KVNET_HOME/keys`` or ``~/.kvnet/keys`` (the caller reads the environment)."""
    base = Path(kvnet_home) if kvnet_home else Path.home() / ".kvnet"
    return base / "keys"


async def start_node(config: NodeConfig, *, calibrate: bool = True) -> Node:
    """Build the node (model load and fingerprint in a thread) and connect it to its relay, if any."""
    logger.info("loading model %s ...", config.checkpoint or config.model)
    torch.set_num_threads(config.torch_threads)
    node = await asyncio.to_thread(Node.from_config, config)
    if calibrate:
        per_token = await asyncio.to_thread(node.calibrate)
        logger.info("model ready: fingerprint %s, prefill %.3f ms/token", node.fingerprint.hex()[:16],
                    per_token * 1e3)
    freeze_startup_objects()
    if config.relay_url is not None:
        await node.connect()
    return node


class RelayPeer:
    """The node's one MoQT session to its relay (``kvnet.net.connection``), with the block server and fetcher.

    The server answers the relay's TRACK_STATUS/FETCH/SUBSCRIBE for our store in its own task for as long
    as the session lives; the fetcher sends our TRACK_STATUS/FETCH through the connection's helpers.
    """

    def __init__(self, conn: MoqtConnection, server: BlockServer, fetcher: BlockFetcher, url: str) -> None:
        self.conn = conn
        self.server = server
        self.fetcher = fetcher
        self.url = url
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @classmethod
    async def open(cls, node: Node) -> RelayPeer:
        cfg = node.config
        assert cfg.relay_url is not None
        url = parse_moqt_url(cfg.relay_url)
        tokens = (
            (AuthToken(AliasType.USE_VALUE, token_type=KVNET_TOKEN_TYPE, value=read_token(cfg.token_file)),)
            if cfg.token_file is not None else ()
        )
        session_config = SessionConfig(
            is_client=True, path=url.path or None, authority=f"{url.host}:{url.port}",
            authorization_tokens=tokens,
            # The relay forwards many requests to us at once when it serves blocks from our store.
            max_requests_in_flight=16384,
        )
        tls = TlsSettings(ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_file)
        settings = cfg.transport_settings
        conn = await asyncio.wait_for(
            connect(cfg.relay_url, settings, tls, session_config), cfg.request_timeout
        )
        spec = node.cache.spec
        server = BlockServer(conn, node.store, node.fingerprint, node.tenant_namespace, spec.num_layers)
        fetcher = BlockFetcher(
            conn, node.fingerprint, node.tenant_namespace, spec.block_shape, node.dtype_name, node.trust,
            node.abr,
            trust_any=cfg.trust_any, timeout=cfg.request_timeout, window_bytes=cfg.fetch_window_bytes,
            device=node.device,
        )
        peer = cls(conn, server, fetcher, cfg.relay_url)
        try:
            await asyncio.wait_for(server.announce(), cfg.request_timeout)
        except RequestRejected as exc:
            # Still useful as a subscriber; a publisher then serves only what it pushed.
            logger.warning("relay refused PUBLISH_NAMESPACE (%s): not serving blocks on request", exc)
        except BaseException:
            await conn.close_session()
            raise
        loop = asyncio.get_running_loop()
        peer._tasks = [loop.create_task(server.serve()), loop.create_task(peer._watch())]
        logger.info("connected to relay %s; namespace tenant field %s", cfg.relay_url, node.tenant_namespace)
        return peer

    async def _watch(self) -> None:
        code, reason = await self.conn.wait_session_closed()
        if self._closing:
            return
        logger.warning("relay session ended (code %#x): %s", code, reason or "no reason given")

    @property
    def connected(self) -> bool:
        return not self.conn.is_closed

    async def locate(self, hashes: list[bytes], renditions: list[str]) -> Located:
        if not self.connected:
            raise ConnectionError("relay session is not up")
        return await self.fetcher.locate(hashes, renditions)

    async def fetch(
        self, expected: list[ExpectedBlock], renditions: list[str], sink: BlockSink
    ) -> FetchOutcome:
        return await self.fetcher.fetch(expected, renditions, sink)

    async def push(self, blocks: list[StoredBlock]) -> int:
        if not self.connected or not blocks:
            return 0
        try:
            return await self.server.push(blocks)
        except (MoqtConnectionError, UsageError) as exc:
            logger.warning("pushing blocks to the relay failed: %s", exc)
            return 0

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait until the relay acknowledged everything we sent (before a one-shot publisher exits)."""
        deadline = time.monotonic() + timeout
        while self.connected and self.conn.send_buffered() > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def metrics(self) -> dict[str, float]:
        return {f"publisher_{k}_total": float(v) for k, v in self.server.stats.__dict__.items()}

    async def close(self) -> None:
        # Blocks pushed just before exiting must reach the relay's cache first.
        await self.drain(timeout=10.0)
        self._closing = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.conn.close_session(), 5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
