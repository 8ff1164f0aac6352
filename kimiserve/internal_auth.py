"""The internal token: the shared secret that proves a caller of a shard or the tokenizer is the router.

API keys guard the router's public ports only; a shard or tokenizer port that answered anyone would let a caller
reach around the router (no key, no admission, no metrics, and a shard's Stream generates for whoever asks). Two
ways close it, alone or together:

- mTLS (`--client-ca` on the shard / tokenizer, `--upstream-cert` on the router; kimiserve/security.py);
- the internal token: a random string in a file that the router and every shard and tokenizer read
  (`--internal-token-file`). The router sends it as the metadata `x-kimiserve-internal-token` on every call; the
  servers' interceptor compares it in constant time and answers UNAUTHENTICATED without it. grpc.health.v1 and
  reflection stay open (kubelet probes and `up` cannot send it; neither reveals anything a caller could abuse).

`kimiserve up` writes a fresh token (0600, in its state directory) for each run; the Helm chart keeps one in a
Secret. A shard or tokenizer asked to listen beyond loopback with neither refuses to start (InternalAuthMissing)
unless `--allow-unauthenticated` says that the network alone is trusted.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import secrets
from pathlib import Path

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from kimiserve.decode_guard import HANDLER_FACTORIES
from kimiserve.private_files import private_dir
from kimiserve.security import SecurityConfigError, ServerTls, deny_aio

log = logging.getLogger(__name__)
TOKEN_HEADER = "x-kimiserve-internal-token"
# Open without the token: probes and `up`'s readiness checks cannot send it, and neither service reveals more than
# the method names the protos already publish.
OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})
MIN_TOKEN_CHARS = 32  # a generated token has 43 (32 random bytes, URL-safe base64)


class InternalAuthMissing(SecurityConfigError):
    """A shard or tokenizer would listen beyond loopback with no way to tell the router from anyone else."""


def is_loopback(host: str) -> bool:
    """True only for addresses no other machine can reach (`localhost`, 127.0.0.0/8, ::1). A wildcard (0.0.0.0,
    ::) or any other name counts as reachable."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> bytes:
    """The token in `path` (surrounding whitespace dropped), checked: printable ASCII (it travels as a metadata
    value) and at least MIN_TOKEN_CHARS long (a guessable token is no lock)."""
    try:
        text = Path(path).read_bytes().strip()
    except OSError as e:
        raise SecurityConfigError(f"cannot read the internal token file (--internal-token-file) {path}: "
                                  f"{e.strerror}") from e
    if not all(0x21 <= b <= 0x7E for b in text):
        raise SecurityConfigError(f"the internal token file {path} must hold one token of printable ASCII "
                                  "characters without spaces")
    if len(text) < MIN_TOKEN_CHARS:
        raise SecurityConfigError(f"the internal token in {path} has {len(text)} characters; at least "
                                  f"{MIN_TOKEN_CHARS} are needed (write one with `python -c 'import secrets; "
                                  "print(secrets.token_urlsafe(32))'`)")
    return text


def write_token(path: Path) -> Path:
    """Writes a fresh random token to `path`, readable by its owner only (0600, created so: never briefly wider),
    in a directory that is made 0700 when this creates it (kimiserve/private_files.py)."""
    private_dir(path.parent)
    if path.exists():
        path.unlink()  # O_CREAT's mode applies only to a new file
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    return path


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("who may call this service (the router)")
    g.add_argument("--internal-token-file", type=Path, default=None,
                   help="file holding the internal token: every call but health and reflection must carry it "
                        f"(metadata {TOKEN_HEADER}); the router sends it with its own --internal-token-file")
    g.add_argument("--allow-unauthenticated", action="store_true",
                   help="listen on a non-loopback --host with neither --internal-token-file nor --client-ca: "
                        "anyone who can reach the port may call it, bypassing the router's API keys")


def add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--internal-token-file", type=Path, default=None,
                   help="file holding the internal token, sent on every call to the tokenizer and the shards "
                        "(they were started with the same file)")


