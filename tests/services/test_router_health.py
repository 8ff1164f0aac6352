"""The router's health says SERVING only once a request could be served: grpcio's health servicer answers SERVING
for "" from the moment it exists, which let `up`, probes and clients send requests that could only be refused."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kimiserve.ports import free_ports


def _status(address: str) -> int | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
    except grpc.RpcError:
        return None  # not listening yet


def test_a_router_without_a_healthy_shard_answers_not_serving(stack):
    port, metrics, dead_shard = free_ports(3)
    router = subprocess.Popen([sys.executable, "-m", "launcher.cli", "router", "--tokenizer",
                               stack.children["tokenizer"].address, "--shards", f"127.0.0.1:{dead_shard}",
                               "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics),
                               "--drain-timeout", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        seen, end = None, time.monotonic() + 60
        while seen is None and time.monotonic() < end:
            seen = _status(f"127.0.0.1:{port}")
            time.sleep(0.2)
        assert seen == health_pb2.HealthCheckResponse.NOT_SERVING
        time.sleep(1.0)  # several shard polls later, still no shard: still not serving
        assert _status(f"127.0.0.1:{port}") == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        router.terminate()
        router.wait(timeout=30)
