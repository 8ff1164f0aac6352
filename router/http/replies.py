"""Flow output (router/flow.py Piece / Reply) -> OpenAI's response objects: finish reasons, usage, logprobs, tool
calls. Shared by the chat and completion endpoints, streamed or not, and by batch output files."""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import grpc

from kimiserve.kimi_chat import ToolCall, ToolCallDelta
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
    # Calls parsed from a reply that max_tokens cut (a later call half-written) do not make it a tool-call finish.
    ended_itself = p.finish_reason == common_pb2.FINISH_REASON_STOP
    return "tool_calls" if p.tool_calls and ended_itself else FINISH[p.finish_reason]


def usage(replies: list[Piece], per_prompt: int) -> schemas.Usage:
    """The request's usage by the gRPC API's rule (flow.total_usage): prompts once, completions summed."""
    u = total_usage([r.usage for r in replies], per_prompt)
    return schemas.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                         total_tokens=u.prompt_tokens + u.completion_tokens,
                         prompt_tokens_details=schemas.PromptTokensDetails(cached_tokens=u.cached_prompt_tokens),
                         completion_tokens_details=schemas.CompletionTokensDetails(
                             reasoning_tokens=u.reasoning_tokens))


def usage_so_far(p: Piece, prompt_tokens: int, generated: int) -> schemas.Usage:
    """vLLM's continuous_usage_stats on a streamed chunk of one choice: its prompt and the tokens it generated until
    this chunk (the final piece: the shard's exact usage)."""
    if p.usage is not None:
        return usage([p], 1)
    return schemas.Usage(prompt_tokens=prompt_tokens, completion_tokens=generated,
                         total_tokens=prompt_tokens + generated)


async def token_bytes(gen: Generation, pieces: list[Piece], prompts: list[list[int]] = ()) -> dict[int, bytes]:
    """Every id `pieces` show (tokens, top-logprob candidates, scored prompts' candidates) and every id of
    `prompts`, as the tokenizer's own bytes (one tokenizer call for the ids never seen before)."""
    ids = [i for p in pieces for i in p.token_ids]
    ids += [c.token_id for p in pieces for top in p.top_logprobs for c in top.candidates]
    ids += [c.token_id for p in pieces if p.prompt_logprobs is not None
            for top in p.prompt_logprobs.top_logprobs for c in top.candidates]
    ids += [i for prompt in prompts for i in prompt]
    return await gen.tokenizer.token_bytes(ids) if ids else {}


