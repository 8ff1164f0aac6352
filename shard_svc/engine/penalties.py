"""Presence, frequency and repetition penalties, applied on the device to all penalised rows of a pass at once.

Counts live in one device tensor per kind, a row per state slot (a sequence keeps its slot for its whole life):
how often each token occurs in the sequence's output, and whether it occurs in its prompt. The sampler adds each
pass's tokens with one indexed add of the device token tensor, so no count ever makes a trip through the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Penalties(NamedTuple):
    """One row's penalty values, as SamplingParams holds them (taken apart here so this module needs nothing of
    the sampler's, which imports it)."""

    repetition: float
    presence: float
    frequency: float


class TokenCounts:
    """Per state slot, on the device: output token counts and prompt token presence. Allocated on first use, so
    a shard that never sees a penalty spends no memory on it (num_slots x vocab x 5 bytes)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, device
        self.output: torch.Tensor | None = None  # int32 [num_slots, vocab]
        self.prompt: torch.Tensor | None = None  # bool [num_slots, vocab]

    def _allocate(self) -> None:
        if self.output is None:
            self.output = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.bool, device=self.device)

    def start(self, sequences: list[tuple[int, list[int], int]]) -> None:
        """(slot, prompt, prior output) of sequences about to draw their first token: their rows are cleared, their
        prompt tokens marked and, for a continuation, the prompt's last `prior output` tokens counted as output
        instead (they are what it generated before it moved), with the same few transfers and writes for all."""
        if not sequences:
            return
        self._allocate()
        slots = torch.tensor([slot for slot, _, _ in sequences], device=self.device)
        self.output[slots] = 0
        self.prompt[slots] = False
        split = [(slot, prompt[:len(prompt) - prior], prompt[len(prompt) - prior:])
                 for slot, prompt, prior in sequences]
        rows = torch.tensor([slot for slot, own, _ in split for _ in own], device=self.device)
        ids = torch.tensor([t for _, own, _ in split for t in own], device=self.device)
        self.prompt[rows, ids] = True
        out_rows = torch.tensor([slot for slot, _, out in split for _ in out], device=self.device, dtype=torch.long)
        out_ids = torch.tensor([t for _, _, out in split for t in out], device=self.device, dtype=torch.long)
        self.output.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=torch.int32), accumulate=True)

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Counts one more occurrence of tokens[i] in the output of the sequence in slots[i] (device tensors)."""
        self._allocate()
        self.output.index_put_((slots, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)


def apply_penalties(logits: torch.Tensor, counts: TokenCounts, slots: torch.Tensor,
                    penalties: list[Penalties]) -> torch.Tensor:
    """logits [rows, vocab] of sequences in `slots` with their penalties applied (vLLM's order and definitions):
    repetition over prompt + output tokens (positive logits divided by it, negative multiplied), then
    presence * [count > 0] + frequency * count subtracted, counts over the output only."""
    counts._allocate()
    out = counts.output[slots]
    present = out > 0
    seen = present | counts.prompt[slots]
    values = torch.tensor(penalties, dtype=logits.dtype, device=logits.device)
    rep, presence, frequency = values[:, 0:1], values[:, 1:2], values[:, 2:3]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency * out - presence * present
