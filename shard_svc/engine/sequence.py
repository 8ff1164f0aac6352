"""A sequence: one request's tokens, its sampling state, and the pool resources it holds."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shard_svc.engine.prompt_logprobs import PromptScores
from shard_svc.engine.sampling import SamplingParams, SeededDraws


@dataclass(frozen=True)
class SequenceTiming:
    """Where one finished sequence's time went on the shard, in seconds. None: the phase never happened (a request
    cancelled in the queue was never admitted; a prompt restored whole from the prefix cache had no prefill)."""

    queue_s: float  # arrival to admission, or to the finish when never admitted
    wait_s: float | None  # arrival to its first prefill pass (to its first token when the whole prompt was cached)
    prefill_s: float | None  # start of its first prefill pass to its first token
    time_to_first_token_s: float | None  # arrival to first token
    decode_s: float | None  # first token to the finish
    duration_s: float  # arrival to the finish
    prefill_passes: int

    @classmethod
    def of(cls, seq: Sequence) -> SequenceTiming:
        """The timing of a finished sequence."""
        end = seq.finished_at if seq.finished_at is not None else time.monotonic()
        first = seq.first_token_at

        def since(t: float | None, until: float | None) -> float | None:
            return None if t is None or until is None else until - t

        return cls((seq.admitted_at or end) - seq.arrived_at, since(seq.arrived_at, seq.first_prefill_at or first),
                   since(seq.first_prefill_at, first),
                   since(seq.arrived_at, first), since(first, end), end - seq.arrived_at, seq.prefill_passes)


@dataclass(frozen=True)
class PrefixHints:
    """What a request tells the prefix cache (shard_svc/engine/prefix_cache.py): the salt its entries are keyed by
    (requests under different salts never share an entry) and the prompt offsets where its chat messages end, the
    cache's snapshot points beside the interval and the prompt end (kept ones only: PrefixCache.message_points)."""

    salt: str = ""
    boundaries: tuple[int, ...] = ()


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no slot
    RUNNING = "running"  # holds a state slot; prefilling until num_computed reaches the prompt length
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    draws: SeededDraws | None = None  # a sampled sequence's randomness; None when greedy
    keep_prompt_logits: bool = False  # for --dump-logits: keep logits at every prompt position
    stop_ids: frozenset[int] = frozenset()  # sampled ids that end the sequence (stop ids, EOS unless ignored)
    matcher: Any = None  # response_format: an llguidance.LLMatcher advanced with every token (engine/grammar.py)
    prefix: PrefixHints = PrefixHints()
    prior_output: int = 0  # a continuation: the prompt's last tokens that are this sequence's own earlier output
    movable: bool = False  # a draining shard hands it over (engine/handoff.py) instead of finishing it
    imported: Any = None  # a SequenceState from another shard (engine/handoff.py), restored at admission
    imported_tokens: int = 0  # tokens restored from an imported state instead of prefilled
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose effect is already in the KDA state / MLA cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" | "moved"
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    cached_logits: torch.Tensor | None = None  # the whole prompt was cached: its first token is drawn from this row
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)
    prompt_scores: PromptScores | None = None  # with params.prompt_logprobs: gathered chunk by chunk in prefill
    # Where the request's time went (time.monotonic() seconds; None until reached), for per-request metrics and
    # traces. The shard's engine loop sets arrived_at to the moment its gRPC handler took the request.
    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None  # took a state slot (the scheduler)
    first_prefill_at: float | None = None  # its first prefill pass started (None: the whole prompt was cached)
    first_token_at: float | None = None  # its first token was sampled
    finished_at: float | None = None
    prefill_passes: int = 0  # prefill passes its prompt took part in (chunked prefill: several)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def banned_ids(self) -> tuple[int, ...]:
        """The ids its next draw may not take: its stop ids while it has fewer than min_tokens tokens of its own."""
        return tuple(sorted(self.stop_ids)) if len(self.output) < self.params.min_tokens else ()

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this sequence can ever hold: what its buffers and KV promise are sized by."""
        return len(self.prompt) + self.params.max_tokens

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