def check_server_args(args: argparse.Namespace, host: str, tls: ServerTls | None, service: str) -> Path | None:
    """The token file the server will require (None: none), after refusing a configuration that leaves a
    non-loopback port open to anyone (InternalAuthMissing names the service, the host and the ways out). The file
    itself is read when the server is built (read_token)."""
    mtls = tls is not None and tls.client_ca is not None
    if args.internal_token_file is None and not mtls and not is_loopback(host):
        if not args.allow_unauthenticated:
            raise InternalAuthMissing(
                f"{service}: refusing to listen on {host} with no caller authentication: anyone reaching it could "
                "bypass the router's API keys. Give --internal-token-file FILE (the router's too) or mTLS "
                "(--tls-cert/--tls-key/--client-ca), listen on 127.0.0.1, or pass --allow-unauthenticated")
        log.warning("serving without caller authentication (--allow-unauthenticated)",
                    extra={"service": service, "host": host})
    return args.internal_token_file


def _valid(metadata, token: bytes) -> bool:
    for key, value in metadata or ():
        if key == TOKEN_HEADER:
            presented = value.encode() if isinstance(value, str) else bytes(value)
            return hmac.compare_digest(presented, token)
    return False


def _refuse(details: grpc.HandlerCallDetails) -> str:
    log.warning("internal call refused: missing or wrong internal token", extra={"method": details.method})
    return f"missing or wrong internal token (metadata {TOKEN_HEADER}): only the router may call this service"


def _open(details: grpc.HandlerCallDetails) -> bool:
    return details.method.lstrip("/").rsplit("/", 1)[0] in OPEN_SERVICES


class TokenInterceptor(grpc.ServerInterceptor):
    """For thread-pool servers (the shard): calls without the token end UNAUTHENTICATED before any servicer code."""

    def __init__(self, token: bytes):
        self.token = token

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = continuation(details)
        if handler is None or _open(details) or _valid(details.invocation_metadata, self.token):
            return handler
        message = _refuse(details)

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def deny_stream(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - a generator, as streaming behaviors are

        kind = next(k for k in HANDLER_FACTORIES if getattr(handler, k) is not None)
        return HANDLER_FACTORIES[kind](deny_stream if kind.endswith("_stream") else deny,
                                       request_deserializer=handler.request_deserializer,
                                       response_serializer=handler.response_serializer)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """For asyncio servers (the tokenizer): as TokenInterceptor."""

    def __init__(self, token: bytes):
        self.token = token

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or _open(details) or _valid(details.invocation_metadata, self.token):
            return handler
        return deny_aio(handler, _refuse(details))


# -- the router's side ---------------------------------------------------------------------------------------------
class _Attach:
    """Puts the token on every call. grpc.aio files an interceptor under the first kind of call it subclasses, so
    each kind needs its own class: they are made below, all with this one body."""

    def __init__(self, token: bytes):
        self.pair = (TOKEN_HEADER, token.decode("ascii"))

    async def _intercept(self, continuation, details, request):  # request: a message or an iterator of them
        metadata = grpc.aio.Metadata(*(list(details.metadata or ()) + [self.pair]))
        return await continuation(details._replace(metadata=metadata), request)


_ATTACH_KINDS = tuple(
    type(f"_Attach{kind.__name__}", (_Attach, kind), {method: _Attach._intercept})
    for kind, method in ((grpc.aio.UnaryUnaryClientInterceptor, "intercept_unary_unary"),
                         (grpc.aio.UnaryStreamClientInterceptor, "intercept_unary_stream"),
                         (grpc.aio.StreamUnaryClientInterceptor, "intercept_stream_unary"),
                         (grpc.aio.StreamStreamClientInterceptor, "intercept_stream_stream")))


def client_interceptors(token: bytes | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that put the token on every call of an aio channel (none without a token)."""
    if token is None:
        return []
    return [kind(token) for kind in _ATTACH_KINDS]
