"""The smoke check of a running namespace cluster (also the one-line demo of docs/cluster.md): publish at
site a, fetch at site b through both edges and the origin, and require a verified remote hit."""

from __future__ import annotations

import json
import logging
from typing import Any

from .runner import ClusterError, NetnsCluster

logger = logging.getLogger(__name__)

SMOKE_PROMPT = (
    "You are a careful assistant for the kvnet cluster. The shared context below is the same for every user "
    "of this deployment, so its KV cache is computed once and fetched by everyone else. " * 3
)


def subscriber_argv(edge: str, prompt: str, *extra: str) -> list[str]:
    """The one-shot subscriber command run inside a subscriber service (``docker compose exec sub-b ...``)."""
    return [
        "kvnet-subscriber", "--relay", f"moqt://{edge}:4443", "--ca", "/certs/ca.pem",
        "--trust", "/keys/pub-a", "--trust", "/keys/pub-b", "--abr", "fetch",
        "--prompt", prompt, "--json", "--verify", *extra,
    ]


def run_smoke(cluster: NetnsCluster, prompt: str = SMOKE_PROMPT) -> dict[str, Any]:
    """Publish ``prompt`` at pub-a (site a), ask for it from sub-b (site b, through both edges and the origin)
    and check the verified remote hit. Returns the subscriber's report."""
    published = cluster.http_json("pub-a", 8000, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
    logger.info("pub-a answered: %s", json.dumps(published.get("usage", {})))
    argv = subscriber_argv("edge-b", prompt + " Question: what is kvnet?")
    proc = cluster.exec("sub-b", argv, timeout_s=120)
    if proc.returncode != 0:
        raise ClusterError(f"subscriber failed ({proc.returncode}): {proc.stderr.strip()[-3000:]}")
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if report.get("verified") is not True or report.get("remote_hit_tokens", 0) <= 0:
        raise ClusterError(f"no verified remote hit: {json.dumps(report)}")
    return report
