"""One request's spans on the shard, written when it finishes from the timestamps its Sequence kept.

    shard.sequence            arrival at the shard -> finish   (a child of the router's `stream` span)
      queue                   arrival -> admission (a state slot)
      prefill (one per pass)  each prefill pass its prompt was in: the pass's tokens, sequences and chunks
      decode                  first token -> finish (absent when the first token finished it)

Built after the fact on the engine thread (no span is open while the engine steps), and only for requests whose
Submit carried a trace context while tracing is on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kimiserve import tracing
from shard_svc.engine.engine import TokenEvent
from shard_svc.engine.sequence import Sequence
from shard_svc.engine.pass_record import PassRecord


@dataclass(frozen=True)
class PrefillPart:
    """One prefill pass as one of its sequences saw it."""

    started: float  # time.monotonic()
    seq_tokens: int  # this sequence's tokens in the pass
    record: PassRecord


@dataclass
class TracedRequest:
    context: dict[str, str]  # the W3C trace context the router sent in the Submit
    prefills: list[PrefillPart] = field(default_factory=list)


def emit(shard: str, seq: Sequence, traced: TracedRequest, final: TokenEvent) -> None:
    end = seq.finished_at if seq.finished_at is not None else time.monotonic()
    root = tracing.start("shard.sequence", traced.context, "server", start_s=seq.arrived_at,
                         request_id=seq.request_id, shard=shard, prompt_tokens=final.prompt_tokens,
                         completion_tokens=final.completion_tokens, cached_prompt_tokens=final.cached_tokens,
                         finish_reason=final.finish_reason, prefill_passes=seq.prefill_passes)
    root.child("queue", start_s=seq.arrived_at).end(seq.admitted_at or end)
    for part in traced.prefills:
        r = part.record
        root.child("prefill", start_s=part.started, tokens=part.seq_tokens, pass_tokens=r.tokens,
                   pass_sequences=r.sequences, chunks=r.chunks, max_chunk_tokens=r.max_chunk_tokens,
                   rank=r.rank, world_size=r.world_size).end(part.started + r.seconds)
    # Decoding: past the first token, unless the sequence finished with it (max_tokens 1, a stop token at once).
    if seq.first_token_at is not None and (final.completion_tokens > 1 or final.token_id is None):
        root.child("decode", start_s=seq.first_token_at, tokens=max(0, final.completion_tokens - 1)).end(end)
    if final.error:
        root.fail(final.error)
    root.end(end)
