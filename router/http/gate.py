"""The gate in front of every HTTP route: each request gets its id (the client's X-Request-Id, checked by the gRPC
API's rule, else a generated one) returned as a header; the API key is checked as on the gRPC port and gives the
request its tenant (kimiserve/tenants.py http_tenant; without keys: DEFAULT); the body size is capped (413); one log
line per request; and one trace span per request (kimiserve/tracing.py), the parent of
everything the request does, as router.Chat / router.Generate are over gRPC."""

from __future__ import annotations

import logging
import time
import uuid

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kimiserve import security, tracing
from kimiserve.tenants import DEFAULT, Tenant
from router.errors import InvalidArgument
from router.http.errors import HttpError, error_response
from router.http.origin import LocalGuard
from router.request_ids import check_client_request_id

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
OPEN_PATHS = frozenset({"/health"})  # probes cannot send a key; not traced either (a probe is not a request)
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context: the client's span becomes the request's parent


def _client_request_id(headers: Headers) -> str:
    """The client's X-Request-Id, checked by the gRPC API's rule (it travels back in a header and in logs), else a
    generated one."""
    request_id = headers.get(REQUEST_ID_HEADER)
    if not request_id:
        return f"req-{uuid.uuid4().hex}"
    try:
        return check_client_request_id(request_id)
    except InvalidArgument as e:
        raise HttpError(400, f"X-Request-Id: {e}", "invalid_argument", "X-Request-Id") from None


class Gate:
    """Pure ASGI middleware: it must not buffer streamed responses, as Starlette's BaseHTTPMiddleware would."""

    def __init__(self, app: ASGIApp, api_keys: security.ApiKeys | None, max_body_bytes: int,
                 allowed_hosts: tuple[str, ...]):
        self.app, self.api_keys, self.max_body = app, api_keys, max_body_bytes
        # Without keys, only the network guards the API: refuse what a web page could make a browser send.
        self.local_guard = LocalGuard(allowed_hosts) if api_keys is None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.monotonic(), [0]
        headers = Headers(scope=scope)
        try:
            request_id, refused = _client_request_id(headers), None
        except HttpError as e:  # answered below, under an id of our own (the refused one goes nowhere)
            request_id, refused = f"req-{uuid.uuid4().hex}", e
        scope.setdefault("state", {})["request_id"] = request_id
        span = self._span(scope, headers, request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (REQUEST_ID_HEADER.encode(), request_id.encode("latin-1"))]}
                status[0] = message["status"]
                route = scope.get("route")  # FastAPI's matched route, once routed: its template names the span
                if route is not None:
                    span.rename(f"{scope['method']} {route.path}")
                    span.set("http.route", route.path)
                span.set("http.response.status_code", status[0])
            await send(message)

        overflow: list[HttpError | None] = [None]

        async def app_send(message: Message) -> None:
            # A body found over the limit while the app read it is a 413, however the app answered the read's
            # failure (FastAPI's form parser turns any error into its own 400).
            if message["type"] == "http.response.start" and overflow[0] is not None:
                raise overflow[0]
            await send_with_id(message)

        try:
            if refused is not None:
                raise refused
            scope["state"]["tenant"] = self._check(scope, headers, request_id)
            await self.app(scope, self._limited(receive, overflow), app_send)
        except HttpError as e:
            if status[0]:
                raise
            await error_response(e, request_id)(scope, receive, send_with_id)
        finally:
            span.end()
        tenant = scope["state"].get("tenant")
        log.info("http request", extra={"request_id": request_id, "method": scope["method"], "path": scope["path"],
                                        "tenant": tenant.name if tenant else None, "status": status[0],
                                        "duration_s": round(time.monotonic() - start, 4)})

    @staticmethod
    def _span(scope: Scope, headers: Headers, request_id: str) -> tracing.Span | tracing.NoSpan:
        """The request's span, made the current span of this request's task (uvicorn runs each request in a task of
        its own; the flows' tasks copy it when they start). Named by the method until the route is known."""
        if scope["path"] in OPEN_PATHS:
            return tracing.NO_SPAN
        parent = {k: headers[k] for k in TRACE_HEADERS if k in headers}
        span = tracing.start(scope["method"], parent, "server", request_id=request_id,
                             **{"http.request.method": scope["method"], "url.path": scope["path"]})
        tracing.set_current(span)
        return span

    def _check(self, scope: Scope, headers: Headers, request_id: str) -> Tenant:
        """The request's tenant; raises HttpError for a refused key, a foreign page's request to a keyless router or
        a body declared over the limit."""
        tenant = DEFAULT
        if self.local_guard is not None and scope["path"] not in OPEN_PATHS:
            self.local_guard.check(scope["method"], scope["path"], headers)
        if self.api_keys is not None and scope["path"] not in OPEN_PATHS:
            token = security.bearer_token([("authorization", headers.get("authorization"))]
                                          if "authorization" in headers else [])
            tenant = self.api_keys.identify(token) if token else None
            if tenant is None:
                reason = "missing" if token is None else ("malformed" if not token else "wrong")
                log.warning("http request refused: %s API key", reason, extra={
                    "request_id": request_id, "path": scope["path"],
                    "key_sha256_prefix": security.key_fingerprint(token) if token else None})
                raise HttpError(401, f"{reason} API key: send the header `Authorization: Bearer <key>`",
                                "invalid_api_key")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise HttpError(413, f"request body of {length} bytes is over the limit of {self.max_body} bytes",
                            "request_too_large")
        return tenant

    def _limited(self, receive: Receive, overflow: list[HttpError | None]) -> Receive:
        """`receive`, raising a 413 HttpError (also kept in `overflow`) once the body passes the limit: a body
        without Content-Length (chunked) is only measured as it arrives."""
        seen = [0]

        async def limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body:
                    overflow[0] = HttpError(413, f"request body is over the limit of {self.max_body} bytes",
                                            "request_too_large")
                    raise overflow[0]
            return message
        return limited
