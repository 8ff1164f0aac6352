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


class _Range:
    """Ports handed out in turn from [lo, hi) (see `use_range`); None: the kernel picks (bind to port 0)."""
    span: tuple[int, int] | None = None
    cursor = 0


def use_range(lo: int, hi: int) -> None:
    """Hand out this process's free ports from [lo, hi), in turn, instead of the kernel's ephemeral ports. A port chosen
    by binding port 0 is closed again until the child meant for it binds it, and meanwhile it can become the source
    port of any outgoing connection on the machine (they draw from the same ephemeral range) or another process's
    choice: the child then dies with "Address already in use". The test suite gives each xdist worker its own slice
    below the ephemeral range (tests/conftest.py), where neither can happen; processes it starts pick as before."""
    _Range.span, _Range.cursor = (lo, hi), 0


def _bind_next(host: str) -> socket.socket:
    if _Range.span is None:
        s = socket.socket()
        s.bind((host, 0))
        return s
    lo, hi = _Range.span
    for _ in range(hi - lo):
        port = lo + _Range.cursor % (hi - lo)
        _Range.cursor += 1
        s = socket.socket()
        try:
            s.bind((host, port))
            return s
        except OSError:
            s.close()
    raise PortInUse(f"no free port on {host} in {lo}-{hi - 1}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free ports. All sockets stay open until every port is chosen, so the OS cannot hand the
    same port out twice within one call."""
    socks = []
    try:
        for _ in range(count):
            socks.append(_bind_next(host))
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
