"""The third-party MoQT stack aiomoqt against kvnet-relay on its defaults: its conformance client, and its
publisher and subscriber exchanging objects of 100 B to 64 KiB through kvnet-relay, and its subscriber
discovering a track published to kvnet-relay by PUBLISH alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from kvnet.net.config import TlsConfig
from kvnet.net.endpoint import connect
from tests.helpers.processes import (
    CertDir,
    NativeQuicUnavailable,
    RelayProcess,
    native_quic_python,
    start_relay,
    wait_for_output,
)
from tests.helpers.waiting import scaled
from tests.interop.conftest import PEER_SCRIPT, Aiomoqt

CLIENT_TIMEOUT = 300.0
PEER_DEADLINE_S = 60.0
"""The aiomoqt subscriber's own deadline for every object to arrive, on an idle machine."""
DEFAULT_CASES = 12
"""Cases ``moq-interop-client`` runs without ``-t``; ``fetch`` and ``join`` run only when named."""
OBJECT_SIZES = (100, 1200, 1400, 1500, 4096, 16384, 65536)
OBJECTS_PER_SIZE = 30


def interop_client(aiomoqt: Aiomoqt, relay: RelayProcess, *extra: str) -> dict[str, bool]:
    """Run ``moq-interop-client --draft 18`` against ``relay``; its TAP lines as {case: passed}."""
    done = subprocess.run(
        [str(aiomoqt.script("moq-interop-client")), "--draft", "18", "-r", relay.url, "--tls-disable-verify",
         *extra],
        capture_output=True, text=True, timeout=scaled(CLIENT_TIMEOUT),
    )
    results = {m[2]: m[1] is None for m in re.finditer(r"^(not )?ok \d+ - (\S+)", done.stdout, re.M)}
    assert results, done.stdout[-3000:] + done.stderr[-3000:]
    return results


def test_conformance_client_passes_every_case(aiomoqt: Aiomoqt, kvnet_relay: RelayProcess) -> None:
    results = interop_client(aiomoqt, kvnet_relay)
    assert len(results) == DEFAULT_CASES, results
    for case in ("fetch", "join"):
        results.update(interop_client(aiomoqt, kvnet_relay, "-t", case))
    failed = sorted(name for name, ok in results.items() if not ok)
    assert not failed and len(results) == DEFAULT_CASES + 2, (failed, kvnet_relay.log()[-3000:])


def test_aiomoqt_objects_of_every_size_arrive_intact(
    aiomoqt: Aiomoqt, kvnet_relay: RelayProcess, tmp_path: Path
) -> None:
    sizes = [str(s) for s in OBJECT_SIZES]
    log = tmp_path / "aiomoqt-publisher.log"
    with open(log, "wb") as out:
        publisher = subprocess.Popen(
            [str(aiomoqt.python), str(PEER_SCRIPT), "publish", kvnet_relay.url, "interop/sizes", *sizes],
            stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        wait_for_output(publisher, lambda: log.read_text(errors="replace"), "ready", "aiomoqt publisher")
        done = subprocess.run(
            [str(aiomoqt.python), str(PEER_SCRIPT), "subscribe", kvnet_relay.url, "interop/sizes",
             str(OBJECTS_PER_SIZE), *sizes],
            capture_output=True, text=True, timeout=scaled(CLIENT_TIMEOUT),
            env=dict(os.environ, AIOMOQT_PEER_DEADLINE_S=str(scaled(PEER_DEADLINE_S))),
        )
    finally:
        assert publisher.stdin is not None
        publisher.stdin.close()
        try:
            publisher.wait(timeout=scaled(30))
        except subprocess.TimeoutExpired:
            publisher.kill()
            publisher.wait()
    reports = {r["size"]: r for r in map(json.loads, re.findall(r"^\{.*\}$", done.stdout, re.M))}
    assert sorted(reports) == list(OBJECT_SIZES), done.stdout[-3000:] + done.stderr[-3000:]
    for size, report in reports.items():
        # Every object of every size: the full count, in one gapless run, each byte as generated.
        assert report["received"] == OBJECTS_PER_SIZE and report["bad"] == 0 and report["gaps"] == 0, (
            size, report, kvnet_relay.log()[-2000:]
        )
    assert done.returncode == 0


def test_conformance_client_passes_every_case_against_a_relay_on_aiopquic(
    aiomoqt: Aiomoqt, cert_dir: CertDir, tmp_path: Path
) -> None:
    """draft-18 interop is the MoQT layer's, the same on every QUIC stack: the conformance suite against a
    relay on the native stack (run from the Python 3.12 environment of ``scripts/setup-py312``)."""
    try:
        native_quic_python()
    except NativeQuicUnavailable as exc:
        pytest.skip(str(exc))
    relay = start_relay(cert_dir, tmp_path, "--quic-stack", "aiopquic", log_level="info")
    try:
        results = interop_client(aiomoqt, relay)
        for case in ("fetch", "join"):
            results.update(interop_client(aiomoqt, relay, "-t", case))
        failed = [name for name, ok in results.items() if not ok]
        assert not failed and len(results) == DEFAULT_CASES + 2, (failed, relay.log()[-3000:])
    finally:
        relay.stop()


DISCOVERY_DURATION_S = 10
"""How long aiomoqt's subscriber runs: discovery, then objects for the rest."""


async def test_aiomoqt_subscriber_discovers_a_bare_published_track(
    aiomoqt: Aiomoqt, kvnet_relay: RelayProcess, cert_dir: CertDir
) -> None:
    """aiomoqt's own subscriber without ``-T`` (draft 18: SUBSCRIBE_NAMESPACE, wait for NAMESPACE, then
    SUBSCRIBE_TRACKS and PUBLISH) receives a track that reached kvnet-relay by PUBLISH alone, with no
    PUBLISH_NAMESPACE: the relay must announce that namespace to it."""
    pub = await connect(kvnet_relay.url, tls=TlsConfig(ca_file=cert_dir.ca))
    ok = await pub.publish((b"interop", b"bare"), b"stream", 1)
    subscriber = await asyncio.create_subprocess_exec(
        str(aiomoqt.python), "-m", "aiomoqt.examples.sub_example", kvnet_relay.url, "-k", "--draft", "18",
        "-N", "interop/bare", "-t", str(DISCOVERY_DURATION_S),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    sent = 0
    try:
        group = 0
        while subscriber.returncode is None:  # a steady live track for as long as the subscriber runs
            sid = pub.open_subgroup(1, group, 0, first_object=True)
            for i in range(10):
                pub.send_subgroup_object(sid, i, f"g{group}o{i}".encode().ljust(500, b"."))
            pub.close_subgroup(sid)
            sent += 10
            group += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(subscriber.wait(), 0.2)  # paces the track: 50 objects/s
        output = (await subscriber.communicate())[0].decode(errors="replace")
    finally:
        if subscriber.returncode is None:
            subscriber.kill()
            await subscriber.wait()
        pub.publish_done(ok.request_id, 0x2, "done")
        await pub.close_session()
    assert "Discovered: interop/bare/stream" in output, output[-3000:] + kvnet_relay.log()[-2000:]
    total = re.search(r"Total: ([\d,]+) objects", output)
    assert total is not None and int(total[1].replace(",", "")) >= 10, output[-3000:]
