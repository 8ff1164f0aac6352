"""The HTTP server's transport as the router configures it: TLS and mTLS from the router's certificate flags, a port
in use refused at startup, and a stop that lets an in-flight response finish (real sockets, in-process server)."""

from __future__ import annotations

import asyncio
import socket
import ssl

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from kimiserve.security import ServerTls
from router.http.server import HttpServer
from tests.deploy.certs import Ca


async def slow(request):
    await asyncio.sleep(float(request.query_params.get("s", "0")))
    return PlainTextResponse("ok")


APP = Starlette(routes=[Route("/", slow)])


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    ca, other = Ca("test CA"), Ca("other CA")
    for name, (cert, key) in (("server", ca.issue("router", ips=["127.0.0.1"])), ("client", ca.issue("client")),
                              ("rogue", other.issue("client"))):
        (root / f"{name}.crt").write_bytes(cert)
        (root / f"{name}.key").write_bytes(key)
    (root / "ca.crt").write_bytes(ca.pem)
    return root


def client_ctx(root, cert: str | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(root / "ca.crt"))
    if cert:
        ctx.load_cert_chain(root / f"{cert}.crt", root / f"{cert}.key")
    return ctx


async def fetch(url: str, verify, path: str = "/") -> httpx.Response:
    async with httpx.AsyncClient(verify=verify, timeout=10) as c:
        return await c.get(url + path)


def serve(tls_cfg, check):
    async def main():
        server = HttpServer(APP, "127.0.0.1", 0, tls_cfg, drain_timeout_s=5)
        server.start()
        try:
            await check(f"{server.scheme}://127.0.0.1:{server.port}")
        finally:
            await server.stop()
    asyncio.run(main())


def test_tls_and_mtls(tls):
    async def check_tls(url):
        assert url.startswith("https://")
        assert (await fetch(url, client_ctx(tls, None))).text == "ok"
        with pytest.raises(httpx.ConnectError):  # the server's certificate is not trusted without the CA
            await fetch(url, True)
    serve(ServerTls(tls / "server.crt", tls / "server.key"), check_tls)

    async def check_mtls(url):
        assert (await fetch(url, client_ctx(tls, "client"))).text == "ok"
        for cert in (None, "rogue"):  # no client certificate, or one the client CA did not sign
            with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
                await fetch(url, client_ctx(tls, cert))
    serve(ServerTls(tls / "server.crt", tls / "server.key", tls / "ca.crt"), check_mtls)


def test_port_in_use_is_refused():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken.getsockname()[1]}"):
            HttpServer(APP, "127.0.0.1", taken.getsockname()[1], None, 5)


def test_stop_lets_an_in_flight_request_finish():
    async def main():
        server = HttpServer(APP, "127.0.0.1", 0, None, drain_timeout_s=5)
        server.start()
        request = asyncio.create_task(fetch(f"http://127.0.0.1:{server.port}", False, "/?s=1"))
        while not server.server.server_state.tasks:  # the request is being handled
            await asyncio.sleep(0.01)
        await server.stop()
        assert (await request).text == "ok"  # answered, not cut off by the stop
    asyncio.run(main())
