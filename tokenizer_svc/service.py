"""The Tokenizer gRPC servicer: validate, translate proto <-> domain, call, encode the reply.

Error mapping and metrics live in tokenizer_svc.rpc; each method here only says what the RPC does. The server is
asyncio (an open DetokenizeStream holds no thread); CPU-heavy work (encoding, rendering, decoding a whole sequence)
runs on the server's fixed pool of work threads (TokenizerServerConfig.work_threads) so one long text does not stall
every other call, and the process's memory does not grow with the number of threads load ever asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from kimiserve import limits
from kimiserve.chat_continuation import ContinuationError, generation_prompt
from kimiserve.text import clip
from kimiserve.tokenizer_files.loading import LoadedTokenizer
from kimiserve.tokenizer_files.splits import SplitRule
from kimiserve.v1 import tokenizer_pb2 as pb
from kimiserve.v1 import tokenizer_pb2_grpc
from tokenizer_svc import message_ends, metrics
from tokenizer_svc.chat_template import ChatTemplate, render_chat
from tokenizer_svc.convert import messages_from_pb, tools_from_pb
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.errors import InvalidRequest, ModelNotFound
from tokenizer_svc.rpc import streaming, unary

Ctx = grpc.aio.ServicerContext
T = TypeVar("T")
# Characters of rendered chat pieces whose ids RenderChat keeps (message_ends.PieceEncoder): a few dozen long system
# prompts and tool lists, a few MB.
PIECE_CACHE_CHARS = 1 << 21


@dataclass(frozen=True)
class ServedTokenizer:
    """Everything the servicer serves, loaded once at startup."""

    tokenizer: LoadedTokenizer
    template: ChatTemplate
    model_name: str
    model_type: str
    max_message_chars: int
    max_text_chars: int


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, served: ServedTokenizer, work: Executor) -> None:
        self._s = served
        self._work = work
        self._pieces = message_ends.PieceEncoder(served.tokenizer.encode, PIECE_CACHE_CHARS)
        self._splits = SplitRule(served.tokenizer.hf)

    async def _off_loop(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._work, fn, *args)

    def _check_model(self, model: str) -> None:
        if model and model != self._s.model_name:
            raise ModelNotFound(f"model {clip(model)} is not served here (this service serves {self._s.model_name!r})")

    @unary("Tokenize")
    async def Tokenize(self, request: pb.TokenizeRequest, context: Ctx) -> pb.TokenizeResponse:
        self._check_model(request.model)
        if len(request.text) > self._s.max_text_chars:
            raise InvalidRequest(f"text: {len(request.text)} characters is over the limit of {self._s.max_text_chars}")
        ids = await self._off_loop(self._s.tokenizer.encode, request.text)
        metrics.TOKENS.labels(rpc="Tokenize").inc(len(ids))
        return pb.TokenizeResponse(token_ids=ids)

    @unary("Detokenize")
    async def Detokenize(self, request: pb.DetokenizeRequest, context: Ctx) -> pb.DetokenizeResponse:
        self._check_model(request.model)
        metrics.TOKENS.labels(rpc="Detokenize").inc(len(request.token_ids))
        text = await self._off_loop(self._s.tokenizer.decode, request.token_ids, not request.keep_special_tokens)
        return pb.DetokenizeResponse(text=text)

    @unary("TokenBytes")
    async def TokenBytes(self, request: pb.TokenBytesRequest, context: Ctx) -> pb.TokenBytesResponse:
        self._check_model(request.model)
        if len(request.token_ids) > limits.MAX_TOKEN_BYTES_IDS:
            raise InvalidRequest(f"TokenBytes takes at most {limits.MAX_TOKEN_BYTES_IDS} ids, got "
                                 f"{len(request.token_ids)}")
        table = self._s.tokenizer.token_bytes
        return pb.TokenBytesResponse(token_bytes=[table[i] if i < len(table) else b"" for i in request.token_ids])

    @unary("RenderChat")
    async def RenderChat(self, request: pb.RenderChatRequest, context: Ctx) -> pb.RenderChatResponse:
        self._check_model(request.model)
        try:  # counts and sizes first (kimiserve/limits.py): no conversion or rendering work for an oversized one
            limits.check_chat_parts(request.messages, request.tools)
        except limits.RequestTooLarge as exc:
            raise InvalidRequest(str(exc)) from exc
        cont = request.continue_final_message
        try:
            add_generation_prompt = generation_prompt(
                request.add_generation_prompt if request.HasField("add_generation_prompt") else None, cont)
        except ContinuationError as exc:
            raise InvalidRequest(str(exc)) from exc
        messages, tools = messages_from_pb(request.messages), tools_from_pb(request.tools)
        prompt, ids, ends = await self._off_loop(self._render_chat, messages, tools, add_generation_prompt, cont,
                                                 request.cache_salt)
        metrics.TOKENS.labels(rpc="RenderChat").inc(len(ids))
        return pb.RenderChatResponse(prompt=prompt, token_ids=ids, message_ends=ends)

    def _render_chat(self, messages, tools, add_generation_prompt: bool, continue_final_message: bool,
                     salt: str) -> tuple[str, list[int], list[int]]:
        """The prompt, its ids and its messages' end offsets, in one trip to a work thread; pieces cached under
        `salt` (RenderChatRequest.cache_salt)."""
        prompt = render_chat(self._s.template, messages, tools, add_generation_prompt, self._s.max_message_chars,
                             continue_final_message)
        ends = message_ends.char_ends(self._s.template, messages, tools, add_generation_prompt, prompt,
                                      continue_final_message)
        pieces = self._pieces.for_salt(salt)
        by_pieces = message_ends.ids_by_pieces(self._splits, pieces, prompt, ends)
        if by_pieces is not None:
            return prompt, *by_pieces
        ids = self._s.tokenizer.encode(prompt)
        return prompt, ids, message_ends.token_ends(pieces, prompt, ids, ends)

    @streaming("DetokenizeStream")
    async def DetokenizeStream(
        self, request_iterator: AsyncIterator[pb.DetokenizeStreamRequest], context: Ctx
    ) -> AsyncIterator[pb.DetokenizeStreamResponse]:
        detok: IncrementalDetokenizer | None = None
        async for request in request_iterator:
            if detok is None:  # the first message carries the options
                self._check_model(request.model)
                detok = IncrementalDetokenizer(self._s.tokenizer, skip_special_tokens=not request.keep_special_tokens)
            metrics.TOKENS.labels(rpc="DetokenizeStream").inc(len(request.token_ids))
            yield pb.DetokenizeStreamResponse(text=detok.add(request.token_ids))
        yield pb.DetokenizeStreamResponse(text=detok.flush() if detok else "", final=True)

    @unary("Info")
    async def Info(self, request: pb.TokenizerInfoRequest, context: Ctx) -> pb.TokenizerInfoResponse:
        self._check_model(request.model)
        tok = self._s.tokenizer
        return pb.TokenizerInfoResponse(
            model=self._s.model_name,
            model_type=self._s.model_type,
            vocab_size=tok.vocab_size,
            special_tokens=[pb.SpecialToken(id=i, content=c) for i, c in sorted(tok.special_tokens.items())],
            eos_token_ids=tok.eos_token_ids,
            bos_token_id=tok.bos_token_id,
            chat_template_source=self._s.template.source,
            chat_template_sha256=self._s.template.sha256,
            tokenizer_source=tok.source,
        )
