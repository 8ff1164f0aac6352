# syntax=docker/dockerfile:1
# The one image all three kimiserve components run; helm/kimiserve starts it as `kimiserve router|tokenizer|shard`.
#   docker build -t ghcr.io/kimiserve/kimiserve:0.1.0 .
# GPU shards: PyPI's torch wheels for linux x86_64 carry their CUDA runtime, so the node needs only the NVIDIA
# driver and device plugin. Triton compiles its kernel launchers with the C compiler at run time: gcc stays in.
# The weight-streaming engine (C++ in native/, shipped inside the package) is compiled here, in the build stage, into
# KIMISERVE_NATIVE_CACHE; the runtime loads that build read-only and needs no C++ compiler.
# No model is baked in: the chart mounts the checkpoint and passes --model (`kimiserve up` without --model serves the
# models/ of a source checkout, which an installed package does not have; it says so and asks for --model).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.14.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 KIMISERVE_NATIVE_CACHE=/opt/kimiserve/native
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kimiserve
ENV PATH=/opt/kimiserve/bin:$PATH
# torch first, pinned: its own layer, reused while the code changes.
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kimiserve ./kimiserve
COPY launcher ./launcher
COPY router ./router
COPY shard_svc ./shard_svc
COPY tokenizer_svc ./tokenizer_svc
COPY protos ./protos
COPY native ./native
# The native build runs outside /src, so it compiles the installed package's source, as the runtime will load it.
RUN pip install . && kimiserve --help >/dev/null \
    && cd / && python -m native.build --direct

FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 kimiserve \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kimiserve
COPY --from=build /opt/kimiserve /opt/kimiserve
ENV PATH=/opt/kimiserve/bin:$PATH \
    KIMISERVE_NATIVE_CACHE=/opt/kimiserve/native \
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