def token_key(token_id: int, b: bytes) -> str:
    """A token's name where a string must stand for it, one per id: its text; for bytes that are not UTF-8 on their
    own (part of a multi-byte character) `bytes:` and their escapes (OpenAI's form); for an id with no bytes (the
    model's vocabulary padded past the tokenizer's) `token_id:` and the id."""
    if not b:
        return f"token_id:{token_id}"
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def token_pieces(ids: list[int], names: dict[int, bytes]) -> list[str]:
    """What each id adds to the text of `ids` (a token inside a multi-byte character adds "", the one completing
    it the character), so the pieces concatenate to the text: the echoed prompt's `tokens` and `text_offset`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [decoder.decode(names[i]) for i in ids]
    if pieces:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


@dataclass(frozen=True)
class EchoedPrompt:
    """A prompt echoed with its logprobs: its ids and what each adds to the echoed text."""

    ids: list[int]
    pieces: list[str]
    top_n: int = 0  # alternatives per position the legacy shape shows (the shard may have computed more)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def chat_logprobs(p: Piece, names: dict[int, bytes]) -> schemas.ChoiceLogprobs:
    """Each token named as its alternatives are (token_key), so a client finds the chosen one among them."""
    tops = p.top_logprobs or [None] * len(p.logprobs)
    return schemas.ChoiceLogprobs(content=[schemas.TokenLogprob(
        token=token_key(i, names[i]), logprob=lp, bytes=list(names[i]),
        top_logprobs=[schemas.TopLogprob(token=token_key(c.token_id, names[c.token_id]), logprob=c.logprob,
                                         bytes=list(names[c.token_id])) for c in top.candidates] if top else [])
        for i, lp, top in zip(p.token_ids, p.logprobs, tops)])


def legacy_logprobs(p: Piece, offset: int, names: dict[int, bytes],
                    echoed: EchoedPrompt | None = None) -> schemas.LegacyLogprobs:
    """The /v1/completions shape; text_offset counts characters from `offset` (the echoed prompt's length). With
    `echoed` (echo + logprobs, on a choice's first piece) the prompt's entries come first: its first token has no
    logprob (null), each later one the shard's score of it (p.prompt_logprobs)."""
    tokens, logprobs, offsets = [], [], []
    top: list[dict[str, float] | None] = []
    if echoed is not None:
        scored = _scored(p, echoed.ids)
        tokens, logprobs = list(echoed.pieces), [None, *scored.logprobs]
        top = [None, *(_by_key(t, names, echoed.top_n) for t in scored.top_logprobs)]
        at = 0
        for t in echoed.pieces:
            offsets.append(at)
            at += len(t)
    for t in p.token_texts:
        offsets.append(offset)
        offset += len(t)
    top += [_by_key(t, names) for t in p.top_logprobs]
    return schemas.LegacyLogprobs(tokens=tokens + list(p.token_texts), token_logprobs=logprobs + list(p.logprobs),
                                  top_logprobs=top if any(t is not None for t in top) else None, text_offset=offsets)


@dataclass(frozen=True)
class ScoredPrompts:
    """vLLM's prompt_logprobs asked on a completions request: each prompt's ids and the alternatives to show."""

    ids: list[list[int]]
    top_n: int


class PromptNotScored(RouterError):
    """A reply asked to echo the prompt with logprobs came back without the prompt's scores."""


def _by_key(top, names: dict[int, bytes], limit: int | None = None) -> dict[str, float]:
    """The legacy shape keys candidates by name (token_key: one per id, so candidates never merge)."""
    return {token_key(c.token_id, names[c.token_id]): c.logprob for c in top.candidates[:limit]}


def prompt_logprobs(p: Piece, ids: list[int], top_n: int, names: dict[int, bytes]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first position, then per position the prompt token and the
    top_n most likely, each keyed by its id (as a string) with its logprob, rank (1: the most likely) and
    decoded_token (token_key)."""
    scored = _scored(p, ids)
    out: list[dict | None] = [None]
    for pos, (lp, rank) in enumerate(zip(scored.logprobs, scored.ranks)):
        token = ids[pos + 1]
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": token_key(token, names[token])}}
        candidates = scored.top_logprobs[pos].candidates[:top_n] if scored.top_logprobs else []
        for r, c in enumerate(candidates, 1):
            entry.setdefault(str(c.token_id), {"logprob": c.logprob, "rank": r,
                                               "decoded_token": token_key(c.token_id, names[c.token_id])})
        out.append(entry)
    return out


def _scored(p: Piece, ids: list[int]) -> common_pb2.PromptLogprobs:
    scored = p.prompt_logprobs
    if scored is None or len(scored.logprobs) != len(ids) - 1:
        raise PromptNotScored(f"the shard scored {0 if scored is None else len(scored.logprobs)} positions of "
                              f"a {len(ids)}-token prompt, expected {len(ids) - 1}")
    return scored


def tool_calls(calls: list[ToolCall]) -> list[schemas.ToolCall]:
    return [schemas.ToolCall(id=c.id, function=schemas.Function(name=c.name, arguments=c.arguments)) for c in calls]


def tool_call_delta(d: ToolCallDelta) -> schemas.ToolCallDelta:
    return schemas.ToolCallDelta(index=d.index, id=d.id, type="function" if d.id is not None else None,
                                 function=schemas.FunctionDelta(name=d.name, arguments=d.arguments))


def chat_completion(completion_id: str, created: int, model: str, replies: list[Reply], logprobs: bool,
                    request_id: str, names: dict[int, bytes] | None = None) -> schemas.ChatCompletion:
    """`names`: token_bytes of the replies, when they carry logprobs."""
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
               echoes: list[str], logprobs: bool, request_id: str, names: dict[int, bytes] | None = None,
               echoed: list[EchoedPrompt] | None = None, scored: ScoredPrompts | None = None) -> schemas.Completion:
    """`echoes`: the text put before each prompt's choices ("" without echo); `names` as for chat_completion (the
    prompts' ids included where echoed or scored); `echoed`: with echo and logprobs, each prompt's ids and pieces
    (its echo is their text); `scored`: vLLM's prompt_logprobs asked."""
    choices = []
    for i, r in enumerate(replies):
        echo = echoes[i // per_prompt]
        prompt = echoed[i // per_prompt] if echoed else None
        choices.append(schemas.CompletionChoice(
            index=i, text=echo + r.text, finish_reason=finish_reason(r, request_id),
            logprobs=legacy_logprobs(r, len(echo), names or {}, prompt) if logprobs else None,
            prompt_logprobs=(prompt_logprobs(r, scored.ids[i // per_prompt], scored.top_n, names or {})
                             if scored else None)))
    return schemas.Completion(id=completion_id, created=created, model=model, choices=choices,
                              usage=usage(replies, per_prompt))
