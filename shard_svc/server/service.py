"""The Shard gRPC servicer: thin translation between kimiserve.v1 messages and the engine loop."""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import nullcontext

import grpc
import torch

from kimiserve.v1 import common_pb2, shard_pb2, shard_pb2_grpc
from shard_svc.engine.engine import TokenEvent
from shard_svc.engine.handoff import HandoffError, PackedState, StatesFull, StateUnavailable
from shard_svc.engine.prompt_logprobs import PromptScores
from shard_svc.engine.sampling import SamplingParams
from shard_svc.engine.sequence import PrefixHints, SequenceTiming
from shard_svc.errors import CapacityError, ContextTooLong, DuplicateRequest, InvalidRequest, KimiServeError
from shard_svc.server.engine_loop import EngineLoop, ShuttingDown

log = logging.getLogger(__name__)
FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "cancelled": common_pb2.FINISH_REASON_CANCELLED, "error": common_pb2.FINISH_REASON_ERROR}
_END = object()


def error_code(e: Exception) -> int:
    """Named engine errors -> the ShardErrorCode the router maps to a gRPC status."""
    if isinstance(e, DuplicateRequest):
        return shard_pb2.SHARD_ERROR_CODE_ALREADY_EXISTS
    if isinstance(e, InvalidRequest | ContextTooLong | ValueError):
        return shard_pb2.SHARD_ERROR_CODE_INVALID_ARGUMENT
    if isinstance(e, ShuttingDown | StateUnavailable):
        return shard_pb2.SHARD_ERROR_CODE_UNAVAILABLE
    if isinstance(e, CapacityError):
        return shard_pb2.SHARD_ERROR_CODE_RESOURCE_EXHAUSTED
    return shard_pb2.SHARD_ERROR_CODE_INTERNAL


def event_to_pb(event: TokenEvent) -> list[shard_pb2.ShardEvent]:
    """A TokenEvent is a Token, a Finished or Moved, or a Token followed by Finished (the last token of a
    sequence)."""
    out = []
    if event.token_id is not None:
        token = shard_pb2.ShardEvent.Token(token_id=event.token_id, index=event.index,
                                           cached_prompt_tokens=event.cached_tokens if event.index == 0 else 0)
        if event.logprob is not None:
            token.logprob = event.logprob
        token.top_logprobs.extend(common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in event.top_logprobs)
        if event.prompt_scores is not None:
            token.prompt_logprobs.CopyFrom(prompt_logprobs_to_pb(event.prompt_scores))
        out.append(shard_pb2.ShardEvent(request_id=event.request_id, token=token))
    if event.finish_reason == "moved":
        out.append(shard_pb2.ShardEvent(request_id=event.request_id, moved=shard_pb2.ShardEvent.Moved(
            computed_tokens=event.moved_tokens, state_bytes=event.state_bytes)))
    elif event.finish_reason is not None:
        usage = common_pb2.Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                 cached_prompt_tokens=event.cached_tokens)
        out.append(shard_pb2.ShardEvent(request_id=event.request_id, finished=shard_pb2.ShardEvent.Finished(
            finish_reason=FINISH[event.finish_reason], usage=usage, error_message=event.error or "",
            timing=timing_to_pb(event.timing))))
    return out


def prompt_logprobs_to_pb(scores: PromptScores) -> common_pb2.PromptLogprobs:
    logprobs, tops, ranks = scores.entries()
    out = common_pb2.PromptLogprobs(logprobs=logprobs, ranks=ranks)
    if any(tops):
        out.top_logprobs.extend(common_pb2.TopLogprobs(candidates=[common_pb2.TopLogprob(token_id=t, logprob=lp)
                                                                   for t, lp in top]) for top in tops)
    return out


def timing_to_pb(t: SequenceTiming | None) -> shard_pb2.ShardEvent.Timing | None:
    if t is None:  # a request that failed before the engine took it
        return None
    return shard_pb2.ShardEvent.Timing(queue_seconds=t.queue_s, prefill_seconds=t.prefill_s,
                                       time_to_first_token_seconds=t.time_to_first_token_s,
                                       decode_seconds=t.decode_s, duration_seconds=t.duration_s,
                                       prefill_passes=t.prefill_passes)


