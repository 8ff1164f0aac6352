"""One batch request, run exactly as the Generate / Chat RPCs run it (same Generation, same tokenizer calls, same
chat tool-call parsing), so a batch result equals the concatenated stream of the single request."""

from __future__ import annotations

from kimiserve.v1 import common_pb2, router_pb2
from router.batch.parse import CHAT, GENERATE
from router.errors import RouterError
from router.generation import Generation
from router.prompts import chat_hidden_ids, chat_prompt, generate_prompt
from tokenizer_svc.chat_template import parse_tool_calls

FINISHED_OK = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)


class RequestFailed(Exception):
    """The request ran but ended without a usable completion (ERROR / CANCELLED finish on its shard)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BatchExecutor:
    def __init__(self, generation: Generation):
        self.gen = generation

    async def run(self, kind: str, payload: bytes, request_id: str) -> router_pb2.BatchResponse:
        """Raises RouterError (as Generate / Chat would answer) or RequestFailed."""
        if kind == GENERATE:
            return await self._generate(router_pb2.GenerateRequest.FromString(payload), request_id)
        if kind == CHAT:
            return await self._chat(router_pb2.ChatRequest.FromString(payload), request_id)
        raise RouterError(f"request {request_id!r} has unknown kind {kind!r}")

    async def _generate(self, req: router_pb2.GenerateRequest, request_id: str) -> router_pb2.BatchResponse:
        prompt = await generate_prompt(self.gen, req)
        out, text, last = router_pb2.BatchResponse(), [], None
        async for chunk in self.gen.run("BatchGenerate", request_id, prompt, req.sampling):
            out.token_ids.extend(chunk.token_ids)
            text.append(chunk.text)
            last = chunk
        out.text = "".join(text)
        return _finish(out, last, request_id)

    async def _chat(self, req: router_pb2.ChatRequest, request_id: str) -> router_pb2.BatchResponse:
        prompt = await chat_prompt(self.gen, req)
        hidden = chat_hidden_ids(self.gen.tokenizer.info)
        out, raw, last = router_pb2.BatchResponse(), [], None
        async for chunk in self.gen.run("BatchChat", request_id, prompt, req.sampling, keep_special_tokens=True,
                                        hidden_ids=hidden):
            out.token_ids.extend(chunk.token_ids)
            raw.append(chunk.text)
            last = chunk
        content, calls = parse_tool_calls("".join(raw))
        out.text = content
        out.tool_calls.extend(common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls)
        return _finish(out, last, request_id)


def _finish(out: router_pb2.BatchResponse, last, request_id: str) -> router_pb2.BatchResponse:
    if last is None:
        raise RequestFailed("generation_failed", f"request {request_id!r}: the stream ended without a last chunk")
    if last.finish_reason not in FINISHED_OK:
        name = common_pb2.FinishReason.Name(last.finish_reason)
        raise RequestFailed("generation_failed", f"request {request_id!r} ended with {name}"
                            + (f": {last.error_message}" if last.error_message else ""))
    out.finish_reason = last.finish_reason
    out.usage.CopyFrom(last.usage)
    return out
