"""One batch request, run by the same flows as the Generate / Chat RPCs (router/flow.py), so a batch result equals
the concatenated stream of the single request."""

from __future__ import annotations

import json

from kimiserve.tenants import Tenant
from kimiserve.v1 import common_pb2, router_pb2
from router import flow
from router.batch.parse import CHAT, GENERATE, RESPONSES
from router.errors import InvalidArgument, RouterError
from router.generation import Generation
from router.openai_responses import responses_request

FINISHED_OK = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
METHODS = {GENERATE: "BatchGenerate", CHAT: "BatchChat", RESPONSES: "BatchResponses"}  # the metrics' method label


class RequestFailed(Exception):
    """The request ran but ended without a usable completion (ERROR / CANCELLED finish on its shard)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BatchExecutor:
    def __init__(self, generation: Generation):
        self.gen = generation

    async def run(self, kind: str, payload: bytes, request_id: str, tenant: Tenant) -> router_pb2.BatchResponse:
        """Runs as `tenant` (the batch's). Raises RouterError (as Generate / Chat would answer) or RequestFailed."""
        if kind not in METHODS:
            raise RouterError(f"request {request_id!r} has unknown kind {kind!r}")
        req = _request(kind, payload)
        choices = flow.request(self.gen, METHODS[kind], request_id, req, tenant)
        if req.n > 1:  # refused when the batch is validated (router/batch/parse.py); a result holds one choice
            raise InvalidArgument(f"request {request_id!r}: n={req.n}, but a batch request runs one choice", "n")
        return _finish(await flow.collect(piece async for _, piece in choices), request_id)


def _request(kind: str, payload: bytes) -> router_pb2.GenerateRequest | router_pb2.ChatRequest:
    """The stored request (router/batch/parse.py ParsedRequest.payload): a Responses line is kept as its body."""
    if kind == RESPONSES:
        return responses_request(json.loads(payload))[0]
    return (router_pb2.GenerateRequest if kind == GENERATE else router_pb2.ChatRequest).FromString(payload)


def _finish(reply: flow.Reply, request_id: str) -> router_pb2.BatchResponse:
    if not reply.final:
        raise RequestFailed("generation_failed", f"request {request_id!r}: the stream ended without a last chunk")
    if reply.finish_reason not in FINISHED_OK:
        name = common_pb2.FinishReason.Name(reply.finish_reason)
        raise RequestFailed("generation_failed", f"request {request_id!r} ended with {name}"
                            + (f": {reply.error_message}" if reply.error_message else ""))
    return router_pb2.BatchResponse(
        text=reply.text, reasoning_text=reply.reasoning, token_ids=reply.token_ids,
        finish_reason=reply.finish_reason, usage=reply.usage,
        tool_calls=reply.tool_call_protos())
