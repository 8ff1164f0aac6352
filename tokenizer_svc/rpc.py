"""Error mapping and metrics for every RPC, in one place, so servicer methods stay thin.

Named errors map to gRPC status codes: invalid request -> INVALID_ARGUMENT, unknown model -> NOT_FOUND; anything else
is a bug, logged with its traceback and answered INTERNAL (never a silent success).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from tokenizer_svc import metrics
from tokenizer_svc.errors import InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)

_CODES: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
}

F = TypeVar("F", bound=Callable[..., Any])


def _status_for(rpc: str, exc: Exception) -> tuple[grpc.StatusCode, str]:
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            log.info("%s rejected: %s", rpc, exc, extra={"rpc": rpc, "code": code.name, "error": str(exc)})
            return code, str(exc)
    log.exception("%s failed", rpc, extra={"rpc": rpc})
    return grpc.StatusCode.INTERNAL, f"internal error in {rpc}: {type(exc).__name__}: {exc}"


def _observe(rpc: str, code: grpc.StatusCode, start: float) -> None:
    metrics.REQUESTS.labels(rpc=rpc, code=code.name).inc()
    metrics.LATENCY.labels(rpc=rpc).observe(time.perf_counter() - start)


def unary(rpc: str) -> Callable[[F], F]:
    """Wrap a unary servicer method: map errors to status codes, count and time the call."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                return method(self, request, context)
            except Exception as exc:
                code, message = _status_for(rpc, exc)
                context.abort(code, message)  # raises, ending the RPC with this status
            finally:
                _observe(rpc, code, start)

        return wrapper  # type: ignore[return-value]

    return decorate


def streaming(rpc: str) -> Callable[[F], F]:
    """As `unary`, for a method that yields its responses."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                yield from method(self, request, context)
            except GeneratorExit:  # the client went away mid-stream
                code = grpc.StatusCode.CANCELLED
                raise
            except Exception as exc:
                code, message = _status_for(rpc, exc)
                context.abort(code, message)
            finally:
                _observe(rpc, code, start)

        return wrapper  # type: ignore[return-value]

    return decorate
