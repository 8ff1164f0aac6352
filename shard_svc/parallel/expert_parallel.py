"""Expert parallelism: each rank holds a contiguous range of every MoE layer's routed experts (and, when several
ranks share a range, a slice of each expert's intermediate width). Tokens are replicated on every rank (the
attention output is all-reduced), so dispatch is local: each rank runs its experts on the tokens routed to them,
and combine is one all-reduce of the partial sums, fused with the shared experts' partial sums (split over the
world). K3's latent MoE needs the full routed sum before its RMSNorm, so it all-reduces the latent first, then
the up-projection (split by latent columns) and shared-expert partial sums.

The router is replicated: every rank makes the same choice from the same (bitwise identical) input.
"""

from __future__ import annotations

import torch
from torch import nn

from shard_svc.forward_batch import ForwardContext
from shard_svc.model import KimiForCausalLM
from shard_svc.model.ffn import Experts, MoE
from shard_svc.ops.precision import acc_dtype, upcast
from shard_svc.parallel.group import ModelComm
from shard_svc.parallel.plan import ShardPlan
from shard_svc.parallel.tensor_parallel import shard_gated_mlp


def local_expert_sum(ops, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts,
                     first: int, activation: str, betas: tuple[float, float]) -> torch.Tensor:
    """This rank's part of the routed sum, [T, Din] in z's dtype. z [T, Din]; weights / ids [T, k] (global ids).

    Each (token, chosen local expert) pair becomes one row for the backend's `moe_experts` op (k = 1), so any
    backend serves the local experts; the rows are summed per token in the accumulation dtype."""
    count = experts.w1.shape[0]
    mine = (ids >= first) & (ids < first + count)  # [T, k]
    token, which = mine.nonzero(as_tuple=True)  # [P] pairs held here
    out = torch.zeros(z.shape[0], experts.w2.shape[1], dtype=acc_dtype(z.dtype), device=z.device)
    if token.numel():
        rows = ops.moe_experts(z[token], weights[token, which].unsqueeze(1), (ids[token, which] - first).unsqueeze(1),
                               experts.w1, experts.w3, experts.w2, activation, betas)  # [P, Din]
        out.index_add_(0, token, upcast(rows))
    return out.to(z.dtype)


class ExpertParallelMoE(nn.Module):
    """MoE's children under the same names (checkpoint parameter names are unchanged) with a combining forward."""

    def __init__(self, moe: MoE, comm: ModelComm, first_expert: int, latent_cols: slice | None):
        super().__init__()
        self.cfg, self.eps, self.activation, self.betas = moe.cfg, moe.eps, moe.activation, moe.betas
        for name, child in moe.named_children():
            self.add_module(name, child)
        self.comm, self.first_expert, self.latent_cols = comm, first_expert, latent_cols

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops, m = ctx.ops, self.cfg
        weights, ids = ops.moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, m.top_k,
                                     m.renormalize, m.routed_scaling_factor)
        z = self.routed_expert_down_proj(x, ops) if m.latent_size else x
        y = local_expert_sum(ops, z, weights, ids, self.experts, self.first_expert, self.activation, self.betas)
        if m.latent_size:
            y = self.comm.all_reduce_world(y)  # the norm below needs the whole routed sum
            if m.latent_norm:
                y = self.routed_expert_norm(y, ops)
            y = self.routed_expert_up_proj(y[:, self.latent_cols], ops)  # partial over this rank's latent columns
        if m.num_shared_experts:
            y = y + self.shared_experts(x, ctx)  # partial over this rank's shared-expert width
        return self.comm.all_reduce_world(y)


def shard_experts(model: KimiForCausalLM, comm: ModelComm, plan: ShardPlan) -> None:
    layout = comm.layout
    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer, "block_sparse_moe"):
            continue
        moe, name = layer.block_sparse_moe, f"model.layers.{i}.block_sparse_moe"
        m = moe.cfg
        e0, ne = layout.experts(m.num_experts)
        i0, ni = layout.expert_width(m.intermediate_size)
        plan.narrow(moe.experts, f"{name}.experts", "w1", (0, e0, ne), (1, i0, ni))
        plan.narrow(moe.experts, f"{name}.experts", "w3", (0, e0, ne), (1, i0, ni))
        plan.narrow(moe.experts, f"{name}.experts", "w2", (0, e0, ne), (2, i0, ni))
        if m.num_shared_experts:
            shard_gated_mlp(moe.shared_experts, f"{name}.shared_experts", layout, plan)
        cols = None
        if m.latent_size:
            l0, nl = layout.world_split(m.latent_size)
            plan.narrow(moe.routed_expert_up_proj, f"{name}.routed_expert_up_proj", "weight", (1, l0, nl))
            cols = slice(l0, l0 + nl)
        layer.block_sparse_moe = ExpertParallelMoE(moe, comm, e0, cols)
