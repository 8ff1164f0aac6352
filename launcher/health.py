"""Client side of grpc.health.v1: wait until a service reports SERVING."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def is_serving(address: str, timeout: float = 1.0) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def wait_serving(address: str, deadline_s: float, alive=lambda: True) -> None:
    """Polls until SERVING; raises TimeoutError after `deadline_s`, RuntimeError if `alive()` turns false."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not alive():
            raise RuntimeError(f"the process serving {address} exited before it was SERVING")
        if is_serving(address):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{address} was not SERVING after {deadline_s:.0f} s")
