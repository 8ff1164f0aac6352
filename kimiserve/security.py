"""Transport security and API keys, shared by the three services.

- TLS on a gRPC port (cert + key files, e.g. from a Kubernetes Secret); with a client CA the port requires client
  certificates signed by it (mTLS between router, tokenizer and shards).
- Client credentials for the router's connections to the tokenizer and the shards (`UpstreamTls`).
- API keys on the router: `authorization: Bearer <key>` metadata checked by a server interceptor against keys read
  from a file (one per line, each with an optional tenant, `#` comments), reloaded when it changes; an emptied or
  broken file leaves no key valid (see ApiKeys). An admitted call runs with its key's tenant (kimiserve/tenants.py).
  Missing or wrong → UNAUTHENTICATED. Keys are never logged: a refusal logs the method and the reason, plus a short
  SHA-256 prefix of a presented key so that two clients can be told apart without revealing either key.
- A plaintext health-only port (`--health-port`): kubelet's native gRPC probes cannot speak TLS, so with TLS on the
  probes ask grpc.health.v1 there. It serves nothing but health.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
import os
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from kimiserve.decode_guard import HANDLER_FACTORIES, call_stream, call_unary
from kimiserve.ports import SERVER_OPTIONS, PortInUse
from kimiserve.tenants import ADMIN_MARK, DEFAULT, NAME, Tenant, set_grpc_tenant

log = logging.getLogger(__name__)
AUTH_HEADER = "authorization"
# Services reachable without an API key: kubelet probes and load balancers cannot send one.
OPEN_SERVICES = frozenset({health.SERVICE_NAME})


class SecurityConfigError(ValueError):
    """A TLS or API-key setting is incomplete or unreadable (named flag and file in the message)."""


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"cannot read the {what} {path}: {e.strerror}") from e


# -- server side -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerTls:
    cert: Path  # PEM certificate chain served on the port
    key: Path  # PEM private key of that certificate
    client_ca: Path | None = None  # PEM CA bundle; set: clients must present a certificate it signed (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca, "client CA (--client-ca)") if self.client_ca else None
        return grpc.ssl_server_credentials([(_read(self.key, "TLS key (--tls-key)"),
                                             _read(self.cert, "TLS certificate (--tls-cert)"))],
                                           root_certificates=ca, require_client_auth=ca is not None)


def add_server_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security")
    g.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate: serve the gRPC port over TLS")
    g.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
    g.add_argument("--client-ca", type=Path, default=None,
                   help="PEM CA bundle: require client certificates signed by it (mTLS); needs --tls-cert")
    g.add_argument("--health-port", type=int, default=None,
                   help="also serve grpc.health.v1 alone, in plaintext, on this port (for kubelet probes)")


def server_tls_from_args(a: argparse.Namespace) -> ServerTls | None:
    if a.tls_cert is None and a.tls_key is None:
        if a.client_ca is not None:
            raise SecurityConfigError("--client-ca needs --tls-cert and --tls-key (mTLS is TLS with client certs)")
        return None
    if a.tls_cert is None or a.tls_key is None:
        raise SecurityConfigError("--tls-cert and --tls-key go together; got only "
                                  f"{'--tls-cert' if a.tls_cert else '--tls-key'}")
    return ServerTls(a.tls_cert, a.tls_key, a.client_ca)


def bind(server, address: str, tls: ServerTls | None) -> int:
    """Adds a TLS or plaintext port to a sync or aio server; returns the bound port, raising PortInUse if binding
    failed (grpc returns 0 or raises a bare RuntimeError, depending on its version)."""
    try:
        port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        raise PortInUse(f"cannot serve on {address}: the port is in use (another kimiserve server?) or the host is "
                        "not an address of this machine; choose another with --port / --host")
    return port


def health_only_server_aio(servicer: health.aio.HealthServicer, host: str, port: int) -> grpc.aio.Server:
    """An aio server serving only grpc.health.v1 (plaintext) on host:port; the caller starts and stops it."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bind(server, f"{host}:{port}", None)
    return server


