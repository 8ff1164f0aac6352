"""The one chat flow and the one completion flow of the router, shared by every front end: the gRPC Generate and
Chat RPCs (router/service.py), batch requests (router/batch/execute.py) and the HTTP API (router/http).

    completion: prompt (text or ids) -> Generation.run -> pieces
    chat:       render messages + tools (tokenizer) -> Generation.run with special tokens kept, end-of-turn hidden,
                tool_choice enforced by a decoding constraint (router/tool_choice.py)
                -> reasoning / content split as the text streams -> tool calls parsed at the end -> tool_choice check

A request is prepared once (`*_prompt`) and run by `choices` as its n choices (OpenAI's `n`, over one or several
prompts): their ids claimed together (router/request_ids.py), per-choice seeds, one merged stream of pieces.

Every request runs as its tenant (kimiserve/tenants.py), resolved by the front end from the caller's API key (a
batch request: the batch's tenant): `choices` takes it and hands it to each sequence's `run`, and `run` to
Generation.run (the request's log line and span name it).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

from kimiserve.kimi_chat import ReplySplitter
from kimiserve.limits import MAX_N
from kimiserve.tenants import Tenant
from kimiserve.v1 import common_pb2, router_pb2
from router import prompts, tool_choice
from router.cache_salt import cache_salt_for, check_request_salt
from router.errors import InvalidArgument
from router.generation import Generation, Piece
from router.request_ids import sequence_ids

log = logging.getLogger(__name__)


@dataclass
class Reply(Piece):
    """A whole flow's output: its pieces concatenated."""

    def add(self, p: Piece) -> None:
        self.token_ids += p.token_ids
        self.logprobs += p.logprobs
        self.top_logprobs += p.top_logprobs
        self.token_texts += p.token_texts
        self.text += p.text
        self.reasoning += p.reasoning
        self.reasoning_tokens = p.reasoning_tokens
        self.tool_calls += p.tool_calls
        self.prompt_logprobs = self.prompt_logprobs or p.prompt_logprobs
        if p.final:
            self.finish_reason, self.usage, self.error_message = p.finish_reason, p.usage, p.error_message


async def collect(pieces: AsyncIterator[Piece]) -> Reply:
    reply = Reply()
    async for p in pieces:
        reply.add(p)
    return reply


@dataclass(frozen=True)
class Prompt:
    """A request made ready to run (validated, rendered, tokenized): the n sequences of one request share it."""

    ids: list[int]
    chat: bool = False  # read the reply as a chat reply (special tokens kept, split, tool calls parsed)
    tool_choice: router_pb2.ToolChoice = field(default_factory=router_pb2.ToolChoice)
    parallel_tool_calls: bool = True  # ChatRequest.parallel_tool_calls: false allows at most one call
    # The response_format that enforces tool_choice while decoding (router/tool_choice.py); None: no constraint.
    constraint: common_pb2.ResponseFormat | None = None
    # The request's own prefix-cache salt (Generation.run mixes the tenant in: router/cache_salt.py) and, for chat,
    # where the rendered messages end (the shard snapshots its prefix cache there).
    cache_salt: str = ""
    message_ends: tuple[int, ...] = ()


def _no_client_tool_calls(s: common_pb2.SamplingParams) -> None:
    if s.HasField("response_format") and s.response_format.WhichOneof("kind") == "tool_calls":
        raise InvalidArgument("sampling.response_format.tool_calls is set by the router from ChatRequest.tool_choice;"
                              " use tool_choice 'required' or a named function", "response_format")


async def completion_prompt(gen: Generation, req: router_pb2.GenerateRequest) -> Prompt:
    _no_client_tool_calls(req.sampling)
    salt = check_request_salt(req.cache_salt)
    return Prompt(await prompts.generate_prompt(gen, req), cache_salt=salt)


async def chat_prompt(gen: Generation, req: router_pb2.ChatRequest, tenant: Tenant) -> Prompt:
    """`tenant`'s chat request rendered (the tokenizer caches its pieces under the request's whole salt)."""
    _no_client_tool_calls(req.sampling)
    offered = tool_choice.offered_tools(req.tools, req.tool_choice)
    if len(offered) != len(req.tools):
        req = _with_tools(req, offered)
    salt = check_request_salt(req.cache_salt)
    # renders the tools: malformed ones are refused here, by index
    ids, ends = await prompts.chat_prompt(gen, req, cache_salt_for(tenant.name, salt))
    parallel = not req.HasField("parallel_tool_calls") or req.parallel_tool_calls
    return Prompt(ids, chat=True, tool_choice=req.tool_choice, parallel_tool_calls=parallel,
                  constraint=tool_choice.constraint(offered, req.tool_choice, req.sampling, parallel),
                  cache_salt=salt, message_ends=ends)


def _with_tools(req: router_pb2.ChatRequest, tools: list[common_pb2.Tool]) -> router_pb2.ChatRequest:
    out = router_pb2.ChatRequest()
    out.CopyFrom(req)
    del out.tools[:]
    out.tools.extend(tools)
    return out


