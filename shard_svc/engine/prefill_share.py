"""How one prefill pass's token budget is shared between the prompts being prefilled (docs/scheduling.md).

Every step the engine runs one prefill pass (at most `budget` new prompt tokens) and then one decode pass (every
sequence past its prompt, always), so a running decode's inter-token latency is one prefill pass plus one decode
pass. What this module decides is which prompt tokens go into the prefill pass.

Policy "fair" (the default):
- A prompt with at most `long_threshold` tokens left is short; it goes into the very next pass, whole when it fits,
  in admission order. Short prompts never wait behind a long one.
- A long prompt gets what the short ones leave, and never less than `long_floor` tokens (the oldest long prompt;
  the floor is held back from the short ones), so a stream of short requests cannot starve it.
- While anything else is running (a decode, or a short prompt in the same pass), a long prompt's chunk is also cut
  so that the pass's estimated cost stays within `mixed_cost` token-equivalents: late in a long prompt every token
  attends to a long context, so a pass of `budget` tokens there costs several times a pass of fresh ones, and every
  decode would wait that long for its next token. Alone, a long prompt takes whole budgets (its own fastest way).
- Cut chunks are multiples of 64 tokens (the KDA kernels' chunk), so the kernels keep their efficient shapes.
- With `fold_decodes` (off by default), while a long prompt prefills the step's decodes ride in the prefill pass as
  one-token rows: a decode then waits one pass for its next token, not a prefill pass and a decode pass. Off
  because today's MLA prefill pads every row of a pass to its longest context: beside a 256k-token prompt on the
  H200, 16 folded rows made an 8,192-token pass take 4.2 s instead of 1.0 s (docs/scheduling.md).
Policy "fcfs": the running prompts in admission order, each taking all the budget it can (the behaviour before
fair sharing; kept so benchmarks can compare the two in one run).

The cost model: a token costs its linear work (projections, experts, KDA) plus, for each context position it attends
to in the MLA layers, attention work; `context_tokens` is how many context positions cost as much as one token's
linear work, estimated from the model's shape (`context_tokens_per_token`). A chunk of n tokens starting at
position p costs n * (1 + (p + n / 2) / context_tokens) token-equivalents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from shard_svc.config import ModelConfig
from shard_svc.errors import SchedulingConfigError

POLICIES = ("fair", "fcfs")
CHUNK_ALIGN = 64  # a multiple of every KDA chunk length (ops/triton/kda_chunk.CHUNKS): cuts stay on their grid


class Prefilling(Protocol):
    """What the policy reads of a sequence (shard_svc/engine/sequence.py Sequence)."""

    num_computed: int
    prompt: list[int]


@dataclass(frozen=True)
class PrefillShare:
    budget: int  # new prompt tokens per prefill pass
    policy: str = "fair"
    long_threshold: int | None = None  # None: budget // 2
    long_floor: int | None = None  # None: budget // 4
    mixed_cost: int | None = None  # token-equivalents; None: 2 * budget
    context_tokens: float = math.inf  # inf: attention costs nothing (a token-only budget)
    fold_decodes: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SchedulingConfigError(f"prefill policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        if self.budget < 1:
            raise SchedulingConfigError(f"prefill token budget must be >= 1, got {self.budget}")
        for name in ("long_threshold", "long_floor", "mixed_cost"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SchedulingConfigError(f"prefill {name.replace('_', ' ')} must be >= 1 (or unset), got {value}")
        if self.floor > self.budget:
            raise SchedulingConfigError(f"long prefill floor {self.floor} exceeds the prefill token budget "
                                        f"{self.budget}")

    @property
    def threshold(self) -> int:
        return self.long_threshold if self.long_threshold is not None else max(1, self.budget // 2)

    @property
    def floor(self) -> int:
        return self.long_floor if self.long_floor is not None else max(1, self.budget // 4)

    @property
    def cost_cap(self) -> int:
        return self.mixed_cost if self.mixed_cost is not None else 2 * self.budget

    def cost(self, start: int, n: int) -> float:
        """Token-equivalents of prefilling n tokens from position `start`."""
        return n * (1 + (start + n / 2) / self.context_tokens)

    def tokens_within(self, start: int, cost: float) -> int:
        """The most tokens from position `start` whose cost stays within `cost` (the cost's quadratic inverted)."""
        if cost <= 0:
            return 0
        if math.isinf(self.context_tokens):
            return int(cost)
        c = self.context_tokens
        b = 1 + start / c
        return int(c * (math.sqrt(b * b + 2 * cost / c) - b))

    def folds_decodes(self, prefilling: list[Prefilling]) -> bool:
        """Whether this step's decodes ride in the prefill pass: with fold_decodes under "fair", while a long prompt
        prefills, so a decode waits one pass for its next token, not a prefill pass and then a decode pass."""
        return self.fold_decodes and self.policy == "fair" and any(
            len(s.prompt) - s.num_computed > self.threshold for s in prefilling)

    def plan(self, prefilling: list[Prefilling], others_running: bool) -> list[tuple[Prefilling, int]]:
        """(sequence, new tokens this pass) for the prompts being prefilled, given in admission order.
        others_running: sequences outside `prefilling` step this step too (decodes)."""
        most = {id(s): len(s.prompt) - s.num_computed for s in prefilling}
        taken = self._share(prefilling, others_running, most)
        return [(s, taken[id(s)]) for s in prefilling if id(s) in taken]

    def _share(self, prefilling: list[Prefilling], others_running: bool, most: dict[int, int]) -> dict[int, int]:
        """id(sequence) -> its tokens this pass (sequences are not hashable); `most`: each one's limit this pass.
        Long and short go by what is left of the whole prompt."""
        longs = [s for s in prefilling if len(s.prompt) - s.num_computed > self.threshold]
        if self.policy == "fcfs" or not longs:
            return _in_order(prefilling, self.budget, most)
        shorts = [s for s in prefilling if len(s.prompt) - s.num_computed <= self.threshold]
        reserve = min(self.floor, most[id(longs[0])])
        taken = _in_order(shorts, self.budget - reserve, most)
        room = self.budget - sum(taken.values())
        cost_room = self.cost_cap - sum(self.cost(s.num_computed, taken[id(s)]) for s in shorts if id(s) in taken)
        busy = others_running or bool(taken)
        for i, seq in enumerate(longs):
            n = min(most[id(seq)], room)
            if busy and n > 0:
                cut = self.tokens_within(seq.num_computed, cost_room)
                if cut < n:
                    aligned = cut - cut % CHUNK_ALIGN if cut > CHUNK_ALIGN else cut
                    n = max(aligned, reserve if i == 0 else 0)
            if n <= 0:
                continue
            taken[id(seq)] = n
            room -= n
            cost_room -= self.cost(seq.num_computed, n)
            busy = True
        return taken


def _in_order(seqs: list[Prefilling], budget: int, most: dict[int, int]) -> dict[int, int]:
    """Admission order, each as much as its limit and the budget allow."""
    taken = {}
    for seq in seqs:
        if budget <= 0:
            break
        taken[id(seq)] = n = min(most[id(seq)], budget)
        budget -= n
    return taken


def context_tokens_per_token(cfg: ModelConfig) -> float:
    """Context positions whose MLA attention work equals one prompt token's linear work, from the model's shape
    (multiply-adds; the prefill attention computes q.k over qk_head_dim and p.v over v_head_dim per head)."""
    h, k = cfg.hidden_size, cfg.kda
    kda = 5 * h * k.num_heads * k.head_dim + 4 * k.num_heads * k.head_dim * k.head_dim  # q k v o gates; recurrence
    m = cfg.mla
    q_in = m.q_lora_rank if m.q_lora_rank else h
    mla = (h * m.q_lora_rank if m.q_lora_rank else 0) + q_in * m.num_heads * m.qk_head_dim + h * m.latent_dim \
        + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) + m.num_heads * m.v_head_dim * h
    e = cfg.moe
    width = e.latent_size or h
    moe = 3 * width * e.intermediate_size * e.top_k + 3 * h * e.intermediate_size * e.num_shared_experts \
        + h * e.num_experts + (2 * h * width if e.latent_size else 0)
    dense = 3 * h * cfg.intermediate_size
    linear = cfg.layer_map.num_kda * kda + cfg.layer_map.num_mla * mla + sum(
        moe if kind == "moe" else dense for kind in cfg.mlp_kinds)
    attention = cfg.layer_map.num_mla * m.num_heads * (m.qk_head_dim + m.v_head_dim)
    return linear / attention if attention else math.inf
