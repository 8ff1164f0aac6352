"""One request's life in the router: validate, admit, choose a shard, stream tokens with text deltas, apply stop
strings, and report exact usage. Shared by Generate and Chat.

Each request is measured (router/metrics.py) and logged once when it ends ("request finished": where its time
went, the shard's share included), and traced when tracing is on: `admission`, `route` and `stream` spans under the
request's span (kimiserve/tracing.py); the shard's spans hang under `stream` through the Submit's trace_context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from kimiserve import sampling_rules, tracing
from kimiserve.kimi_chat import ToolCall, ToolCallDelta
from kimiserve.seeds import draw_seed
from kimiserve.tenants import Tenant
from kimiserve.v1 import common_pb2, shard_pb2
from router.admission import Admission
from router.balancer import NoHealthyShard, pick_shard
from router.cache_salt import cache_salt_for
from router.errors import AlreadyExists, InvalidArgument, RouterError, ShardLost, ShardMoved, ShardUnavailable
from router.failover import FailoverRefused, Legs, relay_state
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex, block_names
from router.request_ids import LiveIds
from router.shard_client import ShardClient
from router.stop_strings import StopStringFilter
from router.tokenizer_client import TokenizerClient

log = logging.getLogger(__name__)
DEFAULT_MAX_FAILOVERS = 2
# A failover waits this long for a shard in rotation (the only other one may be restarting), checking this often.
FAILOVER_WAIT_S = 15.0
FAILOVER_POLL_S = 0.2
# A moved sequence's state relayed from the draining shard to the next one: past this, the next shard recomputes.
RELAY_TIMEOUT_S = 30.0


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
    reasoning_tokens: int = 0  # chat: of the sequence's tokens so far, how many made its leading <think> block
    tool_call_deltas: list[ToolCallDelta] = field(default_factory=list)  # chat: the calls as they are written
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat, last piece only: the calls whole
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
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "prompt_logprobs")


def validate_sampling(s: common_pb2.SamplingParams) -> None:
    """Raises InvalidArgument naming every problem (kimiserve/sampling_rules.py, the shard's rules too); its param
    is the first field at fault."""
    values = {name: getattr(s, name) for name in _OPTIONAL if s.HasField(name)}
    values.update(top_logprobs=s.top_logprobs, logprobs=s.logprobs, logit_bias=dict(s.logit_bias),
                  min_tokens=s.min_tokens)
    problems = sampling_rules.sampling_problems(values)
    if s.HasField("response_format"):
        f = s.response_format
        problems += sampling_rules.response_format_problems(f.WhichOneof("kind"), s.ignore_eos, f.json_schema.name,
                                                            f.json_schema.schema, f.regex, s.min_tokens)
    if problems:
        raise InvalidArgument(*sampling_rules.describe(problems))


class Generation:
    """The router's engine-facing half: everything between a validated prompt and a stream of chunks."""

    def __init__(self, shards: list[ShardClient], tokenizer: TokenizerClient, admission: Admission,
                 metrics: RouterMetrics, default_max_tokens: int, prefixes: PrefixIndex,
                 max_failovers: int = DEFAULT_MAX_FAILOVERS):
        """max_failovers: how many times one sequence may move to another shard when its own is lost."""
        self.shards, self.tokenizer, self.admission = shards, tokenizer, admission
        self.max_failovers = max_failovers
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
        budget = min(wanted, room)
        if s.min_tokens > budget:
            why = (f"max_tokens {wanted}" if s.HasField("max_tokens") else
                   f"this deployment's default max_tokens {wanted} (max_tokens unset)")
            if room < wanted:
                why += f", clamped to the {room} tokens the prompt of {len(prompt)} leaves in the context of {context}"
            raise InvalidArgument(f"min_tokens {s.min_tokens} exceeds the sequence's budget of {budget} tokens: "
                                  f"{why}", "min_tokens")
        return budget

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
        sampled = not s.HasField("temperature") or s.temperature > 0
        if sampled and not s.HasField("seed"):
            # Drawn here, once, so that a continuation on another shard is sent the same seed and draws on as the
            # first leg would have (kimiserve/seeds.py).
            s = _with(s, seed=draw_seed())
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
        """submit: the sequence's first Submit, all but its trace context. Its legs (router/failover.py) run under one
        `stream` span, each after its own `route` span."""
        legs = Legs(request_id, submit, self.max_failovers)
        with span.child("stream") as stream:
            async for chunk in self._stream(method, legs, keep_special_tokens, hidden_ids, out, span, stream):
                yield chunk

    async def _place(self, legs: Legs, submit: shard_pb2.ShardRequest.Submit, span, stream,
                     wait_s: float = 0.0, moved: ShardMoved | None = None) -> tuple[ShardClient, asyncio.Queue]:
        """Chooses a shard for the next leg and sends it; waits up to `wait_s` for a shard in rotation (a failover
        while the only healthy shard restarts). `moved`: the leg continues a sequence a draining shard handed over,
        whose state is relayed to the chosen shard first (`_relay`)."""
        prompt = list(submit.prompt_token_ids)
        deadline = time.monotonic() + wait_s
        names = block_names(prompt, submit.cache_salt)
        with span.child("route") as route:
            while True:
                try:
                    shard = pick_shard([c.view for c in self.shards], self.prefixes.matched_tokens(names))
                    break
                except NoHealthyShard as e:
                    if time.monotonic() >= deadline:
                        raise ShardUnavailable(str(e) + (f" after waiting {wait_s:g} s to fail over request "
                                                         f"{legs.request_id!r}" if wait_s else "")) from e
                    await asyncio.sleep(FAILOVER_POLL_S)
            self.prefixes.record(shard.name, names)
            route.set("shard", shard.name)
        legs.shards.append(shard.name)
        legs.current = submit
        submit.request_id = legs.leg_id
        # Movable only where another shard could take it now: a lone shard that drains finishes its sequences itself.
        submit.movable = any(c.view.healthy and c.view is not shard for c in self.shards)
        submit.trace_context.update(stream.carrier())
        stream.set("shard", shard.name)
        log.info("request routed", extra={"request_id": legs.request_id, "leg_id": legs.leg_id, "shard": shard.name,
                                          "prompt_tokens": len(prompt), "max_tokens": submit.max_tokens,
                                          "prior_output_tokens": submit.prior_output_tokens})
        shard_client = next(c for c in self.shards if c.view is shard)
        if moved is not None:
            await self._relay(legs, moved, shard_client, submit)
        return shard_client, await shard_client.submit(submit)

    async def _relay(self, legs: Legs, moved: ShardMoved, target: ShardClient,
                     submit: shard_pb2.ShardRequest.Submit) -> None:
        """The moved state into `target`, and `submit` marked to start from it; when there is none, or the relay
        fails, `submit` recomputes (counted, logged)."""
        source = next((c for c in self.shards if c.address == moved.shard), None)
        why = "no_state" if not moved.computed_tokens else "source_gone" if source is None else ""
        if not why:
            start = time.monotonic()
            try:
                tokens = await relay_state(source, target, moved.leg_id, legs.leg_id, RELAY_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                why = "relay_failed"
                log.warning("state relay failed; the next shard recomputes", extra={
                    "request_id": legs.request_id, "from_shard": moved.shard, "to_shard": target.address,
                    "error": f"{e.code().name} {e.details()}"})
            else:
                submit.imported_state = True
                self.metrics.migrations.labels("moved").inc()
                self.metrics.migration_bytes.inc(moved.state_bytes)
                self.metrics.migration_seconds.observe(time.monotonic() - start)
                self.metrics.failover_recomputed_tokens.inc(len(submit.prompt_token_ids) - tokens)
                log.info("state moved", extra={"request_id": legs.request_id, "from_shard": moved.shard,
                                               "to_shard": target.address, "state_tokens": tokens,
                                               "state_bytes": moved.state_bytes,
                                               "seconds": round(time.monotonic() - start, 4)})
                return
        self.metrics.migrations.labels(why).inc()
        self.metrics.failover_recomputed_tokens.inc(len(submit.prompt_token_ids))

    async def _stream(self, method, legs: Legs, keep_special, hidden_ids, out: _Outcome, span, stream):
        """The sequence's pieces, leg after leg: a ShardLost fails it over (router/failover.py) and the stream goes
        on; the detokenizer, the stop strings and the count of tokens passed on span every leg, and a token whose
        index was passed on already (a leg's last event crossing its failover) is dropped, never sent twice."""
        request_id, first = legs.request_id, legs.first
        prompt, s = list(first.prompt_token_ids), first.sampling
        detok = self.tokenizer.detokenizer(keep_special, stream.metadata())
        stops = StopStringFilter(list(s.stop), s.include_stop_str_in_output)  # armed from token min_tokens on
        generated: list[int] = []  # every token id passed on, across legs (out.generated counts them too)
        cached = 0
        finished = False
        lost_at: float | None = None  # when the current leg's shard was lost, until its continuation's first event
        shard, events = await self._place(legs, first, span, stream)
        out.shard = shard.address
        try:
            while True:
                event = await events.get()
                if isinstance(event, ShardLost):
                    lost_at = time.monotonic()
                    ended = self._ended_at_loss(legs, generated)
                    if ended is not None:  # the leg had sent its last token; only its Finished was lost
                        finished = True
                        out.finish_reason = finish_reason_name(ended)
                        tail = stops.feed(await detok.finish()) + stops.flush()
                        yield Piece(text=tail, finish_reason=ended, usage=_usage(prompt, out, cached))
                        break
                    shard, events = await self._fail_over(legs, event, generated, span, stream)
                    out.shard = shard.address
                    continue
                if isinstance(event, AlreadyExists) and not self._leg_started(legs, generated):
                    shard, events = await self._renamed(legs, shard, event, span, stream)
                    continue
                if isinstance(event, Exception):
                    raise event
                if lost_at is not None:
                    self.metrics.failover_seconds.observe(time.monotonic() - lost_at)
                    lost_at = None
                kind = event.WhichOneof("kind")
                if kind == "token":
                    if event.token.index < len(generated):
                        log.warning("token dropped: its index was passed on already", extra={
                            "request_id": request_id, "shard": shard.address, "index": event.token.index})
                        continue
                    if event.token.index > len(generated):
                        raise RouterError(f"request {request_id!r}: shard {shard.address} sent token index "
                                          f"{event.token.index} after {len(generated)} tokens (a gap)")
                    token = event.token.token_id
                    generated.append(token)
                    cached = cached or event.token.cached_prompt_tokens
                    gap = out.token(time.monotonic())
                    if gap is not None:
                        self.metrics.itl.labels(method).observe(gap)
                    delta = "" if token in hidden_ids else await detok.add([token])
                    text = stops.feed(delta, armed=len(generated) >= s.min_tokens)
                    top = ([common_pb2.TopLogprobs(candidates=event.token.top_logprobs)] if s.top_logprobs
                           else [])
                    per_token = {"logprobs": [event.token.logprob] if event.token.HasField("logprob") else [],
                                 "token_texts": [delta], "top_logprobs": top,
                                 "prompt_logprobs": (event.token.prompt_logprobs
                                                     if event.token.HasField("prompt_logprobs") else None)}
                    if stops.stopped:
                        finished = True
                        out.finish_reason = "stop"
                        await shard.cancel(legs.leg_id)
                        yield Piece([token], text=text, finish_reason=common_pb2.FINISH_REASON_STOP,
                                    usage=_usage(prompt, out, cached), **per_token)
                        break
                    yield Piece([token], text=text, **per_token)
                elif kind == "finished":
                    finished = True
                    tail = stops.feed(await detok.finish()) + stops.flush()
                    f = event.finished
                    out.finish_reason = finish_reason_name(f.finish_reason)
                    out.timing = f.timing if f.HasField("timing") else None
                    # After a failover the shard counted its own leg's cache hits; the client's are the first leg's.
                    usage = _usage(prompt, out, cached) if legs.moves else f.usage
                    yield Piece(text=tail, finish_reason=f.finish_reason, usage=usage, error_message=f.error_message)
                    break
        except FailoverRefused as e:
            self.metrics.failover_failed.labels(e.why).inc()
            log.error("stream failed despite failover", extra={"request_id": request_id, "shards": legs.shards,
                                                                "failovers": legs.moves, "why": e.why,
                                                                "error": str(e)})
            raise
        finally:
            detok.cancel()  # a no-op once the stream has ended
            if not finished:
                await shard.cancel(legs.leg_id)  # client cancelled, deadline passed, or the stream failed
            self._observe(method, request_id, len(prompt), out)

    @staticmethod
    def _leg_started(legs: Legs, generated: list[int]) -> bool:
        """Whether the current leg has passed on a token (its Submit counts those before it as prior output)."""
        return len(generated) > legs.current.prior_output_tokens

    async def _renamed(self, legs: Legs, shard: ShardClient, refusal: AlreadyExists, span,
                       stream) -> tuple[ShardClient, asyncio.Queue]:
        """The current leg again, under an alias, after its shard refused its id as another router's (Legs.renamed).
        A relayed state was imported under the refused id, so the leg recomputes."""
        refused = legs.leg_id
        legs.renamed(shard.address, str(refusal))
        submit = legs.current
        submit.imported_state = False
        log.warning("request id live on the shard under another router; sent again under an alias",
                    extra={"request_id": legs.request_id, "refused_id": refused, "leg_id": legs.leg_id,
                           "shard": shard.address})
        return await self._place(legs, submit, span, stream)

    def _ended_at_loss(self, legs: Legs, generated: list[int]) -> int | None:
        """The finish reason of a sequence whose last token was passed on before its shard was lost (its budget
        spent, or a stop or end-of-sequence id), else None: it has more to generate."""
        if len(generated) >= legs.first.max_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        s = legs.first.sampling
        stop_ids = set(s.stop_token_ids) | (set() if s.ignore_eos else set(self.model_info().eos_token_ids))
        if generated and generated[-1] in stop_ids:
            return common_pb2.FINISH_REASON_STOP
        return None

    async def _fail_over(self, legs: Legs, lost: ShardLost, generated: list[int], span,
                         stream) -> tuple[ShardClient, asyncio.Queue]:
        """The continuation sent to another shard, or FailoverRefused (bounded, fits, a shard in rotation)."""
        try:
            continuation = legs.continuation(lost, generated, self.max_context_tokens())
        except ShardUnavailable as e:
            raise e if isinstance(e, FailoverRefused) else FailoverRefused(str(e), "no_shard") from e
        moved = lost if isinstance(lost, ShardMoved) else None
        self.metrics.failovers.labels(lost.kind).inc()
        if moved is None:
            self.metrics.failover_recomputed_tokens.inc(len(continuation.prompt_token_ids))
        log.warning("request failing over", extra={"request_id": legs.request_id, "from_shard": lost.shard,
                                                   "reason": lost.reason, "generated": len(generated),
                                                   "leg": legs.moves + 1})
        try:
            return await self._place(legs, continuation, span, stream, wait_s=FAILOVER_WAIT_S, moved=moved)
        except ShardUnavailable as e:
            raise FailoverRefused(f"request {legs.request_id!r} cannot fail over from shard {lost.shard} "
                                  f"({lost.reason}): {e}; shards tried: {', '.join(legs.shards)}", "no_shard") from e

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


def _usage(prompt: list[int], out: _Outcome, cached: int) -> common_pb2.Usage:
    """The usage the router reports itself (a stop string ended the stream, or a failover): the original prompt,
    every token passed on once, the first leg's prefix-cache hits."""
    return common_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=out.generated, cached_prompt_tokens=cached)


def _with(s: common_pb2.SamplingParams, **fields) -> common_pb2.SamplingParams:
    """A copy of `s` with `fields` set (the caller's message is left as it was: flow shares it between choices)."""
    out = common_pb2.SamplingParams()
    out.CopyFrom(s)
    for name, value in fields.items():
        setattr(out, name, value)
    return out


def _round(t: float | None, since: float = 0.0) -> float | None:
    """Seconds since `since`, to the microsecond, for a log line (None stays None: the phase never happened)."""
    return None if t is None else round(t - since, 6)
