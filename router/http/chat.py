"""POST /v1/chat/completions: the chat flow (router/flow.py), n choices fanned out, answered whole or as SSE."""

from __future__ import annotations

import time

from kimiserve.tenants import Tenant
from router import flow, openai_body
from router.generation import Generation
from router.http import replies, schemas
from router.http.streaming import EventStream, event, sse_events, unless_disconnected

METHOD = "HttpChat"  # the metrics' method label


async def handle(gen: Generation, body: dict, request_id: str, tenant: Tenant, receive):
    req, opts = openai_body.chat_request(body)
    prompt = await flow.chat_prompt(gen, req, tenant)  # rendered once for the n choices
    merged = flow.choices(gen, METHOD, request_id, [(prompt, req.sampling)], opts.n, tenant)
    head = dict(completion_id=f"chatcmpl-{request_id}", created=int(time.time()), model=gen.model_info().model_name)
    if not opts.stream:
        async def whole() -> schemas.ChatCompletion:
            got = [flow.Reply() for _ in range(opts.n)]
            async for i, piece in merged:
                got[i].add(piece)
            return replies.chat_completion(**head, replies=got, logprobs=opts.logprobs, request_id=request_id,
                                           names=await replies.token_bytes(gen, got))
        return await unless_disconnected(receive, whole())
    # The first piece comes before the response starts, so a request refused up front (bad parameters, unknown
    # model, full queue) is an HTTP error, not an error event inside a 200 stream.
    first = await unless_disconnected(receive, merged.__anext__())
    chunks = Chunks(gen, **head, n=opts.n, logprobs=opts.logprobs,
                    prompt_tokens=len(prompt.ids) if opts.continuous_usage else None)
    return EventStream(sse_events(first, merged, chunks, opts.include_usage, request_id), request_id)


class Chunks:
    """chat.completion.chunk objects for one streamed request."""

    def __init__(self, gen: Generation, completion_id: str, created: int, model: str, n: int, logprobs: bool,
                 prompt_tokens: int | None = None):
        """prompt_tokens: the prompt's length, for usage on every chunk (continuous_usage_stats); None: none."""
        self.gen, self.head = gen, dict(id=completion_id, created=created, model=model)
        self.logprobs, self.prompt_tokens = logprobs, prompt_tokens
        self.finals: list[flow.Piece | None] = [None] * n
        self.generated = [0] * n  # tokens each choice has streamed, for continuous usage

    def chunk(self, choices: list[schemas.ChunkChoice], **kw) -> str:
        out = schemas.ChatCompletionChunk(**self.head, choices=choices, **kw).model_dump()
        for choice, given in zip(out["choices"], choices):  # a delta (its calls too) carries only what changed;
            choice["delta"] = given.delta.model_dump(exclude_none=True)  # finish_reason and logprobs stay (null)
        return event(out)

    def start(self) -> list[str]:
        usage = (schemas.Usage(prompt_tokens=self.prompt_tokens, completion_tokens=0, total_tokens=self.prompt_tokens)
                 if self.prompt_tokens is not None else None)
        return [self.chunk([schemas.ChunkChoice(index=i, delta=schemas.Delta(role="assistant", content=""))
                           for i in range(len(self.finals))], usage=usage)]

    async def piece(self, i: int, p: flow.Piece, request_id: str) -> str | None:
        self.generated[i] += len(p.token_ids)
        delta = schemas.Delta()
        if p.text:
            delta.content = p.text
        if p.reasoning:
            delta.reasoning_content = p.reasoning
        if p.tool_call_deltas:
            delta.tool_calls = [replies.tool_call_delta(d) for d in p.tool_call_deltas]
        reason = replies.finish_reason(p, request_id) if p.final else None
        if p.final:
            self.finals[i] = p
        if not (p.text or p.reasoning or p.tool_call_deltas or p.final or (self.logprobs and p.token_ids)):
            return None  # e.g. a token whose text is held back (a possible stop string, a partial character)
        usage = (replies.usage_so_far(p, self.prompt_tokens, self.generated[i]) if self.prompt_tokens is not None
                 else None)
        return self.chunk([schemas.ChunkChoice(index=i, delta=delta, finish_reason=reason,
                                               logprobs=replies.chat_logprobs(p, await replies.token_bytes(
                                                   self.gen, [p])) if self.logprobs else None)], usage=usage)

    def usage(self) -> str:
        return self.chunk([], usage=replies.usage([p for p in self.finals if p is not None], len(self.finals)))
