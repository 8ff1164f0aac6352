"""One request's life in the router: validate, admit, choose a shard, stream tokens with text deltas, apply stop
strings, and report exact usage. Shared by Generate and Chat.

Each request is measured (router/metrics.py) and logged once when it ends ("request finished": where its time
went, the shard's share included), and traced when tracing is on: `admission`, `route` and `stream` spans under the
request's span (kimiserve/tracing.py); the shard's spans hang under `stream` through the Submit's trace_context.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from kimiserve import sampling_rules, tracing
from kimiserve.kimi_chat import ToolCall
from kimiserve.tenants import Tenant
from kimiserve.v1 import common_pb2, shard_pb2
from router.admission import Admission
from router.balancer import NoHealthyShard, pick_shard
from router.cache_salt import cache_salt_for
from router.errors import InvalidArgument, RouterError, ShardUnavailable
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex, block_names
from router.request_ids import LiveIds
from router.shard_client import ShardClient
from router.stop_strings import StopStringFilter
from router.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)


@dataclass
class _Outcome:
    """What one request's stream measured, for its metrics, log line and span."""

    arrival: float  # time.monotonic() when the router had the prompt
    tenant: str  # whose request it is (kimiserve/tenants.py)
    admitted: float | None = None
    shard: str = ""
    first_at: float | None = None
    last_at: float | None = None
    generated: int = 0
    finish_reason: str = "none"  # "stop" | "length" | "cancelled" | "error" | "none" (the stream failed)
    timing: shard_pb2.ShardEvent.Timing | None = None  # the shard's, from its Finished event

    def token(self, now: float) -> float | None:
        """Counts a token received at `now`; returns the gap since the previous one (None for the first)."""
        gap = None if self.last_at is None else now - self.last_at
        self.first_at, self.last_at = self.first_at or now, now
        self.generated += 1
        return gap


