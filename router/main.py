"""`kimiserve router`: the public gRPC API in front of the tokenizer service and the shards."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kimiserve.v1 import router_pb2, router_pb2_grpc
from router.admission import Admission
from router.generation import Generation
from router.metrics import RouterMetrics
from router.service import RouterService
from router.shard_client import ShardClient
from router.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)
SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


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


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--metrics-port", type=int, default=9100)
    p.add_argument("--tokenizer", required=True, help="tokenizer service address host:port")
    p.add_argument("--shards", required=True, help="comma-separated shard addresses host:port")
    p.add_argument("--max-in-flight", type=int, default=256, help="requests at the shards at once")
    p.add_argument("--max-queued", type=int, default=1024, help="requests waiting beyond that; then refused")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--drain-timeout", type=float, default=60.0)


def config_from_args(a: argparse.Namespace) -> RouterConfig:
    shards = tuple(s.strip() for s in a.shards.split(",") if s.strip())
    return RouterConfig(a.host, a.port, a.metrics_port, a.tokenizer, shards, a.max_in_flight, a.max_queued,
                        a.default_max_tokens, a.drain_timeout)


async def serve(cfg: RouterConfig, stop: asyncio.Event) -> None:
    metrics = RouterMetrics()
    tokenizer = TokenizerClient(cfg.tokenizer)
    await tokenizer.load_info()
    shards = [ShardClient(addr) for addr in cfg.shards]
    for shard in shards:
        shard.start()
    generation = Generation(shards, tokenizer, Admission(cfg.max_in_flight, cfg.max_queued, metrics), metrics,
                            cfg.default_max_tokens)
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(RouterService(generation), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    start_http_server(cfg.metrics_port, addr=cfg.host, registry=metrics.registry)
    await server.start()
    while not any(s.view.healthy for s in shards):  # SERVING only once a request could be served
        await asyncio.sleep(0.1)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("router serving", extra={"address": f"{cfg.host}:{cfg.port}", "shards": list(cfg.shards),
                                      "tokenizer": cfg.tokenizer, "metrics_port": cfg.metrics_port})
    watcher = asyncio.create_task(_export_shard_health(shards, metrics))
    await stop.wait()
    log.info("router draining", extra={"timeout_s": cfg.drain_timeout_s})
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=cfg.drain_timeout_s)
    watcher.cancel()
    for shard in shards:
        await shard.close()
    await tokenizer.close()


async def _export_shard_health(shards: list[ShardClient], metrics: RouterMetrics) -> None:
    while True:
        for shard in shards:
            metrics.shard_healthy.labels(shard.address).set(1 if shard.view.healthy else 0)
        await asyncio.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(cfg, stop)

    asyncio.run(main())
    return 0
