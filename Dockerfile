# syntax=docker/dockerfile:1
# The one image all three kimiserve components run; helm/kimiserve starts it as `kimiserve router|tokenizer|shard`.
#   docker build -t ghcr.io/kimiserve/kimiserve:0.1.0 .
# GPU shards: PyPI's torch wheels for linux x86_64 carry their CUDA runtime, so the node needs only the NVIDIA
# driver and device plugin. Triton compiles its kernel launchers with the C compiler at run time: gcc stays in.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.14.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kimiserve
ENV PATH=/opt/kimiserve/bin:$PATH
# torch first, pinned: its own layer, reused while the code changes.
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kimiserve ./kimiserve
COPY router ./router
COPY shard_svc ./shard_svc
COPY tokenizer_svc ./tokenizer_svc
COPY protos ./protos
RUN pip install . && kimiserve --help >/dev/null

FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 kimiserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kimiserve
COPY --from=build /opt/kimiserve /opt/kimiserve
ENV PATH=/opt/kimiserve/bin:$PATH \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    PYTHONUNBUFFERED=1
# The chart's podSecurityContext runs as this user, with a read-only root filesystem and /tmp an emptyDir.
USER 10001:10001
WORKDIR /tmp
# gRPC: router 50051, tokenizer 50052, shard 50061; health-only (TLS on): 50050, 50053, 50060;
# Prometheus /metrics: router 9100, shard 9101, tokenizer 9102 (the chart's defaults).
EXPOSE 50051 50052 50061 50050 50053 50060 9100 9101 9102 8000
ENTRYPOINT ["kimiserve"]
CMD ["--help"]
