"""The data path, end to end and against the alternatives, in one interleaved run.

What moves: a real prompt's KV (the ``bench`` model's shape, or an 8B Llama-3's with ``--kv-shape
llama3-8b``; bf16, 64-token blocks, lossless rendition, signed), served by a publisher session to a
``kvnet-relay`` process per (stack, link), fetched once through the relay to fill its cache, and then
fetched from the relay's cache by a ``BlockFetcher``, which verifies every block (signature, token ids,
chain, per-layer digest), decodes it and imports it into a paged cache: the "verified fetch". Next to it,
the same number of bytes moved by

- raw QUIC server -> client (the direction of a fetch) per stack and link, no MoQT (``bench_fetch``'s
  raw sender in a child process);
- TLS 1.3 over TCP with blocking ``ssl`` sockets, and HTTPS (``http.server`` / ``http.client``, one
  keep-alive connection), both with a server child process.

Links are ``kvnet.net.config.LINK_PRESETS``: ethernet (1452-byte datagrams), jumbo (8952) and loopback (the
stack's loopback size). Every figure is the median of RUNS runs; the cases are interleaved (run 1 of every
case, then run 2, ...) so that a change in load hits all of them alike, and the load is printed with
each. Reported per case: MB/s (10^6 bytes/s of wire bytes), goodput in tokens/s of the prompt, and CPU
ms per MB on the server side (relay or child, from /proc) and the client side (this process).

    python benchmarks/bench_datapath.py --tokens 2048 --runs 5
    python benchmarks/bench_datapath.py --tokens 512 --runs 3 --links ethernet,loopback --stacks aioquic

``--fetch-connections 1,2,4`` instead measures verified fetches over QMux striped over that many sessions
(a node's ``--fetch-connections``), for each of ``--renditions``, interleaved (``stripes``; also what
``benchmarks/device/bench_stripes.py`` runs).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import dataclasses
import functools
import http.client
import http.server
import io
import os
import pstats
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import torch

from kvnet.blocks.codecs import get_codec
from kvnet.blocks.identity import BlockIdentity
from kvnet.cache.paged_cache import CacheSpec, PagedKVCache
from kvnet.exchange import fetching
from kvnet.exchange.abr import KvAbr
from kvnet.exchange.blockstore import BlockStore
from kvnet.exchange.config import DEFAULT_VERIFY_WORKERS, MAX_FETCH_CONNECTIONS
from kvnet.exchange.fetching import BlockFetcher
from kvnet.exchange.publishing import BlockServer
from kvnet.exchange.striping import fetch_striped
from kvnet.model.transformer import transformer_configs
from kvnet.net.config import LINK_PRESETS, STACKS, TlsConfig, TransportConfig
from kvnet.net.connection import MoqtConnection
from kvnet.net.endpoint import connect
from kvnet.security.signing import TrustStore
from tests.helpers.caches import TensorsOnlyCache
from tests.helpers.processes import CertDir, free_port, free_port_run, start_relay
from tests.helpers.prompts import SignedPrompt, prompt_identities, signed_prompt

MODEL = "bench"
BLOCK_SIZE = 64
FINGERPRINT = bytes(range(32))
NAMESPACE_ID = "bench"
CHUNK = 1 << 20
# An 8B Llama-3 keeps 32 layers x (K, V) x 8 KV heads x 128 x 2 bytes of bf16 KV per token: the figure
# that says what a transfer rate means on a real fleet.
LLAMA3_8B_BF16_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
DEFAULT_LAYERS_PER_TASK = fetching.LAYERS_PER_TASK
TLS_TCP_CASE = "TLS 1.3 over TCP (blocking)"
QMUX = "qmux"
QMUX_CASE = "verified fetch QMux (TLS 1.3/TCP)"
# Stacks a node (Python 3.11, torch) runs on: an aiopquic relay's subscribers use these.
NODE_STACKS = ("qh3", "aioquic")
# Seconds a verified fetch may wait for an object; a transfer stalled longer counts as a failed run.
FETCH_TIMEOUT = 30.0
WARM_SESSIONS = 40
"""Sessions a relay with workers is filled through at most until each worker holds the prompt."""


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------- the prompt's KV


Prompt = SignedPrompt


KV_SHAPES: dict[str, tuple[int, int, int]] = {
    "bench": (transformer_configs[MODEL].n_layers, transformer_configs[MODEL].n_kv_heads,
              transformer_configs[MODEL].head_dim),
    "llama3-8b": (32, 8, 128),
}
"""(layers, KV heads, head size) of the KV moved (``--kv-shape``). A layer object is 64 tokens x heads x
head size x 2 (K, V) x 2 bytes: 64 KiB in ``bench``'s shape, 256 KiB in an 8B Llama-3's, so the costs a
receiver pays per object and per block weigh 4x and 8x less per MB in the fleet model's shape."""
kv_shape = "bench"
"""The shape this run moves (set from ``--kv-shape`` before any prompt is made)."""


def prompt_spec() -> CacheSpec:
    layers, kv_heads, head_dim = KV_SHAPES[kv_shape]
    return CacheSpec(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, block_size=BLOCK_SIZE,
                     dtype=torch.bfloat16)


