"""POST /v1/responses: OpenAI's Responses API over the chat flow (router/openai_responses.py translates the body).

A reply becomes output items in the order the model wrote them: a `reasoning` item (a reply opening with
<think>...</think>), a `message` item with one output_text part, a `function_call` item per tool call (its arguments
streamed as they are written), and another `message` for text after the calls. Streamed, each item is opened, filled
by deltas and closed with OpenAI's typed events (`response.created`, `...output_item.added`,
`...output_text.delta`, ..., `response.completed` or `response.incomplete` when max_output_tokens cut it), each with
its sequence_number; a failure after the stream began is a `response.failed` event. The whole response is built by
the same state machine with its events dropped, so both answers hold the same items.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi.responses import JSONResponse

from kimiserve.kimi_chat import ToolCallDelta
from kimiserve.tenants import Tenant
from router import flow, openai_responses
from router.generation import Generation
from router.http import replies
from router.http.streaming import EventStream, unless_disconnected
from router.openai_responses import Echo

METHOD = "HttpResponses"  # the metrics' method label


async def handle(gen: Generation, body: dict, request_id: str, tenant: Tenant, receive):
    req, opts = openai_responses.responses_request(body)
    prompt = await flow.chat_prompt(gen, req, tenant)
    merged = flow.choices(gen, METHOD, request_id, [(prompt, req.sampling)], 1, tenant)
    head = Head(id=f"resp_{request_id}", created_at=int(time.time()), model=gen.model_info().model_name,
                echo=opts.echo, encrypted_reasoning=opts.encrypted_reasoning)
    async def names(p: flow.Piece) -> dict[int, bytes]:
        """The bytes of p's tokens and candidates, fetched only when logprobs are asked for."""
        return await replies.token_bytes(gen, [p]) if opts.logprobs and p.token_ids else {}

    if not opts.stream:
        async def whole() -> JSONResponse:
            items = Items(head, request_id, opts.logprobs)
            async for _, piece in merged:
                items.piece(piece, await names(piece))
            return JSONResponse(items.final)
        return await unless_disconnected(receive, whole())
    # As for chat: a request refused up front is an HTTP error, not a failure event inside a 200 stream.
    first = await unless_disconnected(receive, merged.__anext__())
    return EventStream(_events(Items(head, request_id, opts.logprobs), names, first[1], merged), request_id)


async def _events(items: Items, names: Callable[[flow.Piece], Awaitable[dict[int, bytes]]], first: flow.Piece,
                  rest: AsyncIterator) -> AsyncIterator[str]:
    from router.http.errors import describe

    try:
        yield items.event("response.created", response=items.snapshot("in_progress"))
        yield items.event("response.in_progress", response=items.snapshot("in_progress"))
        for out in items.piece(first, await names(first)):
            yield out
        async for _, p in rest:
            for out in items.piece(p, await names(p)):
                yield out
    except Exception as e:  # noqa: BLE001 - after the 200 has gone out, a failure is an event in the stream
        error = describe(e, items.request_id)[1]["error"]
        failed = items.snapshot("failed") | {"error": {"code": error["code"], "message": error["message"]}}
        yield items.event("response.failed", response=failed)
    finally:
        await rest.aclose()


def finished_response(head: Head, reply: flow.Reply, request_id: str) -> dict[str, Any]:
    """The response object of a reply that ended (a batch result, its calls whole): what the endpoint answers."""
    items = Items(head, request_id)
    reply.tool_call_deltas = [ToolCallDelta(k, c.arguments, c.id, c.name) for k, c in enumerate(reply.tool_calls)]
    items.piece(reply, {})
    return items.final


@dataclass(frozen=True)
class Head:
    id: str
    created_at: int
    model: str
    echo: Echo
    encrypted_reasoning: bool = False  # include names reasoning.encrypted_content


