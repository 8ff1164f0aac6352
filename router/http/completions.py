"""POST /v1/completions: the completion flow (router/flow.py) for each prompt and each of its n choices (choice
index = prompt index * n + choice), answered whole or as SSE."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator

from kimiserve.v1 import common_pb2, router_pb2
from kimiserve.tenants import Tenant
from router import flow, openai_body
from router.generation import Generation
from router.http import replies, schemas
from router.http.streaming import EventStream, event, sse_events, unless_disconnected

METHOD = "HttpCompletions"  # the metrics' method label


async def echo_texts(gen: Generation, prompts: list[router_pb2.GenerateRequest]) -> list[str]:
    return [req.text if req.WhichOneof("prompt") == "text"
            else await gen.tokenizer.detokenize(list(req.prompt_token_ids.ids)) for req in prompts]


async def handle(gen: Generation, body: dict, request_id: str, tenant: Tenant, receive):
    requests, opts = openai_body.completion_requests(body)
    prompts = [await flow.completion_prompt(gen, req) for req in requests]  # each tokenized once for its n
    count = len(prompts) * opts.n
    merged = flow.choices(gen, METHOD, request_id, [(prompt, req.sampling) for req, prompt in zip(requests, prompts)],
                          opts.n, tenant)
    if opts.score_only:
        merged = _scored_only(merged)
    echoed = None
    if opts.echo and opts.logprobs:  # the echo is the prompt's tokens' pieces, so text_offset indexes into it
        names = await gen.tokenizer.token_bytes([i for p in prompts for i in p.ids])
        echoed = [replies.EchoedPrompt(p.ids, replies.token_pieces(p.ids, names), opts.top_logprobs) for p in prompts]
        echoes = [e.text for e in echoed]
    else:
        echoes = await echo_texts(gen, requests) if opts.echo else [""] * len(requests)
    scored = (replies.ScoredPrompts([p.ids for p in prompts], opts.prompt_logprobs)
              if opts.prompt_logprobs is not None else None)
    shown = [e.ids for e in echoed or ()] + (scored.ids if scored else [])  # prompts whose tokens are named
    head = dict(completion_id=f"cmpl-{request_id}", created=int(time.time()), model=gen.model_info().model_name)
    if not opts.stream:
        async def whole() -> schemas.Completion:
            got = [flow.Reply() for _ in range(count)]
            async for i, piece in merged:
                got[i].add(piece)
            names = await replies.token_bytes(gen, got, shown) if opts.logprobs or scored else {}
            return replies.completion(**head, replies=got, per_prompt=opts.n, echoes=echoes, logprobs=opts.logprobs,
                                      request_id=request_id, names=names, echoed=echoed, scored=scored)
        return await unless_disconnected(receive, whole())
    first = await unless_disconnected(receive, merged.__anext__())  # refusals before the 200 (see chat.py)
    chunks = Chunks(gen, **head, per_prompt=opts.n, echoes=echoes, logprobs=opts.logprobs, echoed=echoed,
                    prompt_tokens=[len(p.ids) for p in prompts] if opts.continuous_usage else None, scored=scored)
    return EventStream(sse_events(first, merged, chunks, opts.include_usage, request_id), request_id)


async def _scored_only(merged: AsyncIterator[tuple[int, flow.Piece]]) -> AsyncIterator[tuple[int, flow.Piece]]:
    """max_tokens 0 with echo: the token each shard drew at the end of its prefill is dropped, and the choice ends
    as a length finish with no completion tokens (a failure still ends as one)."""
    try:
        async for i, p in merged:
            reason, usage = p.finish_reason, p.usage
            if reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
                reason = common_pb2.FINISH_REASON_LENGTH
            if usage is not None:
                usage = common_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                                         cached_prompt_tokens=usage.cached_prompt_tokens)
            yield i, replace(p, token_ids=[], logprobs=[], top_logprobs=[], token_texts=[], text="",
                             finish_reason=reason, usage=usage)
    finally:
        await merged.aclose()


class Chunks:
    """text_completion chunks of one streamed request."""

    def __init__(self, gen: Generation, completion_id: str, created: int, model: str, per_prompt: int,
                 echoes: list[str], logprobs: bool, echoed: list[replies.EchoedPrompt] | None = None,
                 prompt_tokens: list[int] | None = None, scored: replies.ScoredPrompts | None = None):
        """prompt_tokens: each prompt's length, for usage on every chunk (continuous_usage_stats); None: none.
        scored: vLLM's prompt_logprobs, sent with each choice's first chunk."""
        self.gen, self.head = gen, dict(id=completion_id, created=created, model=model)
        self.per_prompt, self.echoes, self.logprobs = per_prompt, echoes, logprobs
        self.echoed, self.prompt_tokens = echoed, prompt_tokens
        count = per_prompt * len(echoes)
        self.offsets = [len(echoes[i // per_prompt]) for i in range(count)]  # text_offset of each choice's next token
        self.finals: list[flow.Piece | None] = [None] * count
        self.generated = [0] * count  # tokens each choice has streamed, for continuous usage
        # echo + logprobs: the echo goes out with the choice's first piece, which carries the prompt's scores
        self.echo_pending = [echoed is not None] * count
        self.scored, self.scores_pending = scored, [scored is not None] * count

    def chunk(self, choices: list[schemas.CompletionChoice], usage: schemas.Usage | None = None) -> str:
        return event(schemas.Completion(**self.head, choices=choices, usage=usage).model_dump())

    def start(self) -> list[str]:
        return [self.chunk([schemas.CompletionChoice(index=i, text=self.echoes[i // self.per_prompt])],
                           usage=self._usage(i, 0))
                for i in range(len(self.finals)) if self.echoes[i // self.per_prompt] and not self.echo_pending[i]]

    def _usage(self, i: int, generated: int) -> schemas.Usage | None:
        """continuous_usage_stats: choice i's prompt and what it generated so far (None: not asked)."""
        if self.prompt_tokens is None:
            return None
        prompt = self.prompt_tokens[i // self.per_prompt]
        return schemas.Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)

    async def piece(self, i: int, p: flow.Piece, request_id: str) -> str | None:
        reason = replies.finish_reason(p, request_id) if p.final else None
        if p.final:
            self.finals[i] = p
        self.generated[i] += len(p.token_ids)
        echoed = self.echoed[i // self.per_prompt] if self.echo_pending[i] else None
        scored = self.scored.ids[i // self.per_prompt] if self.scores_pending[i] else None
        if not (p.text or p.final or echoed or scored or (self.logprobs and p.token_ids)):
            return None
        self.echo_pending[i] = self.scores_pending[i] = False
        logprobs = prompt_logprobs = None
        if self.logprobs or scored:
            names = await replies.token_bytes(self.gen, [p], [ids for ids in (echoed and echoed.ids, scored) if ids])
            logprobs = replies.legacy_logprobs(p, self.offsets[i], names, echoed) if self.logprobs else None
            prompt_logprobs = replies.prompt_logprobs(p, scored, self.scored.top_n, names) if scored else None
        self.offsets[i] += sum(len(t) for t in p.token_texts)
        text = (echoed.text if echoed else "") + p.text
        return self.chunk([schemas.CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=reason,
                                                    prompt_logprobs=prompt_logprobs)],
                          usage=(replies.usage_so_far(p, self.prompt_tokens[i // self.per_prompt], self.generated[i])
                                 if self.prompt_tokens is not None else None))

    def usage(self) -> str:
        return self.chunk([], usage=replies.usage([p for p in self.finals if p is not None], self.per_prompt))
