"""The public Router servicer (grpc.aio): request ids, validation, error mapping; the work is in generation.py."""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from kimiserve import tracing
from kimiserve.tenants import grpc_tenant
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from router import flow
from router.batch.runner import BatchRunner
from router.batch.service import BatchRpcs
from router.errors import RouterError, refusal
from router.generation import Generation
from router.request_ids import check_client_request_id

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
# A client's own deadline timer cancels the call: that cancel reaches us a little before our copy of the deadline
# (started when the request arrived) runs out, by the request's transit time (measured: 9 ms on a busy localhost).
# A stream a client ends within this much of its deadline is counted as DEADLINE_EXCEEDED, earlier as CANCELLED.
DEADLINE_SLACK_S = 0.5


def request_id_of(request, context) -> str:
    """The client's id (field, then `x-request-id` metadata), else a generated one. Always logged whole.
    Raises InvalidArgument for an id that is not printable ASCII, too long, or of the batch runner's form."""
    if request.HasField("request_id") and request.request_id:
        return check_client_request_id(request.request_id)
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and value:
            return check_client_request_id(value)
    return f"req-{uuid.uuid4().hex}"


def traced(method):
    """A streaming RPC as one span (the request's, a child of the client's `traceparent` if it sent one), made the
    task's current span so everything the request does nests under it (kimiserve/tracing.py)."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        span = tracing.start_from_grpc(f"router.{method.__name__}", context, request_id_from_metadata=False,
                                       method=method.__name__)
        tracing.set_current(span)
        replies = method(self, request, context)
        try:
            async for reply in replies:
                yield reply
        finally:
            # A client that went away stops this generator at a yield; close the method's now, so its own
            # cleanup (counting the request as cancelled) runs at once rather than whenever it is collected.
            await replies.aclose()
            span.end()

    return wrapper


class RouterService(BatchRpcs, router_pb2_grpc.RouterServicer):
    """Generate, Chat and ListModels here; the batch RPCs from BatchRpcs (router/batch/service.py)."""

    def __init__(self, generation: Generation, batches: BatchRunner):
        self.gen, self.runner = generation, batches

    async def _fail(self, context, method: str, request_id: str, e: Exception):
        code, message = refusal(e)
        if isinstance(e, RouterError):
            log.info("request refused", extra={"request_id": request_id, "method": method,
                                               "status": code.name, "error": message})
        else:  # a bug: the traceback goes to the log, never to the client
            log.exception("request failed", extra={"request_id": request_id, "method": method})
        self._count(method, code.name)
        tracing.current().fail(f"{code.name}: {message}")
        await context.abort(code, f"{message} (request_id={request_id})")

    def _count(self, method: str, status: str) -> None:
        """Every request is counted once, by the gRPC status its client got."""
        self.gen.metrics.requests.labels(method, status).inc()

    def _abandoned(self, context, method: str, request_id: str) -> None:
        """The client cancelled the stream or its deadline passed before the last chunk: the request ends there
        (CancelledError, or GeneratorExit at a yield), neither OK nor an error of ours."""
        remaining = context.time_remaining()
        status = ("DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED")
        log.info("request ended by the client", extra={"request_id": request_id, "method": method, "status": status,
                                                        "deadline_remaining_s": remaining})
        self._count(method, status)

    async def _start(self, context, method: str, request) -> str | None:
        """The request's id, set in the trailing metadata; None after refusing an invalid one."""
        try:
            request_id = request_id_of(request, context)
        except RouterError as e:
            await self._fail(context, method, "(invalid)", e)
            return None
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        tracing.current().set("request_id", request_id)
        return request_id

    async def _answer(self, method: str, request, context
                      ) -> AsyncIterator[tuple[str, int, flow.Piece, common_pb2.Usage | None]]:
        """A Generate or Chat request as (request id, choice index, piece, total usage), every outcome counted once:
        OK, an error status by the router's error table, or ended by the client."""
        request_id = await self._start(context, method, request)
        if request_id is None:
            return
        ended = False  # answered: OK, or an error status
        try:
            async for i, p, total in _with_total(flow.request(self.gen, method, request_id, request,
                                                              grpc_tenant(context)), flow.choice_count(request.n)):
                yield request_id, i, p, total
            ended = True
            self._count(method, "OK")
        except Exception as e:  # noqa: BLE001 - every failure is mapped to a status in one place
            ended = True
            await self._fail(context, method, request_id, e)
        finally:
            if not ended:
                self._abandoned(context, method, request_id)

    @traced
    async def Generate(self, request, context):
        # aclosing: a client that goes away closes this generator; _answer's cleanup (cancel on the shard, the
        # count) must run then, not when the abandoned inner generator is collected.
        async with aclosing(self._answer("Generate", request, context)) as replies:
            async for request_id, i, p, total in replies:
                yield router_pb2.GenerateResponse(**_common_fields(request_id, i, p, total))

    @traced
    async def Chat(self, request, context):
        async with aclosing(self._answer("Chat", request, context)) as replies:
            async for request_id, i, p, total in replies:
                yield router_pb2.ChatResponse(**_common_fields(request_id, i, p, total), reasoning_text=p.reasoning,
                                              tool_calls=p.tool_call_protos(),
                                              tool_call_deltas=[router_pb2.ToolCallDelta(
                                                  index=d.index, id=d.id, name=d.name, arguments=d.arguments)
                                                  for d in p.tool_call_deltas])

    async def ListModels(self, request, context):
        try:
            info, context_tokens = self.gen.model_info(), self.gen.max_context_tokens()
        except RouterError as e:
            await context.abort(*refusal(e))
        return router_pb2.ListModelsResponse(models=[router_pb2.ModelCard(
            name=info.model_name, model_type=info.model_type, max_context_tokens=context_tokens,
            vocab_size=info.vocab_size)])


async def _with_total(choices: AsyncIterator[tuple[int, flow.Piece]], n: int
                      ) -> AsyncIterator[tuple[int, flow.Piece, common_pb2.Usage | None]]:
    """(choice index, piece, total usage): the total (flow.total_usage, the HTTP API's rule) rides on the last
    piece of the choice that finishes last, which is the stream's last message; None on every other piece."""
    usages: list[common_pb2.Usage | None] = [None] * n
    finished = 0
    async for i, p in choices:
        total = None
        if p.final:
            usages[i], finished = p.usage, finished + 1
            if finished == n:
                total = flow.total_usage(usages, n)
        yield i, p, total


def _common_fields(request_id: str, i: int, p: flow.Piece, total: common_pb2.Usage | None) -> dict:
    """The fields GenerateResponse and ChatResponse share, from choice i's piece."""
    return dict(request_id=request_id, token_ids=p.token_ids, text=p.text, finish_reason=p.finish_reason,
                usage=p.usage, error_message=p.error_message, token_logprobs=p.logprobs, top_logprobs=p.top_logprobs,
                choice_index=i, total_usage=total, prompt_logprobs=p.prompt_logprobs)