class Items:
    """The output items of one reply, fed piece by piece; each call returns the SSE events it makes.

    With logprobs, the message's output_text carries an entry for every token after the thinking block (as chat's
    logprobs do: the end of turn included) up to the first tool call; a function_call item has no logprobs, so the
    tokens written while one is open have none (text after the calls carries its own). Each text delta carries the
    entries of the tokens that arrived since the previous one (a token whose text is held back waits for the next
    delta), and closing the message sends the rest in a delta with no text, so the deltas' entries add up to the
    part's."""

    def __init__(self, head: Head, request_id: str, logprobs: bool = False):
        self.head, self.request_id, self.logprobs = head, request_id, logprobs
        self.entries: list[dict[str, Any]] = []  # a logprob entry per token of the reply
        self.entries_sent = 0  # how many of them text deltas have carried (or the thinking block held)
        self.reply = flow.Reply()
        self.output: list[dict[str, Any]] = []  # closed items
        self.open: dict[str, Any] | None = None  # the reasoning, message or function_call item being streamed
        self.open_text = ""  # its text, or its arguments
        self.open_entries: list[dict[str, Any]] = []  # the open message's logprob entries sent so far
        self.opened: dict[str, int] = {}  # items of each type opened so far, for their ids
        self.sequence = 0
        self.final: dict[str, Any] | None = None  # the whole response, once the reply ended

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n"

    def piece(self, p: flow.Piece, names: dict[int, bytes]) -> list[str]:
        """`names`: the bytes of p's tokens and candidates (replies.token_bytes), when logprobs are asked for."""
        self.reply.add(p)
        if self.logprobs:
            self.entries += _entries(p, names)
        out: list[str] = []
        if p.reasoning:
            out += self._text("reasoning", p.reasoning)
        if p.text:
            out += self._text("message", p.text)
        for d in p.tool_call_deltas:
            if d.id is not None:
                out += self._close("completed") + self._open_call(d)
            if d.arguments:
                self.open_text += d.arguments
                out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=d.arguments))
        if p.final:
            out += self._finish()
        return out

    def snapshot(self, status: str) -> dict[str, Any]:
        e = self.head.echo
        return {"id": self.head.id, "object": "response", "created_at": self.head.created_at, "status": status,
                "error": None, "incomplete_details": None, "instructions": e.instructions,
                "max_output_tokens": e.max_output_tokens, "model": self.head.model, "output": list(self.output),
                "parallel_tool_calls": e.parallel_tool_calls, "previous_response_id": None, "reasoning": None,
                "store": False, "background": False, "temperature": e.temperature, "top_p": e.top_p,
                "text": {"format": e.text_format, "verbosity": "medium"}, "tool_choice": e.tool_choice,
                "tools": e.tools, "truncation": "disabled", "metadata": e.metadata, "usage": None}

    def _finish(self) -> list[str]:
        reason = replies.finish_reason(self.reply, self.request_id)  # raises for a failed or cancelled sequence
        status = "incomplete" if reason == "length" else "completed"
        cut = self.open is not None and self.open["type"] == "function_call" and self.reply.tool_calls[-1].cut
        out = self._close("incomplete" if cut else status)
        if not any(item["type"] in ("message", "function_call") for item in self.output):
            out += self._open("message") + self._close(status)  # a reply with no text still has its message
        u = replies.usage([self.reply], 1)
        usage = {"input_tokens": u.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                 "output_tokens": u.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": u.completion_tokens_details.reasoning_tokens},
                 "total_tokens": u.total_tokens}
        self.final = self.snapshot(status) | {"usage": usage}
        if status == "incomplete":
            self.final["incomplete_details"] = {"reason": "max_output_tokens"}
        return out + [self.event(f"response.{status}", response=self.final)]

    def _text(self, kind: str, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self._close("completed") + self._open(kind)
        self.open_text += text
        if kind == "message":
            entries = self._unsent()
            self.open_entries += entries
            out.append(self.event("response.output_text.delta", **self._where(), delta=text, logprobs=entries))
        else:
            out.append(self.event("response.reasoning_text.delta", **self._where(), delta=text))
        return out

    def _item_id(self, prefix: str) -> str:
        """The first item of a type is PREFIX_REQUESTID, later ones (text after tool calls) _1, _2, ..."""
        n = self.opened.get(prefix, 0)
        self.opened[prefix] = n + 1
        return f"{prefix}_{self.request_id}" + (f"_{n}" if n or prefix == "fc" else "")

    def _open(self, kind: str) -> list[str]:
        if kind == "message":
            self.open = {"id": self._item_id("msg"), "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}
        else:
            self.open = {"id": self._item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                         "content": []}
        self.open_text, self.open_entries = "", []
        return [self.event("response.output_item.added", output_index=len(self.output), item=dict(self.open)),
                self.event("response.content_part.added", **self._where(), part=self._part(""))]

    def _open_call(self, d: ToolCallDelta) -> list[str]:
        self.open = {"id": self._item_id("fc"), "type": "function_call", "status": "in_progress",
                     "call_id": d.id, "name": d.name, "arguments": ""}
        self.open_text = ""
        return [self.event("response.output_item.added", output_index=len(self.output), item=dict(self.open))]

    def _close(self, status: str) -> list[str]:
        if self.open is None:
            return []
        if self.open["type"] == "function_call":
            item = self.open | {"status": status, "arguments": self.open_text}
            out = [self.event("response.function_call_arguments.done", **self._where(), name=item["name"],
                              arguments=self.open_text),
                   self.event("response.output_item.done", output_index=len(self.output), item=item)]
            self.output.append(item)
            self.open = None
            self.entries_sent = len(self.entries)  # a function_call item has no logprobs: its tokens' are dropped
            return out
        out = []
        if self.open["type"] == "message":
            if rest := self._unsent():
                self.open_entries += rest
                out.append(self.event("response.output_text.delta", **self._where(), delta="", logprobs=rest))
        part = self._part(self.open_text, self.open_entries)
        if self.open["type"] == "message":
            out.append(self.event("response.output_text.done", **self._where(), text=self.open_text,
                                  logprobs=part["logprobs"]))
        else:
            out.append(self.event("response.reasoning_text.done", **self._where(), text=self.open_text))
        item = self.open | {"status": status, "content": [part]}
        if self.open["type"] == "reasoning" and self.head.encrypted_reasoning:
            item["encrypted_content"] = openai_responses.seal_reasoning(self.open_text)
        out += [self.event("response.content_part.done", **self._where(), part=part),
                self.event("response.output_item.done", output_index=len(self.output), item=item)]
        self.output.append(item)
        self.open = None
        return out

    def _where(self) -> dict[str, Any]:
        where = {"item_id": self.open["id"], "output_index": len(self.output)}
        return where if self.open["type"] == "function_call" else where | {"content_index": 0}

    def _part(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.open is not None and self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}

    def _unsent(self) -> list[dict[str, Any]]:
        """The message's entries no delta has carried yet: those after the thinking block (whose length is known by
        the time content is shown) and after the last delta's."""
        start = max(self.entries_sent, self.reply.reasoning_tokens)
        self.entries_sent = len(self.entries)
        return self.entries[start:]


def _entries(p: flow.Piece, names: dict[int, bytes]) -> list[dict[str, Any]]:
    """OpenAI's Responses logprob entries of p's tokens: chat's (token named as its candidates are, bytes, logprob,
    top_logprobs) in the Responses shape."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
             "top_logprobs": [{"token": c.token, "logprob": c.logprob, "bytes": c.bytes} for c in t.top_logprobs]}
            for t in replies.chat_logprobs(p, names).content]