def make_prompt(tokens: int, rendition: str = "lossless") -> Prompt:
    """Seeded random bf16 K/V for ``tokens`` tokens (whole blocks) in the shape ``kv_shape`` names."""
    return signed_prompt(prompt_spec(), max(1, tokens // BLOCK_SIZE), fingerprint=FINGERPRINT, salt=b"bench",
                         seed=0, rendition=rendition)


# ---------------------------------------------------------------- cases


@dataclass
class Sample:
    seconds: float
    server_cpu: float
    client_cpu: float


@dataclass
class Case:
    """One way of moving the prompt's bytes; ``run`` moves them once and returns what it cost."""

    name: str
    run: Callable[[], Sample]
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    """Why runs failed (a stalled transfer runs into the fetch timeout); reported next to the figure."""


def timed_sample(server: int | Callable[[], dict[int, float]], move: Callable[[], None]) -> Sample:
    """Time ``move`` and the CPU it cost here and in ``server``: a pid, or a function giving CPU seconds by
    pid of several processes (a relay with ``--workers``; summed)."""

    def server_cpu() -> float:
        return proc_cpu_seconds(server) if isinstance(server, int) else sum(server().values())

    s0, c0, t0 = server_cpu(), time.process_time(), time.perf_counter()
    move()
    t1, c1, s1 = time.perf_counter(), time.process_time(), server_cpu()
    return Sample(t1 - t0, s1 - s0, c1 - c0)


def empty_cache(spec: CacheSpec, blocks: int, device: torch.device | None = None) -> PagedKVCache:
    """A paged cache for one verified fetch, made before the timed part: a node allocates its cache once
    at start, not per fetch (zeroing 23 MB costs ~0.2 ms of CPU per MB fetched). On ``cuda`` the cache is
    on the GPU and each layer is staged through pinned host memory, as a node with ``--device cuda``."""
    return PagedKVCache(spec, num_blocks=blocks, device=device or torch.device("cpu"))


async def verified_fetch(conn: MoqtConnection | Sequence[MoqtConnection], cache: PagedKVCache,
                         identities: list[BlockIdentity], trust: TrustStore,
                         verify_workers: int = DEFAULT_VERIFY_WORKERS, into_slots: bool = True,
                         rendition: str = "lossless") -> None:
    """Fetch, verify, decode and import the whole prompt (in ``rendition``) into ``cache`` (empty), decoding
    straight into its slots unless ``into_slots`` is False (``TensorsOnlyCache``); raises unless every block
    loaded. Several connections: the blocks are striped over them as a node with ``--fetch-connections``
    does (``kvnet.exchange.striping``), each with its own fetcher and ``verify_workers`` threads."""
    spec = cache.spec
    writer = cache if into_slots else TensorsOnlyCache(cache)
    conns = [conn] if isinstance(conn, MoqtConnection) else list(conn)
    abr = KvAbr()
    fetchers: list[BlockFetcher] = []
    for c in conns:
        fetchers.append(BlockFetcher(
            c, writer, trust, fingerprint=FINGERPRINT, namespace_id=NAMESPACE_ID, shape=spec.block_shape,
            dtype="bfloat16", abr=abr, timeout=FETCH_TIMEOUT, verify_workers=verify_workers,
            device=cache.device, inflight=fetchers[0].inflight if fetchers else None,
        ))
    outcome = await fetch_striped(fetchers, identities, [rendition] * len(identities), abr=abr)
    if outcome.loaded != len(identities) or outcome.error is not None:
        raise RuntimeError(f"verified fetch loaded {outcome.loaded} blocks: {outcome.error}")


class RelayFetch:
    """A relay (stack, link) holding the prompt in its cache, filled from a publisher session on a
    background loop; each ``fetch`` is a verified fetch of the whole prompt on a fresh session."""

    def __init__(self, prompt: Prompt, certdir: Path, stack: str, link: str, loop: asyncio.AbstractEventLoop,
                 udp_segmentation: bool = True, peer_stack: str | None = None, workers: int = 1):
        """``peer_stack``: the stack of the publisher and subscriber sessions in this process (default:
        the relay's; an aiopquic relay runs in the Python 3.12 environment, its peers here on 3.11).
        ``workers``: the relay's ``--workers``; with more than one, every worker's cache is filled.
        ``stack`` "qmux": the relay (on aioquic) serves ``--listen-qmux`` too, and every session here,
        the publisher's included, is QMux over TLS/TCP (``moqt+qmux://``); ``link`` does not apply."""
        self.prompt = prompt
        self.certdir = certdir
        qmux = stack == QMUX
        if qmux:
            stack, link, peer_stack = "aioquic", "loopback", None
        self.settings = dataclasses.replace(TransportConfig.for_link(link, peer_stack or stack),
                                            udp_segmentation=udp_segmentation)
        self.loop = loop
        cache_bytes = str(4 * prompt.wire_bytes + (64 << 20))
        cert_dir = CertDir(certdir, certdir / "ca.pem", certdir / "server.pem", certdir / "server-key.pem")
        name = f"relay-{stack}-{link}{'' if udp_segmentation else '-nogso'}"
        name += f"-w{workers}" if workers > 1 else ""
        name += "-qmux" if qmux else ""
        qmux_port = free_port() if qmux else 0
        qmux_flags = ["--listen-qmux", f"127.0.0.1:{qmux_port}"] if qmux else []
        self.workers = workers
        toml = certdir / f"{name}.toml"
        toml.write_text(f"[transport]\nudp_segmentation = {str(udp_segmentation).lower()}\n")
        self.relay = start_relay(cert_dir, certdir, "--config", str(toml), "--quic-stack", stack,
                                 "--link", link, "--cache-bytes", cache_bytes,
                                 "--cache-track-bytes", cache_bytes, "--workers", str(workers), *qmux_flags,
                                 name=name,
                                 metrics_port=free_port_run(workers + 1) if workers > 1 else 0,
                                 log_level="warning", ready_marker=None)
        self.proc = self.relay.proc
        self.url = f"moqt+qmux://127.0.0.1:{qmux_port}" if qmux else self.relay.url
        self.tls = TlsConfig(ca_file=certdir / "ca.pem")
        self.publisher: MoqtConnection | None = None
        self.serving: asyncio.Task[None] | None = None
        self.trust = TrustStore()
        self.trust.add(prompt.signer.public_key)
        try:
            self._call(self._fill())
        except BaseException:
            self.close()
            raise

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=600)

    async def _connect(self, receive_offload: bool = True) -> MoqtConnection:
        settings = dataclasses.replace(self.settings, udp_receive_offload=receive_offload)
        return await connect(self.url, settings, self.tls)

    async def _fill(self) -> None:
        """Serve the prompt from a publisher session and fetch it once through the relay, which keeps it.
        (Not ``BlockServer.push``: pushing 32 blocks at 1452-byte datagrams stalled here, see
        docs/performance.md.)"""
        self.publisher = await self._connect()
        store = BlockStore(4 * self.prompt.wire_bytes)
        store.put_chain(self.prompt.blocks)
        server = BlockServer(self.publisher, store, FINGERPRINT, NAMESPACE_ID, self.prompt.spec.num_layers)
        await server.announce()
        self.serving = asyncio.create_task(server.serve())
        objects = len(self.prompt.blocks) * (self.prompt.spec.num_layers + 1)
        # Each session lands on one worker (the kernel's hash of its source port), and a worker keeps
        # what its sessions fetched: fetch on new sessions until every worker holds the prompt.
        for _ in range(WARM_SESSIONS):
            conn = await self._connect()
            try:
                await self._fetch(conn)
            finally:
                await conn.close_session()
            if self.workers == 1:
                await self.relay.wait_metric("kvnet_relay_cache_objects", objects, timeout=60)
                return
            held = [(await asyncio.to_thread(self.relay.metrics, i)).get("kvnet_relay_cache_objects", 0)
                    for i in range(self.workers)]
            if min(held) >= objects:
                return
        raise RuntimeError(f"{WARM_SESSIONS} sessions did not reach every relay worker")

    def worker_metric(self, name: str) -> float:
        """``name`` summed over the relay's workers (the hub's endpoint not included)."""
        return sum(self.relay.metrics(i).get(name, 0.0) for i in range(self.workers))

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds so far of each of the relay's processes: the one started and its children (the
        workers and the hub of ``--workers``), by pid."""
        pid = self.proc.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return {p: proc_cpu_seconds(p) for p in (pid, *map(int, children))}

    async def _fetch(self, conn: MoqtConnection | Sequence[MoqtConnection],
                     verify_workers: int = DEFAULT_VERIFY_WORKERS, cache: PagedKVCache | None = None,
                     into_slots: bool = True) -> None:
        cache = cache or empty_cache(self.prompt.spec, len(self.prompt.blocks))
        await verified_fetch(conn, cache, self.prompt.identities, self.trust, verify_workers, into_slots,
                             self.prompt.blocks[0].rendition)

    def fetch(self, verify_workers: int = DEFAULT_VERIFY_WORKERS, receive_offload: bool = True,
              layers_per_task: int | None = None, into_slots: bool = True, connections: int = 1,
              device: torch.device | None = None) -> Sample:
        # Fresh sessions per run, set up outside the timed part (as in the other cases): the fetch only.
        # layers_per_task: the fetcher's module setting for this fetch only (the loop thread reads it
        # while this thread waits for the fetch). connections: sessions the fetch is striped over.
        fetching.LAYERS_PER_TASK = layers_per_task or DEFAULT_LAYERS_PER_TASK
        conns = [self._call(self._connect(receive_offload)) for _ in range(connections)]
        cache = empty_cache(self.prompt.spec, len(self.prompt.blocks), device)
        misses = self.worker_metric("kvnet_relay_cache_misses_total")
        try:
            sample = timed_sample(self.cpu_seconds,
                                  lambda: self._call(self._fetch(conns, verify_workers, cache, into_slots)))
        finally:
            for conn in conns:
                self._call(conn.close_session())
        if self.worker_metric("kvnet_relay_cache_misses_total") != misses:
            raise RuntimeError("the relay went upstream: not a fetch from its cache")
        return sample

    def close(self) -> None:
        if self.serving is not None:
            self.loop.call_soon_threadsafe(self.serving.cancel)
        if self.publisher is not None:
            self._call(self.publisher.close_session())
        self.relay.stop()


@contextmanager
def raw_quic(
    certdir: Path, stack: str, link: str, size: int, peer_stack: str | None = None
) -> Iterator[Case]:
    """Raw QUIC from a sender child on ``stack`` to this process receiving on ``peer_stack`` (default the
    same)."""
    bench_fetch = common.load_bench("bench_fetch")
    assert bench_fetch is not None
    settings = TransportConfig.for_link(link, stack)
    receiver = TransportConfig.for_link(link, peer_stack or stack)
    sender = bench_fetch.Publisher(settings, certdir, 0, 0, raw=True)
    with sender as port:
        pid = sender.proc.pid

        def move() -> None:
            asyncio.run(bench_fetch._raw_receive_once(receiver, port, certdir, size))

        def run() -> Sample:
            if receiver.stack != "aiopquic":
                return timed_sample(pid, move)
            # An aiopquic receiver runs in the Python 3.12 environment: a child that times itself.
            s0 = proc_cpu_seconds(pid)
            seconds, client_cpu = bench_fetch.raw_receive_in_child(receiver, port, certdir, size)
            return Sample(seconds, proc_cpu_seconds(pid) - s0, client_cpu)

        yield Case(f"raw QUIC {_pair(stack, peer_stack)} {link}", run)


def _pair(stack: str, peer_stack: str | None) -> str:
    """A case's stacks: "aioquic", or "aiopquic>qh3" for a sender on aiopquic and a receiver on qh3."""
    return stack if peer_stack in (None, stack) else f"{stack}>{peer_stack}"