async def run(gen: Generation, method: str, request_id: str, prompt: Prompt,
              sampling: common_pb2.SamplingParams, tenant: Tenant) -> AsyncIterator[Piece]:
    """One sequence from a prepared prompt, for `tenant`; `request_id` is its sequence id, claimed by `choices`."""
    if not prompt.chat:
        async for piece in gen.run(method, request_id, prompt.ids, sampling, tenant, cache_salt=prompt.cache_salt):
            yield piece
        return
    if prompt.constraint is not None:
        constrained = common_pb2.SamplingParams()
        constrained.CopyFrom(sampling)
        constrained.response_format.CopyFrom(prompt.constraint)
        sampling = constrained
    splitter = ReplySplitter()
    async for piece in gen.run(method, request_id, prompt.ids, sampling, tenant, keep_special_tokens=True,
                               hidden_ids=prompts.chat_hidden_ids(gen.tokenizer.info), cache_salt=prompt.cache_salt,
                               message_ends=prompt.message_ends):
        piece.reasoning, piece.text, piece.tool_call_deltas = splitter.feed(piece.text, len(piece.token_ids))
        piece.reasoning_tokens = splitter.reasoning_tokens
        if piece.final:
            r, c, deltas, piece.tool_calls = splitter.finish()
            piece.reasoning, piece.text, piece.tool_call_deltas = (piece.reasoning + r, piece.text + c,
                                                                   piece.tool_call_deltas + deltas)
            if piece.usage is not None:  # the shard's counts, plus what only the split knows
                usage = common_pb2.Usage()
                usage.CopyFrom(piece.usage)
                usage.reasoning_tokens = piece.reasoning_tokens
                piece.usage = usage
            if piece.finish_reason == common_pb2.FINISH_REASON_STOP:  # a reply cut by max_tokens is just cut
                tool_choice.check_reply(prompt.tool_choice, piece.tool_calls, request_id, prompt.parallel_tool_calls)
        yield piece


async def request(gen: Generation, method: str, request_id: str,
                  req: router_pb2.GenerateRequest | router_pb2.ChatRequest, tenant: Tenant
                  ) -> AsyncIterator[tuple[int, Piece]]:
    """A whole Generate or Chat request of `tenant` (the gRPC RPCs', a batch line's): its n choices as (choice
    index, piece)."""
    count = choice_count(req.n)
    is_chat = isinstance(req, router_pb2.ChatRequest)
    prompt = await (chat_prompt(gen, req, tenant) if is_chat else completion_prompt(gen, req))
    async for item in choices(gen, method, request_id, [(prompt, req.sampling)], count, tenant):
        yield item


# ---- several sequences as one request ----------------------------------------------------------------------------

def choice_count(n: int) -> int:
    """A Generate / Chat request's `n`: 0 (unset) is 1; above MAX_N is INVALID_ARGUMENT naming the bound."""
    if n > MAX_N:
        raise InvalidArgument(f"n must be in [1, {MAX_N}] (0 or unset: 1), got {n}", "n")
    return n or 1


def choice_sampling(s: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Sampling of choice `index` of n: the same, with seed + index (mod 2^64) when a seed is set, so choices differ
    but the request stays reproducible, and choice 0 equals the single request. Unset seeds stay unset here:
    Generation.run draws a fresh one per sampled sequence."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(s)
    if s.HasField("seed"):
        out.seed = (s.seed + index) % (1 << 64)
    return out


async def choices(gen: Generation, method: str, request_id: str,
                  prompts_: list[tuple[Prompt, common_pb2.SamplingParams]], n: int, tenant: Tenant
                  ) -> AsyncIterator[tuple[int, Piece]]:
    """The n choices of each prompt of one request of `tenant`, as (choice index, piece) in arrival order; choice
    index = prompt index * n + i, and choice i of a prompt samples with choice_sampling(sampling, i). The request
    id and every sequence id are claimed at once before anything runs (AlreadyExists if one is live)."""
    ids = sequence_ids(request_id, len(prompts_) * n)
    claim = gen.live.claim(tenant.name, request_id, ids)
    if any(sid != shard_id for sid, shard_id in claim.shard_ids.items()):
        log.info("request runs under an alias on the shards (another tenant's live request has its id)",
                 extra={"request_id": request_id, "tenant": tenant.name, "shard_ids": list(claim.shard_ids.values())})
    try:
        async for k, piece in fan_out([run(gen, method, claim.shard_ids[ids[p * n + i]], prompt,
                                           choice_sampling(s, i), tenant)
                                       for p, (prompt, s) in enumerate(prompts_) for i in range(n)]):
            if piece.final:
                gen.live.release(claim, ids[k])  # before the client sees the last chunk and may reuse the id
            yield k, piece
    finally:  # a failure or cancellation: every sequence's id, started or not
        for sid in ids:
            gen.live.release(claim, sid)


def total_usage(usages: list[common_pb2.Usage | None], per_prompt: int) -> common_pb2.Usage:
    """A request's usage from its choices' (in choice-index order): each prompt counted once (choices
    i*per_prompt .. share it; its first choice's cache hits are the prompt's), completion and reasoning tokens
    summed."""
    firsts = [u for u in usages[::per_prompt] if u is not None]
    return common_pb2.Usage(prompt_tokens=sum(u.prompt_tokens for u in firsts),
                            completion_tokens=sum(u.completion_tokens for u in usages if u is not None),
                            cached_prompt_tokens=sum(u.cached_prompt_tokens for u in firsts),
                            reasoning_tokens=sum(u.reasoning_tokens for u in usages if u is not None))


_DONE = object()


async def fan_out(flows: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece]]:
    """(flow index, piece) from every flow as they arrive. The first failure cancels the other flows and is raised;
    closing or cancelling the merged stream cancels every flow, and each one's cancellation aborts its sequence on
    its shard (Generation._stream)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, flow: AsyncIterator[Piece]) -> None:
        try:
            async for piece in flow:
                await queue.put((i, piece))
            await queue.put((i, _DONE))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, f)) for i, f in enumerate(flows)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