class ShardService(shard_pb2_grpc.ShardServicer):
    def __init__(self, loop: EngineLoop, info: shard_pb2.ShardInfoResponse, device: torch.device,
                 on_device_fault):
        self.loop, self.info, self.device, self.on_device_fault = loop, info, device, on_device_fault
        self._probe_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def Stream(self, request_iterator, context):
        out: queue.Queue = queue.Queue()
        live: set[str] = set()
        lock = threading.Lock()

        def sink(event: TokenEvent) -> None:
            if event.finish_reason is not None:
                with lock:
                    live.discard(event.request_id)
            for msg in event_to_pb(event):
                out.put(msg)

        def read() -> None:
            try:
                for req in request_iterator:
                    self._handle(req, sink, out, live, lock)
            except grpc.RpcError:
                pass  # the router went away; cancelled below
            finally:
                with lock:
                    orphans = list(live)
                for rid in orphans:
                    self.loop.cancel(rid)
                out.put(_END)

        threading.Thread(target=read, name="shard-stream-reader", daemon=True).start()
        while (msg := out.get()) is not _END:
            yield msg

    def _handle(self, req, sink, out, live, lock) -> None:
        kind = req.WhichOneof("kind")
        if kind == "cancel":
            # Only this stream's own sequences: request ids are unique per shard, not secret, and a cancel from
            # another stream (another router, or a caller that reached the shard) must not stop them.
            rid = req.cancel.request_id
            with lock:
                own = rid in live
            if own:
                self.loop.cancel(rid)
            else:
                log.info("cancel ignored: not a live request of this stream", extra={"request_id": rid})
            return
        if kind != "submit":
            out.put(shard_pb2.ShardEvent(error=shard_pb2.ShardEvent.Error(
                code=shard_pb2.SHARD_ERROR_CODE_INVALID_ARGUMENT, message="ShardRequest with no submit or cancel")))
            return
        sub = req.submit
        try:
            with lock:
                if sub.request_id in live:  # refused before it touches the live one, whose stream goes on
                    raise DuplicateRequest(f"request id {sub.request_id!r} is already live on this stream")
                live.add(sub.request_id)
            try:
                params = SamplingParams.from_proto(sub.sampling, sub.max_tokens)
                prefix = PrefixHints(sub.cache_salt, tuple(sub.message_boundaries))
                self.loop.submit(sub.request_id, list(sub.prompt_token_ids), params, sink, sub.trace_context, prefix,
                                 sub.prior_output_tokens, sub.movable, sub.imported_state)
            except BaseException:
                with lock:
                    live.discard(sub.request_id)
                raise
        except (KimiServeError, ShuttingDown, ValueError) as e:
            log.info("submit refused", extra={"request_id": sub.request_id, "error": str(e)})
            out.put(shard_pb2.ShardEvent(request_id=sub.request_id, error=shard_pb2.ShardEvent.Error(
                code=error_code(e), message=str(e), param=getattr(e, "param", ""))))

    def ExportState(self, request, context):
        packed = self.loop.exports.take(request.request_id)
        if packed is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no moved state is held for request {request.request_id!r} "
                                                     f"(never moved, exported already, or dropped unclaimed)")
        log.info("state exported", extra={"request_id": request.request_id, "state_tokens": len(packed.tokens),
                                          "state_bytes": packed.nbytes})
        yield shard_pb2.SequenceStateChunk(header=shard_pb2.SequenceStateHeader(
            request_id=request.request_id, tokens=packed.tokens, model_type=self.info.model_type,
            total_bytes=packed.nbytes))
        for data in packed.chunks():
            yield shard_pb2.SequenceStateChunk(data=data)

    def ImportState(self, request_iterator, context):
        if self.loop.draining or self.loop.engine.sync.world > 1:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this shard is draining" if self.loop.draining else
                          "a shard group (tensor parallel) cannot import a sequence state: each rank holds a slice")
        try:
            header, packed = read_state(request_iterator, self.info.model_type)
            state = packed.unpack(f"the state imported for request {header.request_id!r}")
            self.loop.engine.copier.check(state.host, len(state.tokens),
                                          f"the state imported for request {header.request_id!r}")
            self.loop.imports.put(header.request_id, state)
        except StatesFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except KimiServeError as e:  # malformed, another model, other pool shapes
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.loop.metrics.state_imported(packed.nbytes)
        log.info("state imported", extra={"request_id": header.request_id, "state_tokens": len(state.tokens),
                                          "state_bytes": packed.nbytes})
        return shard_pb2.ImportStateResponse(tokens=len(state.tokens))

    def Info(self, request, context):
        return self.info

    def Load(self, request, context):
        load = self.loop.load()
        return shard_pb2.ShardLoadResponse(queued_tokens=load.queued_tokens, running_seqs=load.running,
                                           queued_seqs=load.queued, free_state_slots=load.free_slots,
                                           free_kv_blocks=load.free_blocks)

    def Health(self, request, context):
        if self.loop.failure is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"shard cannot serve: {self.loop.failure}")
        start = time.perf_counter()
        try:
            # On a stream of its own: the probe must not wait for the engine's pass (a long prefill is not a fault).
            with torch.cuda.stream(self._probe_stream) if self._probe_stream is not None else nullcontext():
                x = torch.ones(8, device=self.device)
                ok = float((x + x).sum()) == 16.0
        except Exception as e:  # noqa: BLE001 - any device failure means the shard cannot serve
            ok, detail = False, repr(e)
        else:
            detail = "" if ok else "device arithmetic returned a wrong value"
        if not ok:
            self.on_device_fault(detail)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"device {self.device} failed its health op: {detail}")
        return shard_pb2.ShardHealthResponse(device_op_ms=(time.perf_counter() - start) * 1e3)


def read_state(chunks, model_type: str) -> tuple[shard_pb2.SequenceStateHeader, PackedState]:
    """A transfer's header and data, checked against its header (HandoffError names what is wrong)."""
    it = iter(chunks)
    first = next(it, None)
    if first is None or first.WhichOneof("kind") != "header":
        raise HandoffError("a sequence state transfer must begin with its header")
    header = first.header
    if not header.request_id or not header.tokens:
        raise HandoffError(f"a sequence state header needs a request_id and at least one token; got request_id "
                           f"{header.request_id!r} and {len(header.tokens)} tokens")
    if header.model_type != model_type:
        raise HandoffError(f"the state for request {header.request_id!r} was made by a {header.model_type!r} "
                           f"model; this shard serves {model_type!r}")
    data = bytearray()
    for chunk in it:
        if chunk.WhichOneof("kind") != "data":
            raise HandoffError(f"the state for request {header.request_id!r} has a second header")
        data += chunk.data
        if len(data) > header.total_bytes:
            break
    if len(data) != header.total_bytes:
        raise HandoffError(f"the state for request {header.request_id!r} announced {header.total_bytes} bytes and "
                           f"sent {len(data)}{' or more' if len(data) > header.total_bytes else ''}")
    return header, PackedState(list(header.tokens), bytes(data))
