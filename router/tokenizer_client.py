"""The router's view of the tokenizer service: tokenize, render chat, and per-request incremental detokenizing.

Calls made for a request are spans under its span (`tokenize`, `render_chat`) and carry its trace context and id
in their metadata, so the tokenizer's spans join the request's trace (kimiserve/tracing.py; nothing when off).
"""

from __future__ import annotations

import asyncio

import grpc

from kimiserve import tracing
from kimiserve.limits import MAX_TOKEN_BYTES_IDS, clip
from kimiserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from router.errors import RouterError, from_tokenizer

ENDED_STATUS_WAIT_S = 5.0  # a call whose write failed has ended; its status arrives at once


def _translate(e: grpc.aio.AioRpcError) -> RouterError:
    return from_tokenizer(e.code(), clip(e.details() or ""))


class TokenizerClient:
    def __init__(self, address: str, timeout_s: float = 30.0, channel: grpc.aio.Channel | None = None):
        self.address, self.timeout = address, timeout_s
        self._channel = channel or grpc.aio.insecure_channel(address)  # a TLS channel: kimiserve.security
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self.info: tokenizer_pb2.TokenizerInfoResponse | None = None
        self._token_bytes: dict[int, bytes] = {}  # id -> its bytes; at most the vocabulary

    async def load_info(self) -> tokenizer_pb2.TokenizerInfoResponse:
        self.info = await self.stub.Info(tokenizer_pb2.TokenizerInfoRequest(), timeout=self.timeout)
        return self.info

    async def tokenize(self, text: str) -> list[int]:
        with tracing.current().child("tokenize", kind="client", chars=len(text)) as span:
            try:
                reply = await self.stub.Tokenize(tokenizer_pb2.TokenizeRequest(text=text), timeout=self.timeout,
                                                 metadata=span.metadata())
            except grpc.aio.AioRpcError as e:
                raise _translate(e) from e
            span.set("tokens", len(reply.token_ids))
        return list(reply.token_ids)

    async def render_chat(self, messages, tools, cache_salt: str = "", add_generation_prompt: bool | None = None,
                          continue_final_message: bool = False) -> tuple[list[int], tuple[int, ...]]:
        """The rendered prompt's ids and the offsets where its messages end (RenderChatResponse.message_ends).
        `cache_salt`: the request's prefix-cache salt, which keys the tokenizer's cache of rendered pieces too.
        `add_generation_prompt` None: unset, the tokenizer's default (RenderChatRequest)."""
        with tracing.current().child("render_chat", kind="client", messages=len(messages)) as span:
            request = tokenizer_pb2.RenderChatRequest(messages=messages, tools=tools, cache_salt=cache_salt,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message)
            try:
                reply = await self.stub.RenderChat(request, timeout=self.timeout, metadata=span.metadata())
            except grpc.aio.AioRpcError as e:
                raise _translate(e) from e
            span.set("tokens", len(reply.token_ids))
        return list(reply.token_ids), tuple(reply.message_ends)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens included (as the model saw them)."""
        try:
            reply = await self.stub.Detokenize(tokenizer_pb2.DetokenizeRequest(token_ids=ids, keep_special_tokens=True),
                                               timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            raise _translate(e) from e
        return reply.text

    async def token_bytes(self, ids: list[int]) -> dict[int, bytes]:
        """Each id's own bytes from the tokenizer's vocabulary (special tokens: their text), for logprobs; remembered,
        since the same ids come back again and again."""
        missing = sorted({i for i in ids if i not in self._token_bytes})
        for start in range(0, len(missing), MAX_TOKEN_BYTES_IDS):
            part = missing[start:start + MAX_TOKEN_BYTES_IDS]
            try:
                reply = await self.stub.TokenBytes(tokenizer_pb2.TokenBytesRequest(token_ids=part),
                                                   timeout=self.timeout)
            except grpc.aio.AioRpcError as e:
                raise _translate(e) from e
            self._token_bytes.update(zip(part, reply.token_bytes))
        return {i: self._token_bytes[i] for i in ids}

    def detokenizer(self, keep_special_tokens: bool,
                    metadata: tuple[tuple[str, str], ...] = ()) -> "StreamingDetokenizer":
        """metadata: the trace context (and request id) of the span the stream belongs to."""
        return StreamingDetokenizer(self.stub, keep_special_tokens, metadata)

    async def close(self) -> None:
        await self._channel.close()


class StreamingDetokenizer:
    """One DetokenizeStream call per request: ids in, text deltas out, in order."""

    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, keep_special_tokens: bool,
                 metadata: tuple[tuple[str, str], ...] = ()):
        self._call = stub.DetokenizeStream(metadata=metadata or None)
        self._first = True
        self._keep = keep_special_tokens

    async def add(self, ids: list[int]) -> str:
        req = tokenizer_pb2.DetokenizeStreamRequest(token_ids=ids)
        if self._first:
            req.keep_special_tokens, self._first = self._keep, False
        try:
            await self._call.write(req)
            reply = await self._call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise await self._ended() from e
        if reply is grpc.aio.EOF:
            raise await self._ended()
        return reply.text

    async def finish(self) -> str:
        """Half-closes; the service answers with the held-back tail in a final message."""
        try:
            await self._call.done_writing()
            text = ""
            while (reply := await self._call.read()) is not grpc.aio.EOF:
                text += reply.text
            return text
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            raise await self._ended() from e

    async def _ended(self) -> RouterError:
        """The call ended under us (the tokenizer died or restarted): its final status says why. A failed write
        reports only "RPC already finished" or a generic INTERNAL error; the call's own status is the real cause."""
        try:
            code = await asyncio.wait_for(self._call.code(), ENDED_STATUS_WAIT_S)
            details = await self._call.details()
        except asyncio.TimeoutError:
            code, details = grpc.StatusCode.UNAVAILABLE, "the call ended without a status"
        return from_tokenizer(code, details, "DetokenizeStream")

    def cancel(self) -> None:
        self._call.cancel()
