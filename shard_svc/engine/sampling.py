"""Sampling parameters and per-sequence sampling (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from shard_svc.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # same seed, same prompt, same model -> same tokens, whatever the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False  # report log p(token) under the sampling distribution

    def validate(self, vocab_size: int) -> None:
        if self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise InvalidRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequest(f"stop_token_ids {bad} outside the vocabulary [0, {vocab_size})")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """(token, its natural-log probability) from one row of fp32 logits [vocab].

    Depends only on this row and this sequence's generator, never on batch neighbours.
    """
    if params.temperature == 0:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits.float(), -1)[token]) if params.logprobs else 0.0
    scaled = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (cum - torch.softmax(sorted_logits, -1)) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scaled, -1)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(torch.log(probs[token])) if params.logprobs else 0.0
