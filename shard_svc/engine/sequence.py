"""A sequence: one request's tokens, its sampling state, and the pool resources it holds."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from shard_svc.engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no slot
    RUNNING = "running"  # holds a state slot; prefilling until num_computed reaches the prompt length
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    keep_prompt_logits: bool = False  # for --dump-logits: keep logits at every prompt position
    stop_ids: frozenset[int] = frozenset()  # sampled ids that end the sequence (stop ids, EOS unless ignored)
    matcher: Any = None  # response_format: an llguidance.LLMatcher advanced with every token (engine/grammar.py)
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_computed: int = 0  # tokens whose effect is already in the KDA state / MLA cache
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    cached_logits: torch.Tensor | None = None  # the whole prompt was cached: its first token is drawn from this row
    prompt_logits: list[torch.Tensor] = field(default_factory=list)
    step_logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

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
