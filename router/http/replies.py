"""Flow output (router/flow.py Piece / Reply) -> OpenAI's response objects: finish reasons, usage, logprobs, tool
calls. Shared by the chat and completion endpoints, streamed or not, and by batch output files."""

from __future__ import annotations

import grpc

from kimiserve.kimi_chat import ToolCall
from kimiserve.v1 import common_pb2
from router.errors import RouterError
from router.flow import Piece, Reply, total_usage
from router.generation import Generation
from router.http import schemas

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}


class SequenceFailed(RouterError):
    """A sequence failed on its shard after it was admitted (FINISH_REASON_ERROR)."""


class SequenceCancelled(RouterError):
    """A sequence was cancelled by the server (e.g. its shard is shutting down), not by this client."""

    code = grpc.StatusCode.UNAVAILABLE


def finish_reason(p: Piece, request_id: str) -> str:
    """OpenAI's finish_reason of a final piece; a sequence that failed or was cancelled raises instead."""
    if p.finish_reason == common_pb2.FINISH_REASON_ERROR:
        raise SequenceFailed(f"request {request_id!r}: generation failed: {p.error_message}")
    if p.finish_reason == common_pb2.FINISH_REASON_CANCELLED:
        raise SequenceCancelled(f"request {request_id!r}: the sequence was cancelled by the server")
    return "tool_calls" if p.tool_calls else FINISH[p.finish_reason]


def usage(replies: list[Piece], per_prompt: int) -> schemas.Usage:
    """The request's usage by the gRPC API's rule (flow.total_usage): prompts once, completions summed."""
    u = total_usage([r.usage for r in replies], per_prompt)
    return schemas.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         total_tokens=u.prompt_tokens + u.completion_tokens,
                         prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=u.cached_prompt_tokens))


async def candidate_texts(gen: Generation, pieces: list[Piece]) -> dict[int, str]:
    """The text of every top-logprob candidate in `pieces` (one tokenizer call per id never seen before)."""
    ids = [c.token_id for p in pieces for top in p.top_logprobs for c in top.candidates]
    return await gen.tokenizer.token_texts(ids) if ids else {}


def chat_logprobs(p: Piece, names: dict[int, str]) -> schemas.ChoiceLogprobs:
    tops = p.top_logprobs or [None] * len(p.logprobs)
    return schemas.ChoiceLogprobs(content=[schemas.TokenLogprob(
        token=t, logprob=lp, bytes=list(t.encode()),
        top_logprobs=[schemas.TopLogprob(token=names[c.token_id], logprob=c.logprob,
                                         bytes=list(names[c.token_id].encode())) for c in top.candidates] if top else [])
        for t, lp, top in zip(p.token_texts, p.logprobs, tops)])


def legacy_logprobs(p: Piece, offset: int, names: dict[int, str]) -> schemas.LegacyLogprobs:
    """The /v1/completions shape; text_offset counts characters from `offset` (the echoed prompt's length)."""
    offsets = []
    for t in p.token_texts:
        offsets.append(offset)
        offset += len(t)
    top = [_by_text(t, names) for t in p.top_logprobs] or None
    return schemas.LegacyLogprobs(tokens=list(p.token_texts), token_logprobs=list(p.logprobs), top_logprobs=top,
                                  text_offset=offsets)


def _by_text(top, names: dict[int, str]) -> dict[str, float]:
    """The legacy shape keys candidates by their text; of candidates with the same text the likelier one stays."""
    out: dict[str, float] = {}
    for c in top.candidates:  # most likely first
        out.setdefault(names[c.token_id], c.logprob)
    return out


def tool_calls(calls: list[ToolCall]) -> list[schemas.ToolCall]:
    return [schemas.ToolCall(id=c.id, function=schemas.Function(name=c.name, arguments=c.arguments)) for c in calls]


def chat_completion(completion_id: str, created: int, model: str, replies: list[Reply], logprobs: bool,
                    request_id: str, names: dict[int, str] | None = None) -> schemas.ChatCompletion:
    """`names`: candidate_texts of the replies, when they carry top logprobs."""
    choices = [schemas.ChatChoice(
        index=i, finish_reason=finish_reason(r, request_id),
        logprobs=chat_logprobs(r, names or {}) if logprobs else None,
        message=schemas.Message(content=r.text if r.text or not r.tool_calls else None,
                                reasoning_content=r.reasoning or None,
                                tool_calls=tool_calls(r.tool_calls) or None))
        for i, r in enumerate(replies)]
    return schemas.ChatCompletion(id=completion_id, created=created, model=model, choices=choices,
                                  usage=usage(replies, len(replies)))


def completion(completion_id: str, created: int, model: str, replies: list[Reply], per_prompt: int,
               echoes: list[str], logprobs: bool, request_id: str,
               names: dict[int, str] | None = None) -> schemas.Completion:
    """`echoes`: the text put before each prompt's choices ("" without echo); `names` as for chat_completion."""
    choices = []
    for i, r in enumerate(replies):
        echo = echoes[i // per_prompt]
        choices.append(schemas.CompletionChoice(
            index=i, text=echo + r.text, finish_reason=finish_reason(r, request_id),
            logprobs=legacy_logprobs(r, len(echo), names or {}) if logprobs else None))
    return schemas.Completion(id=completion_id, created=created, model=model, choices=choices,
                              usage=usage(replies, per_prompt))
