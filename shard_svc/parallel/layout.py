"""Which slice of the model each rank of a shard group holds. Pure Python: no torch, no process groups.

A group of `world = max(tp, ep)` ranks serves one model:
- attention heads (KDA and MLA) are split `tp` ways; with `tp < world` the ranks form `world / tp` attention
  groups of `tp` consecutive ranks, each computing the same attention for the same tokens (replicated);
- routed experts are partitioned `ep` ways (contiguous ranges, sizes differing by at most one); with `ep < world`
  the `world / ep` ranks sharing a partition split each expert's intermediate width;
- everything whose input is replicated on every rank (dense MLP, shared experts, K3 latent up-projection,
  embedding, lm_head) is split across the whole world;
- norms, routers, low-rank projections (KDA f_a/g_a, MLA q_a/kv_a) and the AttnRes mixes are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from shard_svc.config import ModelConfig
from shard_svc.parallel.errors import ParallelConfigError


def even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` when `total` splits into `parts` equal parts (the caller checked divisibility)."""
    size = total // parts
    return index * size, size


def near_even_split(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `total` in `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1 or self.ep < 1:
            raise ParallelConfigError(f"--tp {self.tp} and --ep {self.ep} must both be at least 1")
        if max(self.tp, self.ep) % min(self.tp, self.ep):
            raise ParallelConfigError(f"--tp {self.tp} and --ep {self.ep}: the larger must be a multiple of the "
                                      f"smaller (the group has max(tp, ep) = {max(self.tp, self.ep)} ranks)")
        if not 0 <= self.rank < self.world:
            raise ParallelConfigError(f"rank {self.rank} outside a group of {self.world} ranks")

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    # -- attention: tp-way inside groups of tp consecutive ranks ------------------------------------------------
    @property
    def attn_rank(self) -> int:
        return self.rank % self.tp

    def attention_groups(self) -> list[list[int]]:
        return [list(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.world // self.tp)]

    def heads(self, total: int) -> tuple[int, int]:
        """(first head, heads) of this rank, for KDA or MLA heads."""
        return even_split(total, self.tp, self.attn_rank)

    # -- routed experts: ep partitions, each split moe_tp ways on the intermediate width -------------------------
    @property
    def moe_tp(self) -> int:
        return self.world // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first expert, experts) held by this rank."""
        return near_even_split(num_experts, self.ep, self.ep_rank)

    def expert_width(self, intermediate: int) -> tuple[int, int]:
        return even_split(intermediate, self.moe_tp, self.rank % self.moe_tp)

    # -- widths whose input every rank holds: split across the whole world ---------------------------------------
    def world_split(self, total: int) -> tuple[int, int]:
        return even_split(total, self.world, self.rank)

    def local_kda_heads(self, cfg: ModelConfig) -> int:
        return cfg.kda.num_heads // self.tp

    def check(self, cfg: ModelConfig) -> None:
        """Raises one ParallelConfigError listing every size of `cfg` this layout cannot split."""
        problems = []

        def need(value: int, parts: int, what: str, flag: str) -> None:
            if value % parts:
                problems.append(f"{what} = {value} is not divisible by {flag} = {parts}")

        if "kda" in cfg.layer_kinds:
            need(cfg.kda.num_heads, self.tp, "KDA heads", "tp")
        if "mla" in cfg.layer_kinds:
            need(cfg.mla.num_heads, self.tp, "MLA heads", "tp")
        need(cfg.vocab_size, self.world, "vocab_size", "the group size max(tp, ep)")
        if "dense" in cfg.mlp_kinds:
            need(cfg.intermediate_size, self.world, "dense intermediate_size", "the group size max(tp, ep)")
        if "moe" in cfg.mlp_kinds:
            m = cfg.moe
            if m.num_experts < self.ep:
                problems.append(f"num_experts = {m.num_experts} is fewer than ep = {self.ep}")
            need(m.intermediate_size, self.moe_tp, "moe_intermediate_size", "max(tp, ep) / ep")
            if m.num_shared_experts:
                need(m.intermediate_size * m.num_shared_experts, self.world, "shared-expert width",
                     "the group size max(tp, ep)")
            if m.latent_size:
                need(m.latent_size, self.world, "routed_expert_hidden_size", "the group size max(tp, ep)")
        if problems:
            raise ParallelConfigError(f"{cfg.model_type} cannot be split with --tp {self.tp} --ep {self.ep}: "
                                      + "; ".join(problems))
