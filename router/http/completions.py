"""POST /v1/completions: the completion flow (router/flow.py) for each prompt and each of its n choices (choice
index = prompt index * n + choice), answered whole or as SSE."""

from __future__ import annotations

import time

from kimiserve.v1 import router_pb2
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
    echoes = await echo_texts(gen, requests) if opts.echo else [""] * len(requests)
    head = dict(completion_id=f"cmpl-{request_id}", created=int(time.time()), model=gen.model_info().model_name)
    if not opts.stream:
        async def whole() -> schemas.Completion:
            got = [flow.Reply() for _ in range(count)]
            async for i, piece in merged:
                got[i].add(piece)
            return replies.completion(**head, replies=got, per_prompt=opts.n, echoes=echoes,
                                      logprobs=opts.logprobs, request_id=request_id,
                                      names=await replies.candidate_texts(gen, got))
        return await unless_disconnected(receive, whole())
    first = await unless_disconnected(receive, merged.__anext__())  # refusals before the 200 (see chat.py)
    chunks = Chunks(gen, **head, per_prompt=opts.n, echoes=echoes, logprobs=opts.logprobs)
    return EventStream(sse_events(first, merged, chunks, opts.include_usage, request_id), request_id)


class Chunks:
    """text_completion chunks of one streamed request."""

    def __init__(self, gen: Generation, completion_id: str, created: int, model: str, per_prompt: int,
                 echoes: list[str], logprobs: bool):
        self.gen, self.head = gen, dict(id=completion_id, created=created, model=model)
        self.per_prompt, self.echoes, self.logprobs = per_prompt, echoes, logprobs
        count = per_prompt * len(echoes)
        self.offsets = [len(echoes[i // per_prompt]) for i in range(count)]  # text_offset of each choice's next token
        self.finals: list[flow.Piece | None] = [None] * count

    def chunk(self, choices: list[schemas.CompletionChoice], usage: schemas.Usage | None = None) -> str:
        return event(schemas.Completion(**self.head, choices=choices, usage=usage).model_dump())

    def start(self) -> list[str]:
        return [self.chunk([schemas.CompletionChoice(index=i, text=self.echoes[i // self.per_prompt])])
                for i in range(len(self.finals)) if self.echoes[i // self.per_prompt]]

    async def piece(self, i: int, p: flow.Piece, request_id: str) -> str | None:
        reason = replies.finish_reason(p, request_id) if p.final else None
        if p.final:
            self.finals[i] = p
        if not (p.text or p.final or (self.logprobs and p.token_ids)):
            return None
        logprobs = (replies.legacy_logprobs(p, self.offsets[i], await replies.candidate_texts(self.gen, [p]))
                    if self.logprobs else None)
        self.offsets[i] += sum(len(t) for t in p.token_texts)
        return self.chunk([schemas.CompletionChoice(index=i, text=p.text, logprobs=logprobs, finish_reason=reason)])

    def usage(self) -> str:
        return self.chunk([], usage=replies.usage([p for p in self.finals if p is not None], self.per_prompt))
