"""A request body that is not a valid protobuf is INVALID_ARGUMENT, on every service (router, tokenizer, shard).

gRPC deserializes a request before any servicer code runs, and a DecodeError there ends the call with UNKNOWN
(asyncio servers) or INTERNAL (thread-pool servers) and a Python exception text: both read as a server fault, and
neither says that the client sent bytes that are not a request. A server interceptor installs, on each method's
handler, a deserializer that turns a DecodeError into an `Undecodable` marker, and a behavior that answers the
marker with INVALID_ARGUMENT before the servicer sees it:

- unary requests: the call is aborted with INVALID_ARGUMENT;
- request streams: the stream the servicer reads ends at the corrupt message (as if the client had half-closed)
  and the call's status is INVALID_ARGUMENT, so the servicer cleans up as it does for a finished stream.

Install with `AioDecodeGuard()` / `DecodeGuard()` as the last interceptor of a server, so that interceptors that
refuse a call (API keys) still answer first.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)


class Undecodable:
    """Stands in for a request whose bytes did not parse; carries what to tell the client."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


def _guarded(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    def guarded(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as e:
            log.info("request body is not a valid protobuf", extra={"method": method, "bytes": len(data),
                                                                    "error": str(e)})
            return Undecodable(f"the request body ({len(data)} bytes) is not a valid protobuf message for "
                               f"{method}: {e}")
    return guarded


HANDLER_FACTORIES = {"unary_unary": grpc.unary_unary_rpc_method_handler,
              "unary_stream": grpc.unary_stream_rpc_method_handler,
              "stream_unary": grpc.stream_unary_rpc_method_handler,
              "stream_stream": grpc.stream_stream_rpc_method_handler}


def _rebuild(handler: grpc.RpcMethodHandler, method: str, wrap: Callable[[str, Callable], Callable]
             ) -> grpc.RpcMethodHandler:
    if handler is None or handler.request_deserializer is None:
        return handler  # unknown method (UNIMPLEMENTED) or a raw-bytes method: nothing to guard
    kind = next(k for k in HANDLER_FACTORIES if getattr(handler, k) is not None)
    return HANDLER_FACTORIES[kind](wrap(kind, getattr(handler, kind)),
                            request_deserializer=_guarded(handler.request_deserializer, method),
                            response_serializer=handler.response_serializer)


# -- asyncio servers (router, tokenizer) -------------------------------------------------------------------------
async def call_unary(behavior: Callable, request, context):
    """A unary-reply handler's reply, whether `behavior` is a coroutine function or a plain one."""
    result = behavior(request, context)
    return (await result) if inspect.isawaitable(result) else result


async def call_stream(behavior: Callable, request, context):
    """A streaming handler's replies, whether `behavior` is an async generator, a coroutine that writes with
    context.write(), or a plain iterator."""
    result = behavior(request, context)
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    elif inspect.isawaitable(result):
        await result
    else:
        for response in result:
            yield response


def _aio_behavior(kind: str, inner: Callable) -> Callable:
    async def run(request, context):
        return await call_unary(inner, request, context)

    async def run_stream(request, context):
        async for response in call_stream(inner, request, context):
            yield response

    def guard_requests(requests, context):
        async def checked():
            async for request in requests:
                if isinstance(request, Undecodable):
                    context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                    context.set_details(request.message)
                    return
                yield request
        return checked()

    if kind == "unary_unary":
        async def unary_unary(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await run(request, context)
        return unary_unary
    if kind == "unary_stream":
        async def unary_stream(request, context):
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in run_stream(request, context):
                yield response
        return unary_stream
    if kind == "stream_unary":
        async def stream_unary(requests, context):
            return await run(guard_requests(requests, context), context)
        return stream_unary

    async def stream_stream(requests, context):
        async for response in run_stream(guard_requests(requests, context), context):
            yield response
    return stream_stream


class AioDecodeGuard(grpc.aio.ServerInterceptor):
    """For grpc.aio servers: corrupt request bodies are INVALID_ARGUMENT (see the module docstring)."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        return _rebuild(await continuation(details), details.method, _aio_behavior)


# -- thread-pool servers (shard) ---------------------------------------------------------------------------------
def _sync_behavior(kind: str, inner: Callable) -> Callable:
    def guard_requests(requests, context):
        for request in requests:
            if isinstance(request, Undecodable):
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(request.message)
                return
            yield request

    if kind == "unary_unary":
        def unary_unary(request, context):
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return inner(request, context)
        return unary_unary
    if kind == "unary_stream":
        def unary_stream(request, context):
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            yield from inner(request, context)
        return unary_stream
    if kind == "stream_unary":
        def stream_unary(requests, context):
            corrupt: list[str] = []

            def noted():
                for request in requests:
                    if isinstance(request, Undecodable):
                        corrupt.append(request.message)
                    yield request
            try:
                return inner(guard_requests(noted(), context), context)
            except Exception:
                if corrupt:  # the servicer refused the stream it was cut short of: the corrupt body is the cause
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, corrupt[0])
                raise
        return stream_unary
    # stream_stream: the servicer reads the checked stream and yields as before
    return lambda requests, context: inner(guard_requests(requests, context), context)


class DecodeGuard(grpc.ServerInterceptor):
    """For thread-pool grpc servers: corrupt request bodies are INVALID_ARGUMENT (see the module docstring)."""

    def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        return _rebuild(continuation(details), details.method, _sync_behavior)
