"""Feed-forward blocks: the dense gated MLP and the sigmoid-routed MoE (plain or K3 latent)."""

import torch
from torch import nn

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardContext
from shard_svc.model.layers import PackedWeights, RMSNorm, linear, split_linear, stacked_weight
from shard_svc.ops.moe.eager import with_shared_expert


class GatedMLP(PackedWeights):
    """down(act(gate(x), up(x))) with SwiGLU or SiTU-GLU; gate and up as one [T, 2I] product split into halves (over
    the buffer `kimi.pack_weights` packed them into, see layers.py)."""

    def __init__(self, cfg: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj, self.up_proj = linear(intermediate, hidden, dtype), linear(intermediate, hidden, dtype)
        self.down_proj = linear(hidden, intermediate, dtype)
        self.activation, self.betas = cfg.activation, (cfg.situ_beta, cfg.situ_linear_beta)

    def packed_groups(self) -> list[tuple[nn.Module, ...]]:
        return [(self.gate_proj, self.up_proj)]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops = ctx.ops
        gate, up = split_linear(x, (self.gate_proj, self.up_proj), ops)
        return self.down_proj(ops.glu(gate, up, self.activation, self.betas), ops)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32),
                                                    requires_grad=False)


class Experts(nn.Module):
    """All routed experts of one layer stacked: w1/w3 [E, I, Din] (gate/up), w2 [E, Din, I] (down)."""

    def __init__(self, num_experts: int, width: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate, dtype=dtype), requires_grad=False)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        m, d = cfg.moe, cfg.hidden_size
        width = m.latent_size or d
        self.cfg, self.eps = m, cfg.rms_norm_eps
        self.activation, self.betas = cfg.activation, (cfg.situ_beta, cfg.situ_linear_beta)
        self.gate = Router(m.num_experts, d, dtype)
        self.experts = Experts(m.num_experts, width, m.intermediate_size, dtype)
        if m.num_shared_experts:
            self.shared_experts = GatedMLP(cfg, d, m.intermediate_size * m.num_shared_experts, dtype)
        if m.latent_size:
            self.routed_expert_down_proj = linear(m.latent_size, d, dtype)
            self.routed_expert_up_proj = linear(d, m.latent_size, dtype)
            if m.latent_norm:
                self.routed_expert_norm = RMSNorm(m.latent_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ops, m = ctx.ops, self.cfg
        weights, ids = ops.moe_route(x, self.gate.weight, self.gate.e_score_correction_bias, m.top_k,
                                     m.renormalize, m.routed_scaling_factor)
        if m.num_shared_experts and not m.latent_size:
            # as one op where the backend fuses it (the shared expert inside the routed experts' launches)
            fused = ops.moe_experts_shared or with_shared_expert(ops.moe_experts, ops.linear, ops.glu)
            s = self.shared_experts
            return fused(x, weights, ids, self.experts.w1, self.experts.w3, self.experts.w2, self.activation,
                         self.betas, stacked_weight((s.gate_proj, s.up_proj)), s.down_proj.weight)
        z = self.routed_expert_down_proj(x, ops) if m.latent_size else x
        y = ops.moe_experts(z, weights, ids, self.experts.w1, self.experts.w3, self.experts.w2, self.activation,
                            self.betas)
        if m.latent_size:
            if m.latent_norm:
                y = self.routed_expert_norm(y, ops)
            y = self.routed_expert_up_proj(y, ops)
        if m.num_shared_experts:
            y = y + self.shared_experts(x, ctx)
        return y