# ---------------------------------------------------------------- TLS over TCP and HTTPS (child process)


def _server_context(certdir: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(certdir / "server.pem", certdir / "server-key.pem")
    return ctx


def _client_context(certdir: Path) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certdir / "ca.pem"))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def _serve_tls_child(certdir: Path) -> None:
    """TLS over TCP (the client sends an 8-byte size, we send that many bytes) and HTTPS (GET /N answers
    N bytes), both with blocking sockets, one thread per connection."""
    ctx = _server_context(certdir)
    payload = memoryview(os.urandom(CHUNK))

    def send_bytes(write: Callable[[memoryview], Any], size: int) -> None:
        sent = 0
        while sent < size:
            n = min(CHUNK, size - sent)
            write(payload[:n])
            sent += n

    def tls_connection(conn: socket.socket) -> None:
        with ctx.wrap_socket(conn, server_side=True) as tls:
            while True:
                header = tls.recv(8)
                if len(header) < 8:
                    return
                send_bytes(tls.sendall, struct.unpack("!Q", header)[0])

    tcp = socket.create_server(("127.0.0.1", 0))

    def accept_tls() -> None:
        while True:
            conn, _ = tcp.accept()
            threading.Thread(target=tls_connection, args=(conn,), daemon=True).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            size = int(self.path.strip("/"))
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            send_bytes(self.wfile.write, size)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=accept_tls, daemon=True).start()
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    print(f"ready {tcp.getsockname()[1]} {httpd.server_address[1]}", flush=True)
    sys.stdin.read()  # the parent closes stdin to stop us