def health_only_server(servicer: health.HealthServicer, host: str, port: int) -> grpc.Server:
    """A sync server serving only grpc.health.v1 (plaintext) on host:port; the caller starts and stops it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    bind(server, f"{host}:{port}", None)
    return server


# -- client side (router → tokenizer, shards) ---------------------------------------------------------------------
@dataclass(frozen=True)
class UpstreamTls:
    ca: Path  # PEM CA that signed the tokenizer's and shards' certificates
    cert: Path | None = None  # PEM client certificate presented to them (mTLS)
    key: Path | None = None
    server_name: str | None = None  # name to verify in their certificates instead of the dialled host (pod IPs)
    flags: str = "--upstream"  # prefix of the flags that set these, named in errors (client commands: --tls)

    def credentials(self) -> grpc.ChannelCredentials:
        f = self.flags
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca, f"CA ({f}-ca)"),
            private_key=_read(self.key, f"client key ({f}-key)") if self.key else None,
            certificate_chain=_read(self.cert, f"client certificate ({f}-cert)") if self.cert else None)


def add_upstream_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to the tokenizer and shards")
    g.add_argument("--upstream-ca", type=Path, default=None,
                   help="PEM CA: connect to the tokenizer and shards over TLS, verifying their certificates")
    g.add_argument("--upstream-cert", type=Path, default=None, help="PEM client certificate for mTLS")
    g.add_argument("--upstream-key", type=Path, default=None, help="PEM private key of --upstream-cert")
    g.add_argument("--upstream-server-name", default=None,
                   help="name their certificates carry (needed when shards are dialled by pod IP)")


def upstream_tls_from_args(a: argparse.Namespace) -> UpstreamTls | None:
    if a.upstream_ca is None:
        if a.upstream_cert or a.upstream_key or a.upstream_server_name:
            raise SecurityConfigError("--upstream-cert/--upstream-key/--upstream-server-name need --upstream-ca")
        return None
    if (a.upstream_cert is None) != (a.upstream_key is None):
        raise SecurityConfigError("--upstream-cert and --upstream-key go together")
    return UpstreamTls(a.upstream_ca, a.upstream_cert, a.upstream_key, a.upstream_server_name)


def aio_channel(address: str, tls: UpstreamTls | None, options: list[tuple[str, object]] = (),
                interceptors: list[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    """`interceptors`: e.g. kimiserve.internal_auth.client_interceptors, which put the internal token on every call."""
    options, interceptors = list(options), list(interceptors) or None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options, interceptors=interceptors)


# -- API keys ------------------------------------------------------------------------------------------------------
def key_fingerprint(key: str) -> str:
    """A short, non-reversible tag for a presented key (logs only ever carry this)."""
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    """Keys from a file, re-read when the file changes (a rotated Kubernetes Secret), checked at most once per
    `recheck_s`. Each non-blank line (after `#` comments are cut) is `KEY [TENANT [admin]]`, fields separated by
    spaces or tabs:
    - `KEY` alone: a key of the tenant `default` (kimiserve/tenants.py DEFAULT), so a plain list of keys is one
      tenant, as it always was;
    - `KEY TENANT`: a key of TENANT (letters, digits, `.`, `_`, `-`; at most 64 characters, starting with a letter or
      digit); a tenant may have several keys (rotation: the old and the new key side by side);
    - `KEY TENANT admin`: a key of TENANT that may also read every tenant's files and batches.
    A key listed twice must name the same identity both times.

    The file is the only source of truth, and a reload fails closed:
    - at startup, a file that is missing, unreadable, not UTF-8, holds a key that is not printable ASCII, a line of
      any other shape, or no key at all is a SecurityConfigError naming the file (and the byte offset or line): the
      router does not start;
    - while running, a file that becomes empty revokes every key: from then on every request is UNAUTHENTICATED,
      logged at ERROR, until a key is written again. Emptying the file locks everyone out; it never turns auth off;
    - a file that becomes unreadable, disappears or is invalid also leaves no key valid (logged at ERROR). The keys
      loaded before may be exactly the ones being revoked (a leaked key is rotated out), so serving them from memory
      while the file cannot be read would keep a revoked key working for as long as the file stays broken.
    A change is noticed by the file's identity, size, mtime and ctime, so a write within one mtime tick, a replaced
    file or a permission change is still re-read.
    """

    def __init__(self, path: Path, recheck_s: float = 2.0):
        self.path, self._recheck_s = Path(path), recheck_s
        self._checked_at = 0.0
        self._signature = self._stat()  # before reading: a change made meanwhile is seen at the next check
        self._keys: tuple[tuple[bytes, Tenant], ...] = self._read()  # raises SecurityConfigError: fatal at startup
        log.info("API keys loaded", extra=self._summary())

    def _summary(self) -> dict:
        return {"path": str(self.path), "keys": len(self._keys),
                "tenants": sorted({t.name for _, t in self._keys})}

    def _stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def _read(self) -> tuple[tuple[bytes, Tenant], ...]:
        data = _read(self.path, "API keys file (--api-keys-file)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise SecurityConfigError(f"the API keys file {self.path} is not UTF-8: byte 0x{data[e.start]:02x} at "
                                      f"byte offset {e.start} (line {line})") from None
        identities: dict[str, tuple[Tenant, int]] = {}  # key -> (its identity, the line that first gave it)
        for number, line in enumerate(text.splitlines(), start=1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            key, tenant = _key_line(fields, f"the API keys file {self.path}, line {number}")
            first = identities.setdefault(key, (tenant, number))
            if first[0] != tenant:
                raise SecurityConfigError(f"the API keys file {self.path}, line {number}: the key of line {first[1]} "
                                          "again, with another tenant or admin mark; a key belongs to one tenant")
        if not identities:
            raise SecurityConfigError(f"the API keys file {self.path} holds no key")
        return tuple((_digest(key.encode()), tenant) for key, (tenant, _) in identities.items())

    def _reload_if_changed(self) -> None:
        signature = self._stat()
        if signature == self._signature:
            return
        self._signature = signature
        try:
            self._keys = self._read()
        except SecurityConfigError as e:
            self._keys = ()
            log.error("API keys file not usable: NO key is valid, every request is refused until it is fixed: %s",
                      e, extra={"path": str(self.path)})
            return
        log.info("API keys reloaded", extra=self._summary())

    def identify(self, presented: str) -> Tenant | None:
        """The tenant whose key was presented; None for a key not in the file."""
        now = time.monotonic()
        if now - self._checked_at >= self._recheck_s:
            self._checked_at = now
            self._reload_if_changed()
        # Digests make every comparison the same length (compare_digest is constant-time only between equal
        # lengths); every key is compared, with no early exit, so the time says nothing about which key matched.
        token = _digest(presented.encode())
        found = None
        for digest, tenant in self._keys:
            if hmac.compare_digest(token, digest):
                found = tenant
        return found

    def valid(self, presented: str) -> bool:
        """Whether the key is one of the file's, whatever its tenant."""
        return self.identify(presented) is not None


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _key_line(fields: list[str], where: str) -> tuple[str, Tenant]:
    """One line's `KEY [TENANT [admin]]`, or a SecurityConfigError naming `where` and what is wrong."""
    key = fields[0]
    if not (key.isascii() and key.isprintable()):
        # Metadata values travel in HTTP/2 headers: such a key could never be presented.
        raise SecurityConfigError(f"{where}: a key must be printable ASCII")
    if len(fields) > 3 or (len(fields) == 3 and fields[2] != ADMIN_MARK):
        # No field is echoed, here or below: a misplaced key must not reach the log.
        raise SecurityConfigError(f"{where}: expected `KEY`, `KEY TENANT` or `KEY TENANT {ADMIN_MARK}`, got "
                                  f"{len(fields)} fields" + (f" whose third is not `{ADMIN_MARK}`" if len(fields) == 3
                                                             else ""))
    if len(fields) == 1:
        return key, DEFAULT
    if fields[1] == ADMIN_MARK:  # `KEY admin` reads as an admin key, but would make a tenant named "admin"
        raise SecurityConfigError(f"{where}: `{ADMIN_MARK}` is the admin mark, not a tenant name: write `KEY TENANT "
                                  f"{ADMIN_MARK}`")
    if not NAME.fullmatch(fields[1]):
        raise SecurityConfigError(f"{where}: the tenant name ({len(fields[1])} characters) must be 1-64 letters, "
                                  "digits, '.', '_' or '-', starting with a letter or digit")
    return key, Tenant(fields[1], admin=len(fields) == 3)


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == AUTH_HEADER:
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def deny_aio(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """`handler`'s method on an asyncio server, answering UNAUTHENTICATED `message` before any servicer code."""
    async def abort(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def abort_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kind = next(k for k in HANDLER_FACTORIES if getattr(handler, k) is not None)
    return HANDLER_FACTORIES[kind](abort_stream if kind.endswith("_stream") else abort,
                                   request_deserializer=handler.request_deserializer,
                                   response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <key>` on every RPC except those of OPEN_SERVICES, and runs each admitted
    call with its key's tenant (kimiserve/tenants.py grpc_tenant)."""

    def __init__(self, keys: ApiKeys, open_services: frozenset[str] = OPEN_SERVICES):
        self.keys, self.open_services = keys, open_services

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.lstrip("/").rsplit("/", 1)[0]
        if handler is None or service in self.open_services:
            return handler
        token = bearer_token(details.invocation_metadata)
        tenant = self.keys.identify(token) if token else None
        if tenant is not None:
            return _as_tenant(handler, tenant)
        reason = "missing" if token is None else ("malformed" if not token else "wrong")
        log.warning("request refused: %s API key", reason,
                    extra={"method": details.method, "reason": reason,
                           "key_sha256_prefix": key_fingerprint(token) if token else None})
        hint = ("send metadata `authorization: Bearer <key>`" if reason != "wrong" else "the key is not accepted")
        return deny_aio(handler, f"{reason} API key: {hint}")


def _as_tenant(handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
    """`handler`, run with `tenant` set in the call's task before the servicer's code starts."""
    kind = next(k for k in HANDLER_FACTORIES if getattr(handler, k) is not None)
    behavior = getattr(handler, kind)

    async def unary(request_or_iterator, context):
        set_grpc_tenant(tenant)
        return await call_unary(behavior, request_or_iterator, context)

    async def streaming(request_or_iterator, context):
        set_grpc_tenant(tenant)
        async for reply in call_stream(behavior, request_or_iterator, context):
            yield reply

    return HANDLER_FACTORIES[kind](streaming if kind.endswith("_stream") else unary,
                                   request_deserializer=handler.request_deserializer,
                                   response_serializer=handler.response_serializer)
