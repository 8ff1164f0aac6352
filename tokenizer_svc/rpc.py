"""Error mapping and metrics for every RPC, in one place, so servicer methods stay thin.

Named errors map to gRPC status codes: invalid request -> INVALID_ARGUMENT, unknown model -> NOT_FOUND; anything else
is a bug, logged with its traceback and answered INTERNAL (never a silent success).

Each call is a span `tokenizer.<rpc>` when tracing is on, a child of the caller's trace context (the router sends
it, with the request id, in the call's metadata; kimiserve/tracing.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kimiserve import tracing
from kimiserve.limits import clip
from tokenizer_svc import metrics
from tokenizer_svc.errors import InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)

_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
}

Req = TypeVar("Req")
Resp = TypeVar("Resp")
UnaryMethod = Callable[[Any, Req, grpc.aio.ServicerContext], Awaitable[Resp]]
StreamMethod = Callable[[Any, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]


def _status_for(rpc: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            message = clip(str(exc))
            log.info("%s rejected: %s", rpc, message, extra={"rpc": rpc, "code": code.name, "error": message})
            return code, message
    log.exception("%s failed", rpc, extra={"rpc": rpc})
    return grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {type(exc).__name__}: {clip(str(exc))}"


def _observe(rpc: str, code: grpc.StatusCode, start: float, span: tracing.Span | tracing.NoSpan) -> None:
    metrics.REQUESTS.labels(rpc=rpc, code=code.name).inc()
    metrics.LATENCY.labels(rpc=rpc).observe(time.perf_counter() - start)
    if code != grpc.StatusCode.OK:
        span.fail(code.name)
    span.end()


async def _abort(rpc: str, exc: Exception, start: float, span: tracing.Span | tracing.NoSpan,
                 context: grpc.aio.ServicerContext) -> None:
    """Ends the RPC with exc's status, counted first: abort sends the status to the client, which may scrape
    /metrics the moment it has it (the count in a `finally` after abort raced that scrape)."""
    code, message = _status_for(rpc, exc)
    _observe(rpc, code, start, span)
    await context.abort(code, message)  # raises (NoReturn), ending the RPC with this status


def unary(rpc: str) -> Callable[[UnaryMethod[Req, Resp]], UnaryMethod[Req, Resp]]:
    """Wrap a unary servicer method: map errors to status codes, count and time the call."""

    def decorate(method: UnaryMethod[Req, Resp]) -> UnaryMethod[Req, Resp]:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> Resp:
            start, code = time.perf_counter(), grpc.StatusCode.OK
            span = tracing.start_from_grpc(f"tokenizer.{rpc}", context)
            try:
                return await method(self, request, context)
            except asyncio.CancelledError:  # the client went away or its deadline passed
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                code = None  # counted by _abort, before the client can see the status
                await _abort(rpc, exc, start, span, context)
            finally:
                if code is not None:
                    _observe(rpc, code, start, span)

        return wrapper

    return decorate


def streaming(rpc: str) -> Callable[[StreamMethod[Req, Resp]], StreamMethod[Req, Resp]]:
    """As `unary`, for a method that yields its responses."""

    def decorate(method: StreamMethod[Req, Resp]) -> StreamMethod[Req, Resp]:
        @functools.wraps(method)
        async def wrapper(self: Any, request: Req, context: grpc.aio.ServicerContext) -> AsyncIterator[Resp]:
            start, code = time.perf_counter(), grpc.StatusCode.OK
            span = tracing.start_from_grpc(f"tokenizer.{rpc}", context)
            try:
                async for response in method(self, request, context):
                    yield response
            except (asyncio.CancelledError, GeneratorExit):
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                code = None  # counted by _abort, before the client can see the status
                await _abort(rpc, exc, start, span, context)
            finally:
                if code is not None:
                    _observe(rpc, code, start, span)

        return wrapper

    return decorate