@contextmanager
def tls_cases(certdir: Path, size: int) -> Iterator[list[Case]]:
    child = subprocess.Popen([sys.executable, __file__, "--serve-tls", str(certdir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        words = child.stdout.readline().split()
        if not words or words[0] != "ready":
            raise RuntimeError("TLS server failed to start")
        tcp_port, https_port = int(words[1]), int(words[2])
        ctx = _client_context(certdir)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        tls = ctx.wrap_socket(socket.create_connection(("127.0.0.1", tcp_port)), server_hostname="localhost")
        https = http.client.HTTPSConnection("127.0.0.1", https_port, context=_client_context(certdir))
        # The certificate names localhost; the connection goes to its address.
        https._context.check_hostname = False  # type: ignore[attr-defined]

        def tcp_move() -> None:
            tls.sendall(struct.pack("!Q", size))
            got = 0
            while got < size:
                n = tls.recv_into(view, min(CHUNK, size - got))
                if n == 0:
                    raise RuntimeError("TLS server closed early")
                got += n

        def https_move() -> None:
            https.request("GET", f"/{size}")
            resp = https.getresponse()
            got = 0
            while got < size:
                n = resp.readinto(view)
                if n == 0:
                    raise RuntimeError("HTTPS response ended early")
                got += n

        yield [Case(TLS_TCP_CASE, lambda: timed_sample(child.pid, tcp_move)),
               Case("HTTPS (http.server/http.client)", lambda: timed_sample(child.pid, https_move))]
        tls.close()
        https.close()
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.kill()
        child.wait()


# ---------------------------------------------------------------- fan-out: N subscribers, one relay


def _fanout_child(certdir: Path, stack: str, link: str, tokens: int, key_hex: str) -> None:
    """One subscriber process of the fan-out: on ``connect URL`` it opens a session to that relay, on ``go``
    it makes a verified fetch of the prompt and answers ``done SECONDS CPU_SECONDS`` (or ``failed WHY``);
    anything else (or EOF) ends it. Stack ``qmux``: the URL (``moqt+qmux://``) picks QMux; the transport
    settings are the relay's defaults, as ``RelayFetch`` uses them."""
    settings = TransportConfig() if stack == QMUX else TransportConfig.for_link(link, stack)
    tls = TlsConfig(ca_file=certdir / "ca.pem")
    spec = prompt_spec()
    _, identities = prompt_identities(BLOCK_SIZE, max(1, tokens // BLOCK_SIZE), fingerprint=FINGERPRINT,
                                      salt=b"bench")
    trust = TrustStore()
    trust.add_raw(bytes.fromhex(key_hex))

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        conn: MoqtConnection | None = None
        print("ready", flush=True)
        while True:
            command, _, url = (await loop.run_in_executor(None, sys.stdin.readline)).strip().partition(" ")
            try:
                if command == "connect":
                    conn = await connect(url, settings, tls)
                    print("connected", flush=True)
                elif command == "go" and conn is not None:
                    cache = empty_cache(spec, len(identities))
                    c0, t0 = time.process_time(), time.perf_counter()
                    await verified_fetch(conn, cache, identities, trust)
                    t1, c1 = time.perf_counter(), time.process_time()
                    print(f"done {t1 - t0} {c1 - c0}", flush=True)
                    closing, conn = conn, None
                    await closing.close_session()  # after the answer: not part of the timed fetch
                else:
                    return
            except Exception as exc:  # reported to the parent as a failed run, not a crash
                print(f"failed {type(exc).__name__}: {exc}".replace("\n", " ")[:200], flush=True)

    asyncio.run(serve())


class FanoutSubscriber:
    """A subscriber child process (``_fanout_child``) driven line by line."""

    def __init__(self, prompt: Prompt, certdir: Path, stack: str, link: str, tokens: int) -> None:
        key_hex = prompt.signer.public_raw.hex()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--kv-shape", kv_shape, "--fanout-child", str(certdir), stack, link,
             str(tokens), key_hex],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def command(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def answer(self) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"subscriber process exited (code {self.proc.poll()})")
        return line.split()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class FanoutFigure:
    subscribers: int
    relay_workers: int = 1
    aggregate_mbps: list[float] = field(default_factory=list)
    """All subscribers' wire bytes over the time from the start signal to the last one done, per run."""
    per_subscriber_mbps: list[float] = field(default_factory=list)
    """Each subscriber's own wire bytes over its own fetch time, every subscriber of every run."""
    relay_ms_per_mb: list[float] = field(default_factory=list)
    """CPU of all the relay's processes (workers and hub summed) per MB delivered, per run."""
    relay_busiest_core: list[float] = field(default_factory=list)
    """Per run: CPU of the relay's busiest process over the round's time (1.0 = one core all the time)."""
    workers_used: list[int] = field(default_factory=list)
    """Per run: relay workers that sent the subscribers anything (their sessions landed there: the kernel
    hashes each source port)."""
    failures: list[str] = field(default_factory=list)


def fanout(tokens: int, runs: int, counts: list[int], stack: str = "aioquic",
           link: str = "loopback", relay_workers: Sequence[int] = (1,)) -> tuple[Prompt, list[FanoutFigure]]:
    """N = each of ``counts`` subscriber processes make a verified fetch of the same prompt from one relay's
    cache at once (sessions set up before the start signal); ``runs`` rounds, the counts interleaved, and
    with them the relays of each ``relay_workers`` count (all running throughout, each with every
    worker's cache filled)."""
    prompt = make_prompt(tokens)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    figures = [FanoutFigure(n, w) for w in relay_workers for n in counts]
    mb = prompt.wire_bytes / 1e6
    try:
        with common.test_certificates() as certdir, ExitStack() as stack_:
            relays: dict[int, RelayFetch] = {}
            for w in relay_workers:
                relays[w] = RelayFetch(prompt, certdir, stack, link, loop, workers=w)
                stack_.callback(relays[w].close)
            subscribers = [FanoutSubscriber(prompt, certdir, stack, link, tokens) for _ in range(max(counts))]
            for sub in subscribers:
                stack_.callback(sub.close)
            for sub in subscribers:
                if sub.answer() != ["ready"]:
                    raise RuntimeError("a subscriber process failed to start")
            for _ in range(runs):
                for fig in figures:
                    _fanout_round(relays[fig.relay_workers], subscribers[:fig.subscribers], fig, mb)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    return prompt, figures


def _fanout_round(relay: RelayFetch, subs: list[FanoutSubscriber], fig: FanoutFigure, mb: float) -> None:
    for sub in subs:
        sub.command(f"connect {relay.url}")
    for sub in subs:
        if (got := sub.answer())[0] != "connected":
            fig.failures.append(" ".join(got))
            return
    sent = [relay.relay.metrics(i).get("kvnet_relay_bytes_out_total", 0.0) for i in range(relay.workers)]
    misses = relay.worker_metric("kvnet_relay_cache_misses_total")
    cpu0, t0 = relay.cpu_seconds(), time.perf_counter()
    for sub in subs:
        sub.command("go")
    answers = [sub.answer() for sub in subs]
    elapsed, cpu1 = time.perf_counter() - t0, relay.cpu_seconds()
    used = [cpu1[pid] - cpu0.get(pid, 0.0) for pid in cpu1]
    cpu = sum(used)
    failed = [" ".join(a) for a in answers if a[0] != "done"]
    if failed:
        fig.failures.append(failed[0])
        return
    if relay.worker_metric("kvnet_relay_cache_misses_total") != misses:
        fig.failures.append("the relay went upstream: not a fetch from its cache")
        return
    fig.workers_used.append(sum(
        relay.relay.metrics(i).get("kvnet_relay_bytes_out_total", 0.0) > sent[i] for i in range(relay.workers)
    ))
    fig.aggregate_mbps.append(len(subs) * mb / elapsed)
    fig.per_subscriber_mbps.extend(mb / float(a[1]) for a in answers)
    fig.relay_ms_per_mb.append(1000 * cpu / (len(subs) * mb))
    fig.relay_busiest_core.append(max(used) / elapsed)


# ---------------------------------------------------------------- striping over sessions


@dataclass
class StripeFigure:
    """Verified fetches of one rendition's prompt from a relay's cache, striped over ``connections``
    QMux sessions (``kvnet.exchange.striping``, as a node with ``--fetch-connections``)."""

    rendition: str
    connections: int
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def wire_mb(self) -> float:
        return self.prompt.wire_bytes / 1e6

    @property
    def kv_mb(self) -> float:
        """Decoded K/V written into the cache per fetch (MB)."""
        return len(self.prompt.blocks) * self.prompt.spec.bytes_per_block / 1e6


def stripes(
    tokens: int, runs: int, counts: Sequence[int], renditions: Sequence[str] = ("lossless", "plain"),
    relay_workers: int = 1, device: torch.device | None = None,
    verify_workers: int = DEFAULT_VERIFY_WORKERS, budget_s: float | None = None,
) -> list[StripeFigure]:
    """For each rendition a relay (``--listen-qmux``, ``relay_workers`` workers, each one's cache filled)
    holding the prompt, and verified fetches over QMux striped over each of ``counts`` sessions into a
    paged cache on ``device`` (on ``cuda``: the GPU's cache through pinned staging buffers), each session
    with ``verify_workers`` verify threads; ``runs`` rounds, every (rendition, count) interleaved; no round
    starts after ``budget_s`` seconds (the first always runs)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    figures: list[StripeFigure] = []
    try:
        with common.test_certificates() as certdir, ExitStack() as stack:
            relays: dict[str, RelayFetch] = {}
            for rendition in renditions:
                prompt = make_prompt(tokens, rendition)
                relays[rendition] = RelayFetch(prompt, certdir, QMUX, "loopback", loop, workers=relay_workers)
                stack.callback(relays[rendition].close)
                figures.extend(StripeFigure(rendition, n, prompt) for n in counts)
            started = time.perf_counter()
            for round_ in range(runs):
                if round_ and budget_s is not None and time.perf_counter() - started > budget_s:
                    print(f"time budget of {budget_s:.0f} s spent: {round_} of {runs} rounds", flush=True)
                    break
                for fig in figures:
                    try:
                        fig.samples.append(relays[fig.rendition].fetch(
                            verify_workers, connections=fig.connections, device=device))
                    except Exception as exc:  # one stalled run is a finding, not the end of the others
                        fig.failures.append(f"{type(exc).__name__}: {exc}"[:200])
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    return figures


STRIPE_COLUMNS = ("rendition", "sessions", "wire MB/s", "KV GB/s", "tok/s", "relay ms/MB", "node ms/MB")


def stripe_rows(figures: Sequence[StripeFigure]) -> list[tuple[str, ...]]:
    """One row per figure (medians; ms/MB per wire MB), the columns of ``STRIPE_COLUMNS``; a figure whose
    runs all failed says why."""
    rows: list[tuple[str, ...]] = []
    for f in figures:
        if not f.samples:
            failed = f"all {len(f.failures)} runs failed: {f.failures[0]}"
            rows.append((f.rendition, str(f.connections), failed))
            continue
        seconds = common.median([x.seconds for x in f.samples])
        rows.append((
            f.rendition, str(f.connections), f"{f.wire_mb / seconds:.1f}", f"{f.kv_mb / 1e3 / seconds:.3f}",
            f"{f.prompt.tokens / seconds:.0f}",
            f"{common.median([1e3 * x.server_cpu / f.wire_mb for x in f.samples]):.2f}",
            f"{common.median([1e3 * x.client_cpu / f.wire_mb for x in f.samples]):.2f}",
        ))
    return rows


def print_stripes(figures: Sequence[StripeFigure], runs: int) -> None:
    if figures:
        p = figures[0].prompt
        runs = max(len(f.samples) + len(f.failures) for f in figures)
        print(f"striped verified fetch over QMux: {p.tokens} tokens, {len(p.blocks)} blocks, median of "
              f"{runs}, interleaved; load {common.load_average()}")
    print("  ".join(f"{c:>11s}" for c in STRIPE_COLUMNS))
    for row in stripe_rows(figures):
        print("  ".join(f"{c:>11s}" for c in row))
    for f in figures:
        if f.failures and f.samples:
            print(f"{f.rendition} x{f.connections}: {len(f.failures)} of {runs} runs failed: {f.failures[0]}")


# ---------------------------------------------------------------- the run


@dataclass
class Figure:
    name: str
    mbps: list[float]
    tokens_per_s: list[float]
    server_ms_per_mb: list[float]
    client_ms_per_mb: list[float]
    failures: list[str]


def run(tokens: int, runs: int, stacks: list[str], links: list[str],
        compare_gso: bool = True, verify_workers: tuple[tuple[int, int | None], ...] = (),
        node_stacks: tuple[str, ...] = NODE_STACKS, compare_gro: bool = False,
        compare_slots: bool = False, rendition: str = "lossless") -> tuple[Prompt, list[Figure]]:
    """Every case ``runs`` times, interleaved; one ``Figure`` per case. ``compare_gso`` adds aioquic
    verified fetches with ``TransportConfig.udp_segmentation`` off on both sides, ``compare_gro`` ones
    whose client reads without ``udp_receive_offload``, ``compare_slots`` ones whose fetcher decodes into
    new tensors that the cache copies (``TensorsOnlyCache``) instead of into the cache's slots; each of
    ``verify_workers`` (threads, layers per task or None) adds verified fetches from the same relay with
    that many verify threads (``BlockFetcher.verify_workers``; the plain case uses the default). A relay
    (and raw sender) on aiopquic runs in the Python 3.12 environment, with subscribers here on each of
    ``node_stacks``; it is left out, said so, where that environment cannot be made. The prompt's blocks
    are in ``rendition``."""
    prompt = make_prompt(tokens, rendition)
    size = prompt.wire_bytes

    def verified_fetches(relay: RelayFetch, label: str) -> list[Case]:
        """The verified fetches from one relay: with the default settings, then copying (``compare_slots``)
        and with each of ``verify_workers``."""
        out = [Case(label if label == QMUX_CASE else f"verified fetch {label}", relay.fetch)]
        if compare_slots:
            copying = functools.partial(relay.fetch, into_slots=False)
            out.append(Case(f"{out[0].name} copying", copying))
        for n, k in verify_workers:
            per_task = "" if k is None else f", {k} layers per task"
            name = f"{out[0].name} verify workers {n}{per_task}"
            out.append(Case(name, functools.partial(relay.fetch, n, layers_per_task=k)))
        return out

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with common.test_certificates() as certdir, ExitStack() as stack:
            cases: list[Case] = []
            for s in stacks:
                if s == QMUX:
                    relay = RelayFetch(prompt, certdir, s, "loopback", loop)
                    stack.callback(relay.close)
                    cases.extend(verified_fetches(relay, QMUX_CASE))
                    continue
                peers: tuple[str, ...] = (s,)
                if s == "aiopquic":
                    try:
                        common.native_quic_python()
                    except common.NativeQuicUnavailable as exc:
                        print(f"aiopquic cases left out: {exc}", flush=True)
                        continue
                    peers = node_stacks
                    for link in links:  # both ends native, for reference (nodes cannot run it)
                        cases.append(stack.enter_context(raw_quic(certdir, s, link, size)))
                for link, peer in ((link, peer) for link in links for peer in peers if peer != s):
                    relay = RelayFetch(prompt, certdir, s, link, loop, peer_stack=peer)
                    stack.callback(relay.close)
                    cases.extend(verified_fetches(relay, f"{_pair(s, peer)} {link}"))
                    cases.append(stack.enter_context(raw_quic(certdir, s, link, size, peer)))
                for link in links if s != "aiopquic" else ():
                    relay = RelayFetch(prompt, certdir, s, link, loop)
                    stack.callback(relay.close)
                    cases.extend(verified_fetches(relay, f"{s} {link}"))
                    if compare_gro and s == "aioquic":  # qh3's client reads in batches itself
                        cases.append(Case(f"verified fetch {s} {link} without GRO",
                                          lambda relay=relay: relay.fetch(receive_offload=False)))  # type: ignore[misc]
                    if compare_gso and s == "aioquic":  # the only stack kvnet sends GSO batches for
                        relay = RelayFetch(prompt, certdir, s, link, loop, udp_segmentation=False)
                        stack.callback(relay.close)
                        cases.append(Case(f"verified fetch {s} {link} without GSO", relay.fetch))
                    cases.append(stack.enter_context(raw_quic(certdir, s, link, size)))
            cases.extend(stack.enter_context(tls_cases(certdir, size)))
            for _ in range(runs):
                for case in cases:
                    try:
                        case.samples.append(case.run())
                    except Exception as exc:  # one stalled run is a finding, not the end of the others
                        case.failures.append(f"{type(exc).__name__}: {exc}"[:200])
            figures = [_figure(case, prompt) for case in cases]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    return prompt, figures


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of process ``pid``'s main thread (its event loop) and of its other
    threads together (an aiopquic relay: picoquic's network thread), from Linux /proc."""
    out = {"main thread (event loop)": 0.0, "other threads": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        key = "main thread (event loop)" if task.name == str(pid) else "other threads"
        out[key] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


# Parts of the fetching process's CPU, by cProfile entries' own time: the first part one of whose words is
# in an entry's "file:function" takes it (builtins are named by their module, e.g. "_hashlib").
PROFILE_PARTS = (
    ("digest (per layer)", ("_hashlib", "blake3", "payload_digest", "verify_payload", "compare_digest")),
    ("decode (zstd, byte planes)", ("kvnet/blocks/codecs.py", "zstandard", "numpy")),
    ("import into the paged cache", ("kvnet/cache/", "torch")),
    ("manifest checks (Ed25519, chain)", ("ed25519", "kvnet/security/signing.py", "proto/kvobject.py",
                                          "msgpack", "verify_manifest")),
    ("transport (QUIC stack, UDP, ACKs)", ("qh3", "aioquic", "aiopquic", "UdpSocketState", "kvnet/net/gso.py",
                                           "socket")),
    ("MoQT (parse, reassembly, routing)", ("proto/", "kvnet/net/")),
    ("fetcher (kvnet/exchange/fetching.py)", ("kvnet/exchange/",)),
    ("waiting (epoll)", ("select.epoll",)),
    ("event loop, other", ("",)),
)


def profile_parts(stats: pstats.Stats, mb: float) -> str:
    """A table of ``PROFILE_PARTS``: own time of each part under cProfile, ms per MB and share of the busy
    time (waiting excluded). cProfile's per-call cost inflates the Python parts against native ones."""
    seconds = dict.fromkeys((name for name, _ in PROFILE_PARTS), 0.0)
    for (filename, _, function), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{filename}:{function}"
        seconds[next(name for name, words in PROFILE_PARTS if any(w in where for w in words))] += own
    busy = sum(v for k, v in seconds.items() if not k.startswith("waiting"))
    lines = [f"  {'part':36s} {'ms/MB':>7s} {'share':>6s}"]
    for name, total in seconds.items():
        share = "" if name.startswith("waiting") else f"{100 * total / busy:5.1f}%"
        lines.append(f"  {name:36s} {1000 * total / mb:7.2f} {share:>6s}")
    return "\n".join(lines)


def profile(tokens: int, stack: str, link: str, peer_stack: str | None, rendition: str = "lossless",
            top: int = 14) -> str:
    """Where one verified fetch of ``rendition`` from a relay's cache spends CPU: the relay's CPU per thread
    (an aiopquic relay's picoquic thread apart from its event loop), and cProfile of the fetching event
    loop (this process; the verify threads apart)."""
    prompt = make_prompt(tokens, rendition)
    mb = prompt.wire_bytes / 1e6
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    prof = cProfile.Profile()
    out = io.StringIO()
    try:
        with common.test_certificates() as certdir:
            relay = RelayFetch(prompt, certdir, stack, link, loop, peer_stack=peer_stack)
            try:
                relay.fetch()  # a warm run, not profiled
                conn = relay._call(relay._connect())

                cache = empty_cache(prompt.spec, len(prompt.blocks))

                async def profiled() -> None:
                    prof.enable()
                    try:
                        await relay._fetch(conn, cache=cache)
                    finally:
                        prof.disable()

                before = thread_cpu_seconds(relay.proc.pid)
                t0, c0 = time.perf_counter(), time.process_time()
                relay._call(profiled())
                seconds, client_cpu = time.perf_counter() - t0, time.process_time() - c0
                after = thread_cpu_seconds(relay.proc.pid)
                relay._call(conn.close_session())
            finally:
                relay.close()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    print(f"verified fetch {_pair(stack, peer_stack)} {link} ({rendition}): {mb / seconds:.1f} MB/s under "
          f"cProfile; "
          f"fetching process {1000 * client_cpu / mb:.2f} ms/MB; relay CPU ms/MB by thread:", file=out)
    for name, total in after.items():
        print(f"  {name:24s} {1000 * (total - before[name]) / mb:7.2f}", file=out)
    stats = io.StringIO()
    table = pstats.Stats(prof, stream=stats)
    print(f"fetching event loop by part (cProfile own time):\n{profile_parts(table, mb)}", file=out)
    table.sort_stats("tottime").print_stats(top)
    print(f"fetching event loop, cProfile by own time:\n{stats.getvalue()}", file=out)
    return out.getvalue()


def layer_work(tokens: int, runs: int, renditions: Sequence[str] = ("lossless",),
               workers: Sequence[int] = (0,)) -> str:
    """The node's per-layer work of a verified fetch without the network, as ``BlockFetcher`` does it: each
    layer object's digest checked against its manifest, then decoded into the block reserved for it
    (``import_layer_with`` + ``decode_into``), on this thread (0 workers) or on N threads taking
    ``LAYERS_PER_TASK`` layers of a block at a time, as the fetcher's pool does. Per rendition and worker
    count: wall time and process CPU per wire MB, and raw K/V MB/s (what a node can take in at most, with
    nothing else to do), median of ``runs`` passes over the prompt's layers (one cache, each block's import
    aborted after its pass)."""
    lines = [f"digest + decode into the slots, {tokens} tokens of bf16 KV, median of {runs} passes; load "
             f"{common.load_average()}; cores {os.cpu_count()}",
             "| rendition | workers | wire MB | wall ms/MB | CPU ms/MB | raw MB/s | passes (wall ms/MB) |",
             "|---|---|---|---|---|---|---|"]
    for rendition in renditions:
        work = _LayerWork(make_prompt(tokens, rendition), rendition)
        mb = work.prompt.wire_bytes / 1e6
        raw_mb = len(work.prompt.blocks) * work.prompt.spec.bytes_per_block / 1e6
        for n in workers:
            pool = ThreadPoolExecutor(n) if n else None
            try:
                work.one_pass(pool)  # warm: the cache's pages, the codec's contexts, the threads
                passes = [work.one_pass(pool) for _ in range(runs)]
            finally:
                if pool is not None:
                    pool.shutdown()
            wall = common.median([w for w, _ in passes])
            cpu = common.median([c for _, c in passes])
            lines.append(f"| {rendition} | {n} | {mb:.1f} | {1000 * wall / mb:.2f} | {1000 * cpu / mb:.2f} | "
                         f"{raw_mb / wall:.0f} | {' '.join(f'{1000 * w / mb:.2f}' for w, _ in passes)} |")
    return "\n".join(lines)


class _LayerWork:
    """One prompt's layer objects in one rendition and a cache to decode them into (``layer_work``)."""

    def __init__(self, prompt: Prompt, rendition: str) -> None:
        from proto.kvobject import BlockManifest

        self.prompt = prompt
        self.codec = get_codec(rendition)
        self.blocks = [(b.block_hash, BlockManifest.decode(b.objects[0]), b.objects[1:])
                       for b in prompt.blocks]
        self.cache = empty_cache(prompt.spec, len(prompt.blocks))

    def check_and_decode(
        self, block_hash: bytes, manifest: Any, first: int, objects: Sequence[bytes]
    ) -> None:
        for object_id, payload in enumerate(objects, first):
            if not manifest.verify_payload(object_id, payload):
                raise RuntimeError(f"digest of layer {object_id - 1} differs")
            write = functools.partial(self.codec.decode_into, payload)
            self.cache.import_layer_with(block_hash, object_id - 1, write)

    def one_pass(self, pool: ThreadPoolExecutor | None) -> tuple[float, float]:
        """(wall, process CPU) seconds of one pass over every layer."""
        per_task = fetching.LAYERS_PER_TASK
        t0, c0 = time.perf_counter(), time.process_time()
        for block_hash, manifest, objects in self.blocks:
            if not self.cache.begin_import(block_hash):
                raise RuntimeError("block already cached")
            if pool is None:
                self.check_and_decode(block_hash, manifest, 1, objects)
            else:
                tasks = [
                    pool.submit(self.check_and_decode, block_hash, manifest, 1 + i, objects[i:i + per_task])
                    for i in range(0, len(objects), per_task)
                ]
                for task in tasks:
                    task.result()
            self.cache.abort_import(block_hash)
        return time.perf_counter() - t0, time.process_time() - c0


@contextmanager
def qh3_accounting() -> Iterator[collections.defaultdict[str, float]]:
    """Count, in this process, what qh3's client does per transfer: receive batches, datagrams in and out,
    and this thread's CPU seconds in its socket reads (with everything under them), in its core's
    receive, in the events it hands to the application and in its transmits (the ACKs)."""
    from qh3.asyncio import _transport as qh3_transport
    from qh3.asyncio.protocol import QuicConnectionProtocol
    from qh3.quic.connection import QuicConnection

    counts: collections.defaultdict[str, float] = collections.defaultdict(float)
    patched: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, key: str, count: Callable[..., None] | None = None) -> None:
        original = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if count is not None:
                count(*args)
            t0 = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                counts[key] += time.thread_time() - t0

        patched.append((owner, name, original))
        setattr(owner, name, wrapper)

    def received(protocol: Any, datagrams: list[bytes], *_: Any) -> None:
        counts["receive batches"] += 1
        counts["datagrams in"] += len(datagrams)

    def transmitting(protocol: Any) -> None:
        send = protocol._sendto_many
        if send is not None and not getattr(send, "counted", False):
            def sendto_many(datagrams: list[bytes], addr: Any) -> Any:
                counts["datagrams out"] += len(datagrams)
                return send(datagrams, addr)
            sendto_many.counted = True  # type: ignore[attr-defined]
            protocol._sendto_many = sendto_many

    timed(qh3_transport.OptimizedDatagramTransport, "_recv_rust", "s socket reads and all under them")
    timed(QuicConnection, "receive_many_datagrams", "s core receive")
    timed(QuicConnectionProtocol, "datagrams_received", "s batch handling", received)
    timed(QuicConnectionProtocol, "_process_events", "s events handed to the application")
    timed(QuicConnectionProtocol, "transmit", "s transmits", transmitting)
    try:
        yield counts
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def transport_counts(tokens: int, runs: int, stack: str, link: str) -> str:
    """Verified fetches and raw transfers of the same bytes alternating, ``runs`` each, from a relay (raw
    sender) on ``stack`` to this process on qh3, under ``qh3_accounting``: per MB, qh3's datagrams in
    and out (its ACKs) and its CPU by part, to compare what qh3 costs inside a fetch and raw."""
    prompt = make_prompt(tokens)
    mb = prompt.wire_bytes / 1e6
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    lines = [f"qh3 node, {stack} sender, {link}, {mb:.1f} MB per transfer; per MB (ms/MB for CPU):"]
    try:
        with common.test_certificates() as certdir, ExitStack() as stack_:
            relay = RelayFetch(prompt, certdir, stack, link, loop, peer_stack="qh3")
            stack_.callback(relay.close)
            raw = stack_.enter_context(raw_quic(certdir, stack, link, prompt.wire_bytes, "qh3"))
            for _ in range(runs):
                for name, move in (("verified fetch", relay.fetch), ("raw QUIC", raw.run)):
                    # The accounting's own wrappers cost the thread too: CPU per MB here is above the
                    # unwrapped figure of the other modes, alike for both cases.
                    with qh3_accounting() as counts:
                        sample = move()
                    parts = " ".join(f"{k.removeprefix('s ')} {1000 * v / mb:.2f}" if k.startswith("s ")
                                     else f"{k} {v / mb:.1f}" for k, v in sorted(counts.items()))
                    rate, node = mb / sample.seconds, 1000 * sample.client_cpu / mb
                    lines.append(f"  {name:15s} {rate:6.1f} MB/s, node {node:5.2f} ms/MB: {parts}")
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    lines.append(f"load {common.load_average()}")
    return "\n".join(lines)


def _figure(case: Case, prompt: Prompt) -> Figure:
    mb = prompt.wire_bytes / 1e6
    samples = case.samples
    return Figure(case.name, [mb / s.seconds for s in samples], [prompt.tokens / s.seconds for s in samples],
                  [1000 * s.server_cpu / mb for s in samples], [1000 * s.client_cpu / mb for s in samples],
                  case.failures)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (whole 64-token blocks)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--stacks", default=",".join((*STACKS, QMUX)),
                    help="QUIC stacks, and qmux: a verified fetch over QMux (TLS/TCP) from a relay's cache")
    ap.add_argument("--node-stacks", default=",".join(NODE_STACKS),
                    help="stacks of the subscribers (this process) of an aiopquic relay")
    ap.add_argument("--links", default=",".join(LINK_PRESETS))
    ap.add_argument("--no-gso-comparison", action="store_true", help="skip the aioquic cases without GSO")
    ap.add_argument("--gro-comparison", action="store_true",
                    help="add aioquic verified fetches whose client reads one datagram per wakeup (no GRO)")
    ap.add_argument("--slots-comparison", action="store_true",
                    help="add verified fetches decoding into new tensors that the cache copies ('copying') "
                         "next to decoding straight into the cache's slots")
    ap.add_argument("--verify-workers", default="", metavar="N[/K],...",
                    help="also fetch with N verify threads (BlockFetcher.verify_workers), K layers handed "
                         "to a thread at a time (default: the fetcher's), "
                         f"next to the default ({DEFAULT_VERIFY_WORKERS})")
    ap.add_argument("--fanout", default="", metavar="N,N,...",
                    help="instead: N concurrent subscriber processes fetching the prompt from one relay's "
                         "cache, for each N (first stack and link given)")
    ap.add_argument("--relay-workers", default="1", metavar="W,W,...",
                    help="with --fanout: the relay's --workers, each W interleaved with the counts (worker "
                         "caches all filled; relay CPU summed over its processes)")
    ap.add_argument("--fetch-connections", default="", metavar="N,N,...",
                    help="instead: verified fetches over QMux from a relay's cache striped over N sessions "
                         "(a node's --fetch-connections), for each N and each of --renditions, interleaved "
                         "(--relay-workers: the relay's workers, first value)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: where one verified fetch spends CPU (relay per thread, the fetching loop "
                         "under cProfile), first stack, link, node stack and rendition given")
    ap.add_argument("--layer-work", action="store_true",
                    help="instead: the node's per-layer work of a verified fetch without the network "
                         "(digest, decode into the cache's slots, import) for each of --renditions, on "
                         "this thread and on each --verify-workers count of threads, median of RUNS passes")
    ap.add_argument("--renditions", default="lossless,plain", metavar="R,R,...",
                    help="with --layer-work: the renditions measured; otherwise the verified fetches move "
                         "the first one (default lossless,plain)")
    ap.add_argument("--transport-counts", action="store_true",
                    help="instead: verified fetches and raw transfers alternating from the first stack and "
                         "link to this process on qh3, counting qh3's datagrams in and out (its ACKs) and "
                         "its CPU by part per MB")
    ap.add_argument("--kv-shape", choices=sorted(KV_SHAPES), default="bench",
                    help="the KV moved: the bench model's (16 layers, 4 KV heads of 64: 64 KiB per layer "
                         "object) or an 8B Llama-3's (32 layers, 8 KV heads of 128: 256 KiB)")
    ap.add_argument("--serve-tls", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--fanout-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global kv_shape
    kv_shape = args.kv_shape
    if args.serve_tls:
        _serve_tls_child(args.serve_tls)
        return 0
    if args.fanout_child:
        certdir, stack, link, tokens, key_hex = args.fanout_child
        _fanout_child(Path(certdir), stack, link, int(tokens), key_hex)
        return 0
    stacks = [s for s in args.stacks.split(",") if s]
    links = [x for x in args.links.split(",") if x]
    for s in stacks:
        if s not in (*STACKS, QMUX):
            ap.error(f"unknown stack {s!r}; choose from {', '.join((*STACKS, QMUX))}")
    for x in links:
        if x not in LINK_PRESETS:
            ap.error(f"unknown link {x!r}; choose from {', '.join(LINK_PRESETS)}")
    print(f"cores={os.cpu_count()}, load {common.load_average()}", flush=True)
    if args.fanout:
        try:
            counts = [int(n) for n in args.fanout.split(",") if n]
        except ValueError:
            ap.error(f"--fanout takes comma-separated integers, got {args.fanout!r}")
        if not counts or min(counts) < 1:
            ap.error("--fanout needs subscriber counts of at least 1")
        try:
            relay_workers = [int(n) for n in args.relay_workers.split(",") if n]
        except ValueError:
            ap.error(f"--relay-workers takes comma-separated integers, got {args.relay_workers!r}")
        if not relay_workers or min(relay_workers) < 1:
            ap.error("--relay-workers needs worker counts of at least 1")
        print_fanout(args.tokens, args.runs,
                     *fanout(args.tokens, args.runs, counts, stacks[0], links[0], relay_workers))
        return 0
    if args.fetch_connections:
        try:
            conns = [int(n) for n in args.fetch_connections.split(",") if n]
            relay_workers = [int(n) for n in args.relay_workers.split(",") if n]
        except ValueError:
            ap.error("--fetch-connections and --relay-workers take comma-separated integers")
        if not conns or not 1 <= min(conns) <= max(conns) <= MAX_FETCH_CONNECTIONS:
            ap.error(f"--fetch-connections needs session counts in [1, {MAX_FETCH_CONNECTIONS}]")
        if not relay_workers or min(relay_workers) < 1:
            ap.error("--relay-workers needs worker counts of at least 1")
        renditions = [r for r in args.renditions.split(",") if r]
        print_stripes(stripes(args.tokens, args.runs, conns, renditions, relay_workers[0]), args.runs)
        return 0
    if args.layer_work:
        try:
            counts = [int(w.partition("/")[0]) for w in args.verify_workers.split(",") if w] or [0]
        except ValueError:
            ap.error(f"--verify-workers takes comma-separated integers, got {args.verify_workers!r}")
        print(layer_work(args.tokens, args.runs, [r for r in args.renditions.split(",") if r], counts))
        return 0
    if args.transport_counts:
        print(transport_counts(args.tokens, args.runs, stacks[0], links[0]))
        return 0
    if args.profile:
        peer = args.node_stacks.split(",")[0] if stacks[0] == "aiopquic" else None
        first = next((r for r in args.renditions.split(",") if r), "lossless")
        print(profile(args.tokens, stacks[0], links[0], peer, first))
        return 0
    try:
        workers = tuple((int(n), int(k) if k else None)
                        for n, _, k in (w.partition("/") for w in args.verify_workers.split(",") if w))
    except ValueError:
        ap.error(f"--verify-workers takes comma-separated integers, got {args.verify_workers!r}")
    node_stacks = tuple(s for s in args.node_stacks.split(",") if s)
    for s in node_stacks:
        if s not in NODE_STACKS:
            ap.error(f"unknown node stack {s!r}; choose from {', '.join(NODE_STACKS)}")
    rendition = next((r for r in args.renditions.split(",") if r), "lossless")
    prompt, figures = run(args.tokens, args.runs, stacks, links, not args.no_gso_comparison, workers,
                          node_stacks, args.gro_comparison, args.slots_comparison, rendition)
    print(f"{prompt.tokens} tokens, {len(prompt.blocks)} blocks, {prompt.wire_bytes / 1e6:.1f} MB on the "
          f"wire ({rendition}), median of {args.runs}, interleaved; load {common.load_average()}")
    print(f"{'case':42s} {'MB/s':>7s} {'tok/s':>8s} {'srv ms/MB':>9s} {'cli ms/MB':>9s}")
    for f in figures:
        if f.failures:
            print(f"{f.name:42s} {len(f.failures)} of {args.runs} runs failed: {f.failures[0]}")
        if not f.mbps:
            continue
        print(f"{f.name:42s} {common.median(f.mbps):7.1f} {common.median(f.tokens_per_s):8.0f} "
              f"{common.median(f.server_ms_per_mb):9.2f} {common.median(f.client_ms_per_mb):9.2f}   "
              f"(runs {' '.join(f'{x:.0f}' for x in f.mbps)})")
    print(ratios(figures))
    return 0


def ratios(figures: list[Figure]) -> str:
    """The verified fetch over QMux and the best verified fetch over QUIC, each against TLS 1.3 over TCP
    moving the same bytes in the same run (the issue's target: QMux >= 0.5x)."""
    rate = {f.name: common.median(f.mbps) for f in figures if f.mbps}
    tls = rate.get(TLS_TCP_CASE)
    if not tls:
        return "no TLS 1.3 over TCP figure to compare with"
    # QMux's variants (verify workers, copying) are not QUIC.
    quic = {n: r for n, r in rate.items() if n.startswith("verified fetch") and not n.startswith(QMUX_CASE)}
    lines = []
    if QMUX_CASE in rate:
        lines.append(f"{QMUX_CASE} / {TLS_TCP_CASE}: {rate[QMUX_CASE] / tls:.2f}x")
    if quic:
        best = max(quic, key=quic.__getitem__)
        lines.append(f"best QUIC ({best}) / {TLS_TCP_CASE}: {quic[best] / tls:.2f}x")
    return "\n".join(lines)


def print_fanout(tokens: int, runs: int, prompt: Prompt, figures: list[FanoutFigure]) -> None:
    mb = prompt.wire_bytes / 1e6
    print(f"fan-out: {prompt.tokens} tokens, {mb:.1f} MB on the wire per subscriber, median of {runs}, "
          f"interleaved; load {common.load_average()}")
    print(f"{'workers':>7s} {'subscribers':>11s} {'aggregate MB/s':>14s} {'tok/s':>8s} {'per-sub MB/s':>12s} "
          f"{'tok/s':>7s} {'relay ms/MB':>11s} {'busiest':>7s} {'used':>5s}")
    for f in figures:
        if f.failures:
            print(f"{f.relay_workers:7d} {f.subscribers:11d} {len(f.failures)} of {runs} runs failed: "
                  f"{f.failures[0]}")
        if not f.aggregate_mbps:
            continue
        agg, per = common.median(f.aggregate_mbps), common.median(f.per_subscriber_mbps)
        print(f"{f.relay_workers:7d} {f.subscribers:11d} {agg:14.1f} {agg / mb * prompt.tokens:8.0f} "
              f"{per:12.1f} {per / mb * prompt.tokens:7.0f} {common.median(f.relay_ms_per_mb):11.2f} "
              f"{common.median(f.relay_busiest_core):7.2f} {''.join(str(u) for u in f.workers_used):>5s}   "
              f"(aggregate runs {' '.join(f'{x:.0f}' for x in f.aggregate_mbps)})")
    print("busiest: CPU of the relay's busiest process over the round (cores); used: per run, how many relay "
          "workers the subscribers' sessions landed on")


if __name__ == "__main__":
    sys.exit(main())
