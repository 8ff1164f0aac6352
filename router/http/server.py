"""Serving the HTTP API with uvicorn inside the router's asyncio loop (beside grpc.aio), on a socket bound up front so
a port in use is a clear error at startup, with the router's TLS certificate and its drain on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from kimiserve import security
from router.http.protocol import protocol_class

log = logging.getLogger(__name__)


class _EmbeddedServer(uvicorn.Server):
    """uvicorn as one task of the router: the router owns SIGINT / SIGTERM (they start its drain), so uvicorn must
    not install handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    def __init__(self, app, host: str, port: int, tls: security.ServerTls | None, drain_timeout_s: float,
                 head_timeout_s: float = 10.0):
        try:
            self.sock = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise OSError(f"HTTP API: cannot listen on {host}:{port}: {e.strerror}") from e
        self.port = self.sock.getsockname()[1]
        kw = {}
        if tls is not None:
            kw = dict(ssl_certfile=str(tls.cert), ssl_keyfile=str(tls.key))
            if tls.client_ca is not None:
                kw.update(ssl_ca_certs=str(tls.client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
        # protocol_class: h11 with TCP_NODELAY and a deadline for each request's head (router/http/protocol.py).
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, proxy_headers=False,
                                timeout_graceful_shutdown=int(drain_timeout_s) or 1,
                                http=protocol_class(head_timeout_s), **kw)
        self.server = _EmbeddedServer(config)
        self.scheme = "https" if tls else "http"
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]), name="http api")
        log.info("http api serving", extra={"address": f"{self.scheme}://{self.sock.getsockname()[0]}:{self.port}"})

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests and streams finish (up to the drain timeout), then returns."""
        if self.task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        await self.task
