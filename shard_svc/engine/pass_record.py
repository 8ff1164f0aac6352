"""The record of one engine pass, as operators quote prefill timings, from the rank that ran it.

A prefill pass: its wall seconds, sequences, tokens, the fewest and most tokens one sequence had in it, chunks (the
model forwards the runner ran for it: micro-batches) and the most tokens one chunk held, and which rank of how many
ran it. Every rank of a shard group times its own pass and reports it; the group's wall time is the max over ranks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from shard_svc.engine.engine import PassStats

log = logging.getLogger(__name__)

# The integer fields, in the order a rank sends them to rank 0 (shard_svc/parallel/sync.py), after the nanoseconds.
INT_FIELDS = ("sequences", "tokens", "min_seq_tokens", "max_seq_tokens", "chunks", "max_chunk_tokens", "decode_rows",
              "graphed")
NO_PASS = [-1] + [0] * len(INT_FIELDS)  # a rank's row for a kind of pass its step did not run


@dataclass(frozen=True)
class PassRecord:
    kind: str  # "prefill" | "decode"
    seconds: float
    sequences: int
    tokens: int
    min_seq_tokens: int
    max_seq_tokens: int
    chunks: int
    max_chunk_tokens: int
    decode_rows: int = 0  # a prefill pass: decode steps that rode in it (fair sharing, while a long prompt prefills)
    graphed: int = 0  # 1: replayed from CUDA graphs (a prefill pass: engine/prefill_graphs.py), 0: op by op
    rank: int = 0
    world_size: int = 1
    request_ids: tuple[str, ...] = ()

    @classmethod
    def of(cls, p: PassStats, rank: int = 0, world_size: int = 1) -> PassRecord:
        seq = p.seq_tokens or [0]
        chunks = p.chunk_tokens or [0]
        return cls(p.kind, p.seconds, p.sequences, p.tokens, min(seq), max(seq), len(p.chunk_tokens), max(chunks),
                   p.decode_rows, int(p.graphed), rank, world_size, tuple(p.request_ids))

    def to_ints(self) -> list[int]:
        """[nanoseconds, *INT_FIELDS]: what a rank all-gathers for rank 0's metrics."""
        return [round(self.seconds * 1e9)] + [getattr(self, f) for f in INT_FIELDS]

    @classmethod
    def from_ints(cls, kind: str, row: list[int], rank: int, world_size: int) -> PassRecord | None:
        """The inverse of to_ints; None for NO_PASS."""
        if row[0] < 0:
            return None
        return cls(kind, row[0] / 1e9, *row[1:], rank=rank, world_size=world_size)

    def log(self) -> None:
        """One JSON line per prefill pass, with every field and the request ids whole, for tools that read logs."""
        log.info(f"{self.kind} pass", extra={
            "pass": self.kind, "seconds": round(self.seconds, 6), "sequences": self.sequences, "tokens": self.tokens,
            "min_seq_tokens": self.min_seq_tokens, "max_seq_tokens": self.max_seq_tokens, "chunks": self.chunks,
            "max_chunk_tokens": self.max_chunk_tokens, "decode_rows": self.decode_rows, "graphed": self.graphed,
            "rank": self.rank, "world_size": self.world_size, "request_ids": list(self.request_ids)})
