"""The sans-I/O QMux core alone (proto.qmux_connection): CPU per MB to frame and to parse one stream.

Two connections in memory, no TLS and no socket: the sender frames ``--size`` MiB of one stream in
batches of ``--batch`` MiB (as a transport adapter asks for what its write buffer takes), the receiver
parses it in reads of ``--read`` KiB (what a TLS read returns) and credits it back. Per record size
(the receiver's ``max_record_size``: the draft's default 16382 and kvnet's 1 MiB) it prints the
median of ``--runs`` runs of sender and receiver CPU ms/MB (``time.process_time``) and the load.
This is the floor QMux adds to TLS over TCP; the end-to-end path is ``bench_datapath.py``'s.
Run: ``python benchmarks/bench_qmux.py [--size 256] [--runs 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proto.qmux_connection import QMuxConfiguration, QMuxConnection
from proto.qmux_events import StreamDataReceived


def one_run(record_size: int, size: int, batch: int, read: int) -> tuple[float, float]:
    """(sender, receiver) CPU seconds to move ``size`` bytes on one stream."""
    client = QMuxConnection(QMuxConfiguration(is_client=True))
    server = QMuxConnection(QMuxConfiguration(is_client=False, max_record_size=record_size))
    client.connection_made(0.0)
    server.connection_made(0.0)
    server.receive_data(client.data_to_send(0.0), 0.0)
    client.receive_data(server.data_to_send(0.0), 0.0)
    block = bytes(1 << 20)
    sent = got = 0
    send_cpu = recv_cpu = 0.0
    while got < size:
        start = time.process_time()
        while sent < size and client.unsent(0) < 2 * batch:
            client.send_stream_data(0, block, end_stream=sent + len(block) >= size)
            sent += len(block)
        out = memoryview(client.data_to_send(0.0, batch))
        framed = time.process_time()
        for pos in range(0, len(out), read):
            server.receive_data(out[pos : pos + read], 0.0)
            while (event := server.next_event()) is not None:
                if isinstance(event, StreamDataReceived):
                    got += len(event.data)
        credit = server.data_to_send(0.0)
        parsed = time.process_time()
        client.receive_data(credit, 0.0)
        send_cpu += framed - start + time.process_time() - parsed
        recv_cpu += parsed - framed
    return send_cpu, recv_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="MiB moved per run")
    parser.add_argument("--batch", type=int, default=4, help="MiB framed per data_to_send call")
    parser.add_argument("--read", type=int, default=64, help="KiB per receive_data call")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"load {os.getloadavg()[0]:.1f}; {args.size} MiB per run, median of {args.runs}")
    mb = (args.size << 20) / 1e6
    for record_size in (16382, 1 << 20):
        runs = [one_run(record_size, args.size << 20, args.batch << 20, args.read << 10)
                for _ in range(args.runs)]
        send = statistics.median(r[0] for r in runs) * 1000 / mb
        recv = statistics.median(r[1] for r in runs) * 1000 / mb
        print(f"max_record_size {record_size:>8}: sender {send:.2f} ms/MB, receiver {recv:.2f} ms/MB")


if __name__ == "__main__":
    main()
