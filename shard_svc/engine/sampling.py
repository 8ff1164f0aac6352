"""Sampling parameters and per-sequence sampling (greedy, temperature, top-k, top-p, seeded)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kimiserve.limits import MAX_TEMPERATURE
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
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequest(f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}")
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


# The token reported for a row whose logits hold NaN or +inf: nothing is drawn from it, and the engine ends that
# sequence with an error instead of emitting a token (a bad row must never kill the pass or reach multinomial,
# which raises on the CPU and asserts on the GPU, taking the whole device context down).
NONFINITE_ROW = -1


def sample_all(rows: list[tuple[torch.Tensor, SamplingParams, torch.Generator | None]]) -> list[tuple[int, float]]:
    """(token, its natural-log probability under the sampling distribution) for every (fp32 logits row [vocab],
    params, generator) of a pass, with one device-to-host copy in all. A row with NaN or +inf logits gives
    (NONFINITE_ROW, nan).

    A pass emits a token per sequence; reading each back on its own would stop the host once per sequence. Greedy
    rows share one argmax over the stacked rows (ties to the lowest id, as per row); sampled rows keep their own
    generator, and their tokens stay on the device until the single copy. Each row's result still depends only on
    that row and its generator.
    """
    if not rows:
        return []
    stacked = torch.stack([logits for logits, _, _ in rows]).float()
    finite = torch.isfinite(stacked.max(-1).values) & ~torch.isnan(stacked).any(-1)
    tokens: list[torch.Tensor | None] = [None] * len(rows)
    logps: list[torch.Tensor | None] = [None] * len(rows)
    greedy = [i for i, (_, p, _) in enumerate(rows) if p.temperature == 0]
    if greedy:
        chosen = stacked[greedy]
        best = torch.argmax(chosen, -1)
        want = any(rows[i][1].logprobs for i in greedy)
        best_lp = torch.log_softmax(chosen, -1).gather(-1, best[:, None])[:, 0] if want else None
        for j, i in enumerate(greedy):
            tokens[i] = best[j:j + 1]
            if rows[i][1].logprobs:
                logps[i] = best_lp[j:j + 1]
    for i, (_, params, generator) in enumerate(rows):
        if params.temperature == 0:
            continue
        probs = _sampling_probs(stacked[i], params)
        # A non-finite row draws from a harmless stand-in (its result is replaced below): no host sync to skip it.
        probs = torch.where(finite[i], probs, torch.ones_like(probs))
        tokens[i] = torch.multinomial(probs, 1, generator=generator)
        if params.logprobs:
            logps[i] = torch.log(probs.gather(0, tokens[i]))
    lp_rows = [i for i in range(len(rows)) if logps[i] is not None]
    host = torch.cat([torch.cat(tokens).double(), finite.double(), *[logps[i].double() for i in lp_rows]]).tolist()
    n = len(rows)
    ids, ok, lp_values = host[:n], host[n:2 * n], dict(zip(lp_rows, host[2 * n:]))
    return [(int(t), lp_values.get(i, 0.0)) if ok[i] else (NONFINITE_ROW, float("nan"))
            for i, t in enumerate(ids)]


def _sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled row draws from: temperature, then the top-k and top-p cuts.

    The row is shifted by its maximum before the division, so a tiny temperature gives -inf (never inf - inf = NaN)
    and the distribution tends to the argmax, as the limit of the definition does."""
    scaled = (logits.float() - logits.max()) / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop = (cum - torch.softmax(sorted_logits, -1)) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.softmax(scaled, -1)
