"""The one chat flow and the one completion flow of the router, shared by every front end: the gRPC Generate and
Chat RPCs (router/service.py), batch requests (router/batch/execute.py) and the HTTP API (router/http).

    completion: prompt (text or ids) -> Generation.run -> pieces
    chat:       render messages + tools (tokenizer) -> Generation.run with special tokens kept, end-of-turn hidden
                -> reasoning / content split as the text streams -> tool calls parsed at the end -> tool_choice check

A request is prepared once (`*_prompt`) and `run` as one or more sequences; `fan_out` runs several as one request
(OpenAI's `n`, or several prompts) and merges their pieces.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import AsyncIterator

from kimiserve.kimi_chat import ReplySplitter, ToolCall
from kimiserve.v1 import common_pb2, router_pb2
from router.errors import InvalidArgument, ToolChoiceNotMet
from router import prompts
from router.generation import Chunk, Generation

ToolChoice = router_pb2.ToolChoice


@dataclass
class Piece:
    """One step of a flow's output (one token, or the end). The last piece has finish_reason and usage."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per token id, with SamplingParams.logprobs
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)  # one per token id, when asked for
    token_texts: list[str] = field(default_factory=list)  # what each token added to the text (see Chunk)
    text: str = ""  # completion text, or chat content, since the previous piece
    reasoning: str = ""  # chat: <think> text since the previous piece
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat, last piece only
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    error_message: str = ""

    @property
    def final(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


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
        self.tool_calls += p.tool_calls
        if p.final:
            self.finish_reason, self.usage, self.error_message = p.finish_reason, p.usage, p.error_message


async def collect(pieces: AsyncIterator[Piece]) -> Reply:
    reply = Reply()
    async for p in pieces:
        reply.add(p)
    return reply


def _piece(chunk: Chunk, **text) -> Piece:
    return Piece(list(chunk.token_ids), list(chunk.logprobs), list(chunk.top_logprobs), list(chunk.token_texts),
                 finish_reason=chunk.finish_reason, usage=chunk.usage, error_message=chunk.error_message, **text)


@dataclass(frozen=True)
class Prompt:
    """A request made ready to run (validated, rendered, tokenized): the n sequences of one request share it."""

    ids: list[int]
    chat: bool = False  # read the reply as a chat reply (special tokens kept, split, tool calls parsed)
    tool_choice: router_pb2.ToolChoice = field(default_factory=router_pb2.ToolChoice)


async def completion_prompt(gen: Generation, req: router_pb2.GenerateRequest) -> Prompt:
    return Prompt(await prompts.generate_prompt(gen, req))


async def chat_prompt(gen: Generation, req: router_pb2.ChatRequest) -> Prompt:
    offered = offered_tools(req.tools, req.tool_choice)
    if len(offered) != len(req.tools):
        req = _with_tools(req, offered)
    return Prompt(await prompts.chat_prompt(gen, req), chat=True, tool_choice=req.tool_choice)


async def run(gen: Generation, method: str, request_id: str, prompt: Prompt,
              sampling: common_pb2.SamplingParams) -> AsyncIterator[Piece]:
    """One sequence from a prepared prompt."""
    if not prompt.chat:
        async for chunk in gen.run(method, request_id, prompt.ids, sampling):
            yield _piece(chunk, text=chunk.text)
        return
    splitter = ReplySplitter()
    async for chunk in gen.run(method, request_id, prompt.ids, sampling, keep_special_tokens=True,
                               hidden_ids=prompts.chat_hidden_ids(gen.tokenizer.info)):
        reasoning, content = splitter.feed(chunk.text)
        calls: list[ToolCall] = []
        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            r, c, calls = splitter.finish()
            reasoning, content = reasoning + r, content + c
            if chunk.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH):
                check_tool_choice(prompt.tool_choice, calls, request_id)
        yield _piece(chunk, text=content, reasoning=reasoning, tool_calls=calls)


async def completion(gen: Generation, method: str, request_id: str,
                     req: router_pb2.GenerateRequest) -> AsyncIterator[Piece]:
    """A whole completion request (one sequence), as Generate and batch lines run it."""
    async for piece in run(gen, method, request_id, await completion_prompt(gen, req), req.sampling):
        yield piece


async def chat(gen: Generation, method: str, request_id: str, req: router_pb2.ChatRequest) -> AsyncIterator[Piece]:
    """A whole chat request (one sequence), as Chat and batch lines run it."""
    async for piece in run(gen, method, request_id, await chat_prompt(gen, req), req.sampling):
        yield piece


# ---- tools and tool_choice ---------------------------------------------------------------------------------------

def tool_name(tool: common_pb2.Tool) -> str:
    if tool.WhichOneof("definition") == "function":
        return tool.function.name
    try:
        fn = json.loads(tool.json).get("function", {})
    except (json.JSONDecodeError, AttributeError):
        return ""  # malformed tools are refused by the tokenizer service with the tool's index
    return fn.get("name", "") if isinstance(fn, dict) else ""


def offered_tools(tools, choice: router_pb2.ToolChoice) -> list[common_pb2.Tool]:
    """The tools declared to the model under `choice`: none for NONE, only the named one for FUNCTION."""
    if choice.mode == ToolChoice.MODE_NONE:
        return []
    if choice.mode == ToolChoice.MODE_REQUIRED and not tools:
        raise InvalidArgument("tool_choice 'required' needs at least one tool in tools")
    if choice.mode == ToolChoice.MODE_FUNCTION:
        named = [t for t in tools if tool_name(t) == choice.function_name]
        if not named:
            raise InvalidArgument(f"tool_choice names function {choice.function_name!r}, which is not in tools "
                                  f"{[tool_name(t) for t in tools]}")
        return named[:1]
    return list(tools)


def _with_tools(req: router_pb2.ChatRequest, tools: list[common_pb2.Tool]) -> router_pb2.ChatRequest:
    out = router_pb2.ChatRequest()
    out.CopyFrom(req)
    del out.tools[:]
    out.tools.extend(tools)
    return out


def check_tool_choice(choice: router_pb2.ToolChoice, calls: list[ToolCall], request_id: str) -> None:
    """REQUIRED / FUNCTION are not enforced while decoding yet (that needs constrained decoding); a reply that breaks
    them is refused here rather than returned as if it complied."""
    if choice.mode == ToolChoice.MODE_REQUIRED and not calls:
        raise ToolChoiceNotMet(f"request {request_id!r}: tool_choice 'required' but the reply made no tool call "
                               "(tool_choice is checked, not yet enforced by constrained decoding)")
    if choice.mode == ToolChoice.MODE_FUNCTION and (not calls or any(c.name != choice.function_name for c in calls)):
        raise ToolChoiceNotMet(f"request {request_id!r}: tool_choice names {choice.function_name!r} but the reply "
                               f"called {[c.name for c in calls]} (tool_choice is checked, not yet enforced by "
                               "constrained decoding)")


# ---- several sequences as one request ----------------------------------------------------------------------------

def choice_sampling(s: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Sampling of choice `index` of n: the same, with seed + index (mod 2^64) when a seed is set, so choices differ
    but the request stays reproducible, and choice 0 equals the single request. Unset seeds stay unset: the shard
    draws a fresh one per sequence."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(s)
    if s.HasField("seed"):
        out.seed = (s.seed + index) % (1 << 64)
    return out


def choice_request_id(request_id: str, index: int, count: int) -> str:
    """The id of one sequence of a request of `count` sequences: the request id itself when it is alone."""
    return request_id if count == 1 else f"{request_id}:{index}"


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
