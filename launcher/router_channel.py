"""How the client commands (`chat`, `complete`, `batch`) reach a router: address, TLS / mTLS and API key, and what
a failed connection or call looks like to the user (one line on stderr, exit code 2).

The flags mirror the router's own (kimiserve/security.py): a router serving `--tls-cert` is reached with `--tls-ca`
(the CA that signed it); one that also has `--client-ca` wants `--tls-cert` / `--tls-key` from the client (mTLS);
one with `--api-keys-file` wants `--api-key`, or better KIMISERVE_API_KEY, which keeps the key out of `ps`.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from kimiserve.security import AUTH_HEADER, SecurityConfigError, UpstreamTls
from kimiserve.v1 import router_pb2_grpc

log = logging.getLogger(__name__)
API_KEY_ENV = "KIMISERVE_API_KEY"


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="127.0.0.1:50051", help="router address host:port")
    g = p.add_argument_group("router connection security")
    g.add_argument("--tls-ca", type=Path, default=None,
                   help="PEM CA: connect over TLS, verifying the router's certificate against it")
    g.add_argument("--tls-cert", type=Path, default=None,
                   help="PEM client certificate, for a router that requires one (its --client-ca); needs --tls-ca")
    g.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-server-name", default=None,
                   help="name the router's certificate carries, when it is not the --router host")
    g.add_argument("--api-key", default=None,
                   help=f"API key, sent as `authorization: Bearer KEY` (default: ${API_KEY_ENV})")


def _tls(a: argparse.Namespace) -> UpstreamTls | None:
    if a.tls_ca is None:
        if a.tls_cert or a.tls_key or a.tls_server_name:
            raise SecurityConfigError("--tls-cert/--tls-key/--tls-server-name need --tls-ca (the CA that signed "
                                      "the router's certificate)")
        return None
    if (a.tls_cert is None) != (a.tls_key is None):
        raise SecurityConfigError("--tls-cert and --tls-key go together")
    return UpstreamTls(a.tls_ca, a.tls_cert, a.tls_key, a.tls_server_name, flags="--tls")


def _api_key(a: argparse.Namespace) -> str | None:
    key = (a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV, "")).strip()
    if a.api_key is not None and not key:
        raise SecurityConfigError("--api-key is empty")
    return key or None


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call on the channel."""

    def __init__(self, key: str) -> None:
        self._header = (AUTH_HEADER, f"Bearer {key}")

    def _with_key(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), self._header], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)


def router_channel(a: argparse.Namespace) -> grpc.Channel:
    """A channel to `--router` with the TLS and API key the flags ask for. Raises SecurityConfigError for
    incomplete flags or unreadable files, naming them."""
    tls, key = _tls(a), _api_key(a)
    if tls is None:
        channel = grpc.insecure_channel(a.router)
        if key and not _is_loopback(a.router):
            log.warning("sending the API key without TLS: anyone on the network path can read it (give --tls-ca)",
                        extra={"router": a.router})
    else:
        options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
        channel = grpc.secure_channel(a.router, tls.credentials(), options=options)
    return grpc.intercept_channel(channel, _BearerKey(key)) if key else channel


def with_router(a: argparse.Namespace, work: Callable[[router_pb2_grpc.RouterStub], int]) -> int:
    """Runs `work` on a stub of the router the flags name and returns its exit code, or 2 with one line on stderr
    when the flags cannot make a channel or a call fails."""
    try:
        channel = router_channel(a)
    except SecurityConfigError as e:
        sys.stderr.write(f"kimiserve: {e}\n")
        return 2
    with channel:
        try:
            return work(router_pb2_grpc.RouterStub(channel))
        except grpc.RpcError as e:
            sys.stderr.write(f"kimiserve: {e.code().name}: {e.details()}\n")
            return 2
