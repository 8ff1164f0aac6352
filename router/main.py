"""`kimiserve router`: the public gRPC API in front of the tokenizer service and the shards."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kimiserve import internal_auth, security, tracing
from kimiserve.decode_guard import AioDecodeGuard
from kimiserve.limits import MAX_REQUEST_BYTES, MAX_TOKENIZER_REPLY_BYTES
from kimiserve.ports import SERVER_OPTIONS, serve_metrics
from kimiserve.v1 import router_pb2, router_pb2_grpc
from router.admission import Admission
from router.batch.config import BatchConfig  # batch jobs (router/batch)
from router.batch.errors import BatchStoreError
from router.batch.setup import BatchWiring, add_batch_args, batch_config_from_args, default_db_path
from router.discovery import ShardDiscovery, dns_resolver, split_host_port, static_resolver
from router.generation import Generation
from router.http.app import build_app  # the OpenAI-compatible HTTP API (router/http)
from router.http.batches import Batches
from router.http.origin import LOCAL_HOSTS, allowed_hosts
from router.http.server import HttpServer
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.service import RouterService
from router.shard_client import ShardClient
from router.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
# On SIGTERM, in-flight requests and running batch requests may finish for this long. `kimiserve up` waits this
# long (plus the router's own teardown) before it kills a stopping router, and passes its --drain-timeout on.
DRAIN_TIMEOUT_S = 60.0
# gRPC's default reconnect backoff grows to 120 s: a shard or tokenizer restarted after a long outage would then sit
# unused for up to two minutes. Reconnect attempts at most 2 s apart cost nothing on a cluster network.
UPSTREAM_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 2000)]


@dataclass(frozen=True)
class RouterConfig:
    host: str
    port: int
    metrics_port: int
    tokenizer: str
    shards: tuple[str, ...]
    max_in_flight: int
    max_queued: int
    default_max_tokens: int
    drain_timeout_s: float
    # -- deployment: shard discovery and security (kimiserve/security.py, router/discovery.py) --
    shards_dns: str | None = None  # NAME:PORT re-resolved every discovery_interval_s (a headless Service)
    discovery_interval_s: float = 5.0
    tls: security.ServerTls | None = None  # TLS (and with a client CA, mTLS) on the public port
    upstream_tls: security.UpstreamTls | None = None  # TLS / mTLS to the tokenizer and the shards
    api_keys_file: str | None = None  # keys for `authorization: Bearer`; None: no API-key check
    health_port: int | None = None  # plaintext grpc.health.v1-only port (kubelet probes when TLS is on)
    batch: BatchConfig | None = None  # batch jobs (router/batch/setup.py); None: defaults, db in the cache dir
    http_port: int = 0  # the OpenAI-compatible HTTP API (router/http) on host:http_port; 0: off
    http_max_body_bytes: int = 16 << 20  # larger HTTP request bodies are refused with 413
    internal_token_file: Path | None = None  # sent on every tokenizer and shard call (kimiserve/internal_auth.py)
    http_allowed_hosts: tuple[str, ...] = LOCAL_HOSTS  # Host / Origin accepted without API keys (router/http/origin.py)
    http_header_timeout_s: float = 10.0  # a request head must be complete this soon (router/http/protocol.py)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9100)
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer service address host:port, or dns:///NAME:PORT to spread over all its pods")
    p.add_argument("--shards", default="", help="comma-separated shard addresses host:port")
    p.add_argument("--shards-dns", default=None, metavar="NAME:PORT",
                   help="find shards by resolving NAME (e.g. a headless Service) every --discovery-interval")
    p.add_argument("--discovery-interval", type=float, default=5.0, help="seconds between --shards-dns lookups")
    p.add_argument("--max-in-flight", type=int, default=256, help="requests at the shards at once")
    p.add_argument("--max-queued", type=int, default=1024, help="requests waiting beyond that; then refused")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S,
                   help="seconds in-flight requests may finish after SIGTERM")
    p.add_argument("--api-keys-file", default=None,
                   help="file of API keys, `KEY [TENANT [admin]]` per line: clients must send `authorization: "
                        "Bearer <key>`; files and batches belong to the key's tenant (README, Deploy)")
    p.add_argument("--http-port", type=int, default=0,
                   help="also serve the OpenAI-compatible HTTP API on this port (same host, TLS and API keys); 0: off")
    p.add_argument("--http-max-body-bytes", type=int, default=16 << 20,
                   help="HTTP request bodies above this size are refused with 413")
    p.add_argument("--http-header-timeout", type=_positive_seconds, default=10.0, metavar="S",
                   help="an HTTP connection whose request head (request line and headers) is not complete S seconds "
                        "after it opened, or after a later request on it began, is closed")
    p.add_argument("--http-allowed-hosts", type=allowed_hosts, default=LOCAL_HOSTS, metavar="HOST,...",
                   help="without --api-keys-file, HTTP requests whose Host or Origin names another host are refused "
                        "(browser CSRF, DNS rebinding); the names a proxy or a Service forwards as Host go here. "
                        "`*`: accept any (the default: localhost,127.0.0.1,::1)")
    security.add_server_tls_args(p)
    security.add_upstream_tls_args(p)
    internal_auth.add_client_args(p)
    add_batch_args(p)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    shards = tuple(s.strip() for s in a.shards.split(",") if s.strip())
    if not shards and not a.shards_dns:
        raise SystemExit("kimiserve router: give --shards host:port,... and/or --shards-dns NAME:PORT")
    if a.shards_dns:
        split_host_port(a.shards_dns)  # refuses a malformed NAME:PORT at startup
    return RouterConfig(a.host, a.port, a.metrics_port, a.tokenizer, shards, a.max_in_flight, a.max_queued,
                        a.default_max_tokens, a.drain_timeout, a.shards_dns, a.discovery_interval,
                        security.server_tls_from_args(a), security.upstream_tls_from_args(a), a.api_keys_file,
                        a.health_port, http_port=a.http_port, http_max_body_bytes=a.http_max_body_bytes,
                        internal_token_file=a.internal_token_file, http_allowed_hosts=a.http_allowed_hosts,
                        http_header_timeout_s=a.http_header_timeout)


async def serve(cfg: RouterConfig, stop: asyncio.Event) -> None:
    metrics = RouterMetrics()
    token = internal_auth.read_token(cfg.internal_token_file) if cfg.internal_token_file else None
    upstream_interceptors = internal_auth.client_interceptors(token)
    # round_robin: with `dns:///NAME:PORT` (a headless Service) requests spread over every tokenizer pod.
    tokenizer = TokenizerClient(cfg.tokenizer, channel=security.aio_channel(
        cfg.tokenizer, cfg.upstream_tls, options=[("grpc.lb_policy_name", "round_robin"), *UPSTREAM_OPTIONS,
                                                  ("grpc.max_receive_message_length", MAX_TOKENIZER_REPLY_BYTES)],
        interceptors=upstream_interceptors))
    try:
        await tokenizer.load_info()
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # a deployment mistake: one clear line, not a traceback
            raise security.SecurityConfigError(
                f"the tokenizer at {cfg.tokenizer} refuses the router ({e.details()}): start the router with the "
                "tokenizer's --internal-token-file, or with a client certificate its --client-ca accepts") from None
        raise
    shards: list[ShardClient] = []  # filled and kept current by discovery; Generation holds this same list
    prefixes = PrefixIndex()

    def forget_shard(address: str) -> None:
        _forget_shard_metrics(metrics, address)
        prefixes.forget(address)

    discovery = ShardDiscovery(
        shards, [static_resolver(cfg.shards)] + ([dns_resolver(cfg.shards_dns)] if cfg.shards_dns else []),
        make_client=lambda addr: ShardClient(addr, channel=security.aio_channel(
            addr, cfg.upstream_tls, options=UPSTREAM_OPTIONS, interceptors=upstream_interceptors)),
        interval_s=cfg.discovery_interval_s, drain_timeout_s=cfg.drain_timeout_s,
        on_removed=forget_shard)
    await discovery.refresh()
    discovery.start()
    generation = Generation(shards, tokenizer, Admission(cfg.max_in_flight, cfg.max_queued, metrics), metrics,
                            cfg.default_max_tokens, prefixes)
    api_keys = security.ApiKeys(cfg.api_keys_file) if cfg.api_keys_file else None
    interceptors = [security.ApiKeyInterceptor(api_keys)] if api_keys else []
    interceptors.append(AioDecodeGuard())  # last: a refused key is answered before the body is looked at
    server = grpc.aio.server(interceptors=interceptors,
                             options=[*SERVER_OPTIONS, ("grpc.max_receive_message_length", MAX_REQUEST_BYTES)])
    # -- batch jobs (router/batch): SQLite store, runner, and the batch RPCs on the same Router service --
    batches = BatchWiring(cfg.batch or BatchConfig(default_db_path(), owner=f"{cfg.host}:{cfg.port}"),
                          generation, metrics)
    servicer = RouterService(generation, batches.runner)
    http = (HttpServer(build_app(generation, Batches(batches.runner, batches.files, lambda: generation.model_info()
                                                    .model_name), api_keys, cfg.http_max_body_bytes,
                                 cfg.http_allowed_hosts),
                       cfg.host, cfg.http_port, cfg.tls, cfg.drain_timeout_s, cfg.http_header_timeout_s)
            if cfg.http_port else None)
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    # grpcio's servicer answers SERVING for "" from birth: until a shard is in rotation every request would be
    # refused UNAVAILABLE, so the router says NOT_SERVING first (up, probes and clients waiting on health see it).
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    security.bind(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    health_server = (security.health_only_server_aio(health_servicer, cfg.host, cfg.health_port)
                     if cfg.health_port is not None else None)
    serve_metrics(cfg.host, cfg.metrics_port, metrics.registry)
    await server.start()
    if http is not None:
        http.start()
    if health_server is not None:
        await health_server.start()
    # SERVING only once a request could be served; a stop while waiting (no shard ever healthy) still stops.
    while not any(s.view.healthy for s in shards) and not stop.is_set():
        await asyncio.sleep(0.1)
    if not stop.is_set():
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    batches.start()  # resumes the batches left unfinished by an earlier run
    log.info("router serving", extra={"address": f"{cfg.host}:{cfg.port}", "shards": discovery.addresses,
                                      "shards_dns": cfg.shards_dns, "tokenizer": cfg.tokenizer,
                                      "metrics_port": cfg.metrics_port, "tls": cfg.tls is not None,
                                      "mtls_clients": bool(cfg.tls and cfg.tls.client_ca),
                                      "upstream_tls": cfg.upstream_tls is not None,
                                      "internal_token": cfg.internal_token_file is not None,
                                      "api_keys": cfg.api_keys_file is not None, "health_port": cfg.health_port,
                                      "http_port": cfg.http_port or None})
    watcher = asyncio.create_task(_export_shard_health(shards, metrics))
    await stop.wait()
    log.info("router draining", extra={"timeout_s": cfg.drain_timeout_s})
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await asyncio.gather(server.stop(grace=cfg.drain_timeout_s), batches.stop(cfg.drain_timeout_s),
                         *([http.stop()] if http else []))
    batches.close()  # after both front ends have stopped reading batches and files
    watcher.cancel()
    await discovery.stop()
    if health_server is not None:
        await health_server.stop(None)
    for shard in shards:
        await shard.close()
    await tokenizer.close()


async def _export_shard_health(shards: list[ShardClient], metrics: RouterMetrics) -> None:
    while True:
        for shard in shards:
            metrics.shard_healthy.labels(shard.address).set(1 if shard.view.healthy else 0)
        await asyncio.sleep(0.5)


def _forget_shard_metrics(metrics: RouterMetrics, address: str) -> None:
    """A shard that left discovery stops being exported, so it does not read as a shard that is down."""
    try:
        metrics.shard_healthy.remove(address)
    except KeyError:
        pass


def run(args: argparse.Namespace) -> int:
    cfg = dataclasses.replace(config_from_args(args), batch=batch_config_from_args(args))
    tracing.setup_or_exit("router")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    try:
        asyncio.run(main())
    except BatchStoreError as e:  # e.g. --batch-db on a read-only or full disk: one clear line, no traceback
        log.error("router cannot start: %s", e, extra={"db": str(cfg.batch.db_path)})
        return 2
    return 0
