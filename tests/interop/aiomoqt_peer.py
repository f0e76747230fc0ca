"""A publisher or subscriber made of the third-party MoQT stack aiomoqt, for the interoperability tests.

Runs under the separate Python 3.12 venv of ``scripts/setup-aiomoqt`` (never imported by the tests):

    python aiomoqt_peer.py publish moqt://HOST:PORT NAMESPACE SIZE [SIZE ...]
    python aiomoqt_peer.py subscribe moqt://HOST:PORT NAMESPACE COUNT SIZE [SIZE ...]

The publisher announces NAMESPACE and serves one track per size (``size-<SIZE>``) with aiomoqt's own
object generator, whose bytes are predictable: object {g, o} of a SIZE track is
``(f"{g}.{o}|" + bytes(i & 0xFF for i in range(SIZE)))[:SIZE]``. It prints ``ready`` once announced and runs
until stdin closes. The subscriber subscribes to every size track, checks every object against that
pattern and that each track's objects form one gapless run, and prints one JSON line per track
(``size``, ``received``, ``bad``, ``gaps``, ``sha256`` of the payloads in order) once COUNT objects of every
track arrived; exit status 1 if they did not within its deadline (``DEADLINE`` seconds, or
``AIOMOQT_PEER_DEADLINE_S`` from the environment: the test scales it by the load).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import sys
from typing import Any

from aiomoqt.client import MOQTClient
from aiomoqt.track import PublishedTrack, SubscribedTrack
from aiomoqt.utils.url import parse_relay_url

GROUP_SIZE = 10
RATE = 50.0
"""Objects per second per track."""
DEADLINE = float(os.environ.get("AIOMOQT_PEER_DEADLINE_S", "60"))


def expected_payload(group: int, obj: int, size: int) -> bytes:
    return (f"{group}.{obj}|".encode() + bytes(i & 0xFF for i in range(size)))[:size]


def client(url: str) -> MOQTClient:
    relay = parse_relay_url(url)
    return MOQTClient(relay.host, relay.port, path=relay.path or "", use_quic=relay.use_quic,
                      verify_tls=False, supported_drafts=18)


async def publish(url: str, namespace: str, sizes: list[int]) -> None:
    async with client(url).connect() as session:
        await session.client_session_init()
        tracks = []
        for i, size in enumerate(sizes):
            track = PublishedTrack(session, namespace=namespace, trackname=f"size-{size}", object_size=size,
                                   group_size=GROUP_SIZE, rate=RATE)
            track._quiet = True
            if i == 0:
                await track.publish(announce_namespace=True, publish_track=False)
            else:
                track.attach(session)  # serves SUBSCRIBEs for it under the namespace announced above
            tracks.append(track)
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        session.close()


async def subscribe(url: str, namespace: str, count: int, sizes: list[int]) -> int:
    received: dict[int, list[tuple[int, int, bytes]]] = {size: [] for size in sizes}
    progress = asyncio.Event()

    def on_object_for(size: int) -> Any:
        def on_object(msg: Any, _size: int, _recv: int, group_id: int | None = None, *_: Any) -> None:
            group = getattr(msg, "group_id", group_id)
            payload = bytes(getattr(msg, "payload", b"") or b"")
            if payload and group is not None:  # with no group it cannot be placed: counted missing
                received[size].append((group, msg.object_id, payload))
                progress.set()
        return on_object

    async with client(url).connect() as session:
        await session.client_session_init()
        for size in sizes:
            track = SubscribedTrack(session, namespace, f"size-{size}", on_object=on_object_for(size))
            track._quiet = True
            await track.subscribe()
        try:
            async with asyncio.timeout(DEADLINE):
                while any(len(objs) < count for objs in received.values()):
                    progress.clear()
                    await progress.wait()
        except TimeoutError:
            pass
        session.close()
    complete = True
    for size, objs in received.items():
        ordered = sorted(objs, key=lambda o: (o[0], o[1]))[:count]
        bad = sum(payload != expected_payload(g, o, size) for g, o, payload in ordered)
        positions = [g * GROUP_SIZE + o for g, o, _ in ordered]
        gaps = sum(b - a != 1 for a, b in itertools.pairwise(positions))
        digest = hashlib.sha256(b"".join(p for _, _, p in ordered)).hexdigest()
        report = {"size": size, "received": len(ordered), "bad": bad, "gaps": gaps, "sha256": digest}
        print(json.dumps(report), flush=True)
        complete = complete and len(ordered) == count
    return 0 if complete else 1


def main(argv: list[str]) -> int:
    mode, url, namespace, *rest = argv
    if mode == "publish":
        asyncio.run(publish(url, namespace, [int(s) for s in rest]))
        return 0
    count, *sizes = (int(s) for s in rest)
    return asyncio.run(subscribe(url, namespace, count, sizes))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