def finish_reason_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclass
class Piece:
    """One step of a sequence's output (one token, or the end), the router's one form of a generated piece:
    Generation.run makes it from the shard's ShardEvent, router/flow.py fills in the chat split (reasoning, content,
    tool calls), and each front end writes it out (router/service.py, router/http/replies.py, router/batch/execute.py).
    The last piece has finish_reason and usage."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # one per token id, with SamplingParams.logprobs
    top_logprobs: list[common_pb2.TopLogprobs] = field(default_factory=list)  # one per token id, when asked for
    # What each token added to the detokenized text (before stop strings; "" for hidden ids and for a token that
    # only starts a multi-byte character): OpenAI's per-token `token` strings.
    token_texts: list[str] = field(default_factory=list)
    text: str = ""  # completion text, or chat content, since the previous piece
    reasoning: str = ""  # chat: <think> text since the previous piece
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat, last piece only
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    error_message: str = ""
    prompt_logprobs: common_pb2.PromptLogprobs | None = None  # the scored prompt, on a sequence's first piece

    @property
    def final(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def tool_call_protos(self) -> list[common_pb2.ToolCall]:
        return [common_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in self.tool_calls]


# SamplingParams fields whose value is checked only when the client set it (proto3 `optional`); the rest always.
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "prompt_logprobs")


def validate_sampling(s: common_pb2.SamplingParams) -> None:
    """Raises InvalidArgument naming every problem (kimiserve/sampling_rules.py, the shard's rules too); its param
    is the first field at fault."""
    values = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    values.update(top_logprobs=s.top_logprobs, logprobs=s.logprobs)
    problems = sampling_rules.sampling_problems(values)
    if s.HasField("response_format"):
        f = s.response_format
        problems += sampling_rules.response_format_problems(f.WhichOneof("kind"), s.ignore_eos, f.json_schema.name,
                                                            f.json_schema.schema, f.regex)
    if problems:
        raise InvalidArgument(*sampling_rules.describe(problems))


class Generation:
    """The router's engine-facing half: everything between a validated prompt and a stream of chunks."""

    def __init__(self, shards: list[ShardClient], tokenizer: TokenizerClient, admission: Admission,
                 metrics: RouterMetrics, default_max_tokens: int, prefixes: PrefixIndex):
        self.shards, self.tokenizer, self.admission = shards, tokenizer, admission
        self.prefixes = prefixes  # what this router sent to which shard, for prefix affinity
        self.metrics, self.default_max_tokens = metrics, default_max_tokens
        # Every request id and sequence id live in this router, interactive and batch: a request with a live id is
        # refused before anything is sent (router/flow.py claims them), so no stream can receive another's events.
        self.live = LiveIds()

    def model_info(self) -> shard_pb2.ShardInfoResponse:
        for shard in self.shards:
            if shard.info is not None:
                return shard.info
        raise ShardUnavailable("no shard has answered Info yet")

    def max_context_tokens(self) -> int:
        """The longest sequence every shard that has answered can hold (a request may be routed to any of them)."""
        known = [s.info.capacity.max_context_tokens for s in self.shards if s.info is not None]
        if not known:
            raise ShardUnavailable("no shard has answered Info yet")
        return min(known)

    def _budget(self, prompt: list[int], s: common_pb2.SamplingParams) -> int:
        info = self.model_info()
        if not prompt:
            raise InvalidArgument("empty prompt", "prompt")
        bad = (sampling_rules.token_id_problems("prompt", prompt, info.vocab_size)
               + sampling_rules.token_id_problems("stop_token_ids", s.stop_token_ids, info.vocab_size))
        if bad:
            raise InvalidArgument(*sampling_rules.describe(bad))
        context = self.max_context_tokens()
        room = context - len(prompt)
        if room < 1:
            raise InvalidArgument(f"prompt of {len(prompt)} tokens leaves no room in the maximum context of "
                                  f"{context} tokens this deployment can hold", "prompt")
        wanted = s.max_tokens if s.HasField("max_tokens") else self.default_max_tokens
        return min(wanted, room)

    async def run(self, method: str, request_id: str, prompt: list[int], s: common_pb2.SamplingParams,
                  tenant: Tenant, keep_special_tokens: bool = False, hidden_ids: frozenset[int] = frozenset(),
                  cache_salt: str = "", message_ends: tuple[int, ...] = ()) -> AsyncIterator[Piece]:
        """Yields the pieces of the sequence `request_id` of `tenant`, which the caller claimed in `live` (and
        releases: see flow.choices); the last piece has finish_reason and usage. Raises RouterError subclasses.

        `hidden_ids` are tokens returned in token_ids but not detokenized (chat: the end-of-turn token).
        `cache_salt` (the request's own, from flow; router/cache_salt.py) is mixed with the tenant's name into the
        salt that keys the prompt's prefix-cache entries on the shard and in the prefix index, so no tenant's
        requests hit another's; `message_ends` (chat) are where the rendered messages end, the shard's snapshot
        points."""
        if not self.live.holds(request_id):
            raise RouterError(f"sequence {request_id!r} was not claimed in the live-id registry before it ran")
        validate_sampling(s)
        max_tokens = self._budget(prompt, s)
        arrival = time.monotonic()
        submit = shard_pb2.ShardRequest.Submit(request_id=request_id, prompt_token_ids=prompt, sampling=s,
                                               max_tokens=max_tokens,
                                               cache_salt=cache_salt_for(tenant.name, cache_salt),
                                               message_boundaries=message_ends)
        async for chunk in self._admitted(method, request_id, submit, keep_special_tokens, hidden_ids,
                                          _Outcome(arrival, tenant.name)):
            yield chunk

    async def _admitted(self, method, request_id, submit, keep_special_tokens, hidden_ids, out: _Outcome):
        span = tracing.current()
        arrival = out.arrival
        admission = span.child("admission", start_s=arrival)
        try:
            async with self.admission.slot(request_id):
                out.admitted = time.monotonic()
                admission.end(out.admitted)
                self.metrics.queue_time.labels(method).observe(out.admitted - arrival)
                async for chunk in self._routed(method, request_id, submit, keep_special_tokens, hidden_ids, out,
                                                span):
                    yield chunk
        finally:
            if out.admitted is None:  # refused (queue full) or cancelled while waiting
                admission.fail("not admitted")
                admission.end()

    async def _routed(self, method, request_id, submit, keep_special_tokens, hidden_ids, out: _Outcome, span):
        """submit: the sequence's Submit, all but its trace context."""
        prompt, s = list(submit.prompt_token_ids), submit.sampling
        with span.child("route") as route:
            try:
                names = block_names(prompt, submit.cache_salt)
                shard = pick_shard([c.view for c in self.shards], self.prefixes.matched_tokens(names))
            except NoHealthyShard as e:
                raise ShardUnavailable(str(e)) from e
            self.prefixes.record(shard.name, names)
            route.set("shard", shard.name)
        out.shard = shard.name
        shard_client = next(c for c in self.shards if c.view is shard)
        with span.child("stream", shard=shard.name) as stream:
            submit.trace_context.update(stream.carrier())
            log.info("request routed", extra={"request_id": request_id, "shard": shard.name,
                                              "prompt_tokens": len(prompt), "max_tokens": submit.max_tokens})
            events = await shard_client.submit(submit)
            async for chunk in self._stream(method, request_id, shard_client, events, prompt, s,
                                            keep_special_tokens, hidden_ids, out, stream):
                yield chunk

    async def _stream(self, method, request_id, shard, events, prompt, s, keep_special, hidden_ids,
                      out: _Outcome, span):
        detok = self.tokenizer.detokenizer(keep_special, span.metadata())
        stops = StopStringFilter(list(s.stop))
        cached = 0
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Exception):
                    raise event
                kind = event.WhichOneof("kind")
                if kind == "token":
                    token = event.token.token_id
                    cached = cached or event.token.cached_prompt_tokens
                    gap = out.token(time.monotonic())
                    if gap is not None:
                        self.metrics.itl.labels(method).observe(gap)
                    delta = "" if token in hidden_ids else await detok.add([token])
                    text = stops.feed(delta)
                    top = ([common_pb2.TopLogprobs(candidates=event.token.top_logprobs)] if s.top_logprobs
                           else [])
                    per_token = {"logprobs": [event.token.logprob] if event.token.HasField("logprob") else [],
                                 "token_texts": [delta], "top_logprobs": top,
                                 "prompt_logprobs": (event.token.prompt_logprobs
                                                     if event.token.HasField("prompt_logprobs") else None)}
                    if stops.stopped:
                        finished = True
                        out.finish_reason = "stop"
                        await shard.cancel(request_id)
                        usage = common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=out.generated,
                                                 cached_prompt_tokens=cached)
                        yield Piece([token], text=text, finish_reason=common_pb2.FINISH_REASON_STOP, usage=usage,
                                    **per_token)
                        break
                    yield Piece([token], text=text, **per_token)
                elif kind == "finished":
                    finished = True
                    tail = stops.feed(await detok.finish()) + stops.flush()
                    f = event.finished
                    out.finish_reason = finish_reason_name(f.finish_reason)
                    out.timing = f.timing if f.HasField("timing") else None
                    yield Piece(text=tail, finish_reason=f.finish_reason, usage=f.usage, error_message=f.error_message)
                    break
        finally:
            detok.cancel()  # a no-op once the stream has ended
            if not finished:
                await shard.cancel(request_id)  # client cancelled, deadline passed, or the stream failed
            self._observe(method, request_id, len(prompt), out)

    def _observe(self, method: str, request_id: str, prompt_tokens: int, out: _Outcome) -> None:
        """Metrics, one log line and the request span's attributes, once per request sent to a shard."""
        now = time.monotonic()
        m = self.metrics
        m.e2e.labels(method).observe(now - out.arrival)
        if out.first_at is not None:
            m.ttft.labels(method).observe(out.first_at - out.arrival)
            if out.generated > 1:
                m.tpot.labels(method).observe((now - out.first_at) / (out.generated - 1))
        shard_prefill = out.timing.prefill_seconds if out.timing and out.timing.HasField("prefill_seconds") else None
        if shard_prefill is not None:
            m.prefill_time.labels(method).observe(shard_prefill)
        m.prompt_tokens.labels(method).inc(prompt_tokens)
        m.generation_tokens.labels(method).inc(out.generated)
        m.prompt_length.labels(method).observe(prompt_tokens)
        m.generation_length.labels(method).observe(out.generated)
        m.finished.labels(method, out.finish_reason).inc()
        facts = {"request_id": request_id, "method": method, "tenant": out.tenant, "shard": out.shard,
                 "finish_reason": out.finish_reason,
                 "prompt_tokens": prompt_tokens, "completion_tokens": out.generated,
                 "queue_s": _round(out.admitted, out.arrival),
                 "ttft_s": _round(out.first_at, out.arrival), "duration_s": _round(now, out.arrival)}
        if out.timing is not None:
            t = out.timing
            facts.update(shard_queue_s=_round(t.queue_seconds), shard_prefill_s=_round(shard_prefill),
                         shard_prefill_passes=t.prefill_passes,
                         shard_decode_s=_round(t.decode_seconds if t.HasField("decode_seconds") else None))
        log.info("request finished", extra=facts)
        span = tracing.current()
        for key in ("tenant", "finish_reason", "prompt_tokens", "completion_tokens", "shard"):
            span.set(key, facts[key])


def _round(t: float | None, since: float = 0.0) -> float | None:
    """Seconds since `since`, to the microsecond, for a log line (None stays None: the phase never happened)."""
    return None if t is None else round(t - since, 6)
