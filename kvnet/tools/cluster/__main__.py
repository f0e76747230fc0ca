"""Command line of the namespace cluster (``scripts/netns-cluster``): up, smoke, down, status.

Flags also come from ``KVNET_CLUSTER_<FLAG>``; its own log lines are in the format of every kvnet process."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from kvnet.config import config_parser, parse_config
from kvnet.logs import LOG_SETTINGS_ENV, add_log_arguments, setup_logging_from_args

from .compose import ComposeError, load_compose
from .plan import DEFAULT_LOSS, DEFAULT_PREFIX, upstream_links
from .runner import ClusterError, NetnsCluster, list_namespaces, netns_available, teardown
from .smoke import run_smoke


def _build_parser() -> argparse.ArgumentParser:
    p = config_parser(
        "netns-cluster", "Run docker-compose.yml's services as processes in Linux network namespaces (root).",
        config_file=False,
    )
    p.add_argument("command", choices=("up", "smoke", "down", "status"))
    p.add_argument("--compose", type=Path, default=Path("docker-compose.yml"), help="compose file")
    p.add_argument("--run-dir", type=Path, default=Path("run/netns-cluster"), help="logs, volumes, state")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="name prefix of namespaces (unique per cluster)")
    p.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay on each origin<->edge path")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=DEFAULT_LOSS, help="loss probability per direction")
    p.add_argument("--reorder", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=0.0, help="origin<->edge rate limit (0 = none)")
    add_log_arguments(p)
    return p


def _raise_interrupt(signum: int, _frame: object) -> None:
    # SIGTERM/SIGHUP take the same path as Ctrl-C, so every `finally` and `except BaseException` tears down.
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_config(_build_parser(), argv, env_prefix="KVNET_CLUSTER_")
    setup_logging_from_args(args)
    # The services the runner starts log in the same format (NetnsCluster.base_env passes these on).
    os.environ[LOG_SETTINGS_ENV["log_format"]] = args.log_format
    os.environ[LOG_SETTINGS_ENV["log_level"]] = "debug" if args.verbose else args.log_level
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    if args.command == "down":
        removed = teardown(args.prefix)
        print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if args.command == "status":
        names = list_namespaces(args.prefix)
        print("\n".join(names) if names else f"no cluster with prefix {args.prefix!r}")
        return 0
    reason = netns_available()
    if reason is not None:
        print(f"netns-cluster: {reason}", file=sys.stderr)
        return 2
    project = load_compose(args.compose)
    shape = {
        "delay_ms": args.delay_ms,
        "jitter_ms": args.jitter_ms,
        "loss": args.loss,
        "reorder": args.reorder,
        "rate_bytes_per_s": args.rate_mbit * 1e6 / 8,
    }
    cluster = NetnsCluster(project, args.run_dir, args.prefix, upstream_links(project, **shape))
    try:
        if args.command == "up":
            cluster.up()
            print(f"cluster {args.prefix!r} is up; logs in {cluster.run_dir / 'logs'}")
            for name in project.services:
                ns = cluster.plan.namespaces[name]
                addrs = [i.address for i in cluster.plan.interfaces if i.namespace == ns]
                print(f"  {name:8} {ns:20} {' '.join(addrs)}")
            return 0
        already_up = bool(list_namespaces(args.prefix))
        if not already_up:
            cluster.up()
        try:
            demo = run_smoke(cluster)
        finally:
            if not already_up:
                cluster.down()
        print(f"smoke ok: {demo.summary()}")
        return 0
    except KeyboardInterrupt:
        print("interrupted; cluster torn down", file=sys.stderr)
        return 130
    except (ClusterError, ComposeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"netns-cluster: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
