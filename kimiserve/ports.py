"""Ports: free localhost ports for child services (tests and `kimiserve up`), and the refusal to share one.

gRPC servers set SO_REUSEPORT by default, so a second server on a taken port starts "fine" and the kernel splits
connections between the two: two stacks silently serving each other's clients. Every kimiserve server turns it
off (SERVER_OPTIONS), and `up` checks its ports before starting anything.
"""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.registry import REGISTRY

SERVER_OPTIONS = [("grpc.so_reuseport", 0)]


class PortInUse(OSError):
    """A port kimiserve was asked to serve on is taken; the message names it."""


def check_free(host: str, port: int, what: str) -> None:
    """Raises PortInUse when `port` on `host` cannot be bound (without SO_REUSEPORT)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUse(f"{what} port {host}:{port} is in use ({e.strerror}); another kimiserve stack? "
                            f"Choose another with --port") from None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports. All sockets stay open until every port is chosen, so the OS cannot hand the
    same port out twice within one call."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


def serve_metrics(host: str, port: int, registry: CollectorRegistry = REGISTRY) -> None:
    """Prometheus /metrics on host:port in a daemon thread; PortInUse (one line in the CLI) when it cannot bind."""
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise PortInUse(f"cannot serve /metrics on {host}:{port}: {e.strerror or e}; choose another with "
                        f"--metrics-port") from None
