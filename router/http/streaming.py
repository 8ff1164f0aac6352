"""Server-sent events, and tying a request's work to its client: when the client goes away, the work is cancelled,
and a flow's cancellation aborts its sequences on the shards (Generation._stream), freeing their slots at once.

Both streamed and plain responses race the work against the ASGI `http.disconnect` message, so this does not rely on
the server noticing a dead socket at the next write."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)
T = TypeVar("T")
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """The result of `work`; ClientGone (with `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise ClientGone()
        return task.result()
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


class EventStream(Response):
    """A response streaming `events` (each one `data: ...\\n\\n` text) as text/event-stream."""

    def __init__(self, events: AsyncIterator[str], request_id: str):
        self.events, self.request_id = events, request_id
        self.background = None  # a Response attribute FastAPI sets; nothing runs after a stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
        try:
            await unless_disconnected(receive, self._pump(send))
        except (ClientGone, OSError):
            log.info("client disconnected mid-stream; its sequences were cancelled",
                     extra={"request_id": self.request_id})
            return
        finally:
            await self.events.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async for text in self.events:
            await send({"type": "http.response.body", "body": text.encode(), "more_body": True})


async def sse_events(first: tuple, rest: AsyncIterator, chunks, include_usage: bool,
                     request_id: str) -> AsyncIterator[str]:
    """The SSE events of a streamed chat or completion: the opening chunks, one chunk per piece of the n merged
    sequences, usage when asked, and an error event if the stream fails after the 200 went out; then [DONE]."""
    from router.http.errors import describe

    try:
        for out in chunks.start():
            yield out
        if out := await chunks.piece(*first, request_id):
            yield out
        async for i, p in rest:
            if out := await chunks.piece(i, p, request_id):
                yield out
        if include_usage:
            yield chunks.usage()
    except Exception as e:  # noqa: BLE001 - after the 200 has gone out, an error is an event in the stream
        yield event(describe(e, request_id)[1])
    finally:
        await rest.aclose()
    yield DONE
