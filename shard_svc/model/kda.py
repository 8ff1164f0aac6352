"""KDA (Kimi Delta Attention) mixer: projections, short convs, gate, delta-rule recurrence, gated output norm.

q/k/v run as one projection and one short conv over [T, 3HK]; the low-rank decay and output gate inputs (f_a, g_a, or
the full-rank g_proj) and the beta logits (b_proj) as one more projection, split into views. `packed_groups` names
the three groups that `kimi.pack_weights` packs once into one buffer each (layers.py), so a step reads the packed
weights without a per-step `torch.cat`. Layers whose weights are not packed (streamed layers: their parameters are
bound to slot views per pass) concatenate each group's weights per step and compute the same values.
"""

import torch
from torch import nn

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardContext
from shard_svc.model.layers import PackedWeights, joint_linear, linear, split_linear, stacked_weight
from shard_svc.ops.conv import snapshot_conv_states


class KDAttention(PackedWeights):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        c = cfg.kda
        d, hk = cfg.hidden_size, c.num_heads * c.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim, self.lower_bound = c.num_heads, c.head_dim, c.gate_lower_bound
        self.eps = cfg.rms_norm_eps
        self.q_proj, self.k_proj, self.v_proj = (linear(hk, d, dtype) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            nn.Conv1d(hk, hk, c.conv_kernel, groups=hk, bias=False, dtype=dtype) for _ in range(3)
        )
        self.f_a_proj, self.f_b_proj = linear(c.head_dim, d, dtype), linear(hk, c.head_dim, dtype)
        self.b_proj = linear(c.num_heads, d, dtype)
        if c.full_rank_output_gate:
            self.g_proj = linear(hk, d, dtype)
        else:
            self.g_a_proj, self.g_b_proj = linear(c.head_dim, d, dtype), linear(hk, c.head_dim, dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(c.head_dim, dtype=dtype), requires_grad=False)
        self.o_proj = linear(d, hk, dtype)
        self.A_log = nn.Parameter(torch.empty(c.num_heads, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hk, dtype=torch.float32), requires_grad=False)

    def _projections(self) -> tuple[nn.Module, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def _convs(self) -> tuple[nn.Module, ...]:
        return self.q_conv1d, self.k_conv1d, self.v_conv1d

    def _gate_inputs(self) -> tuple[nn.Module, ...]:
        """The other linears of x: f_a, the output gate's first (low-rank g_a) or only (full-rank g_proj) projection,
        and b."""
        return self.f_a_proj, self.g_proj if hasattr(self, "g_proj") else self.g_a_proj, self.b_proj

    def packed_groups(self) -> list[tuple[nn.Module, ...]]:
        return [self._projections(), self._convs(), self._gate_inputs()]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, k = x.shape[0], self.num_heads, self.head_dim
        ops, batch = ctx.ops, ctx.batch
        recurrent, conv_state = ctx.kda_pool.layer(self.layer_idx)
        conv_weight = stacked_weight(self._convs()).squeeze(1)  # [3HK, W]
        conv_in = joint_linear(x, self._projections(), ops)
        if batch.snapshots is not None:
            snapshot_conv_states(conv_in, conv_state, batch.snapshots.points)
        qkv = ops.short_conv(conv_in, conv_weight, conv_state, batch.state_slots, batch.cu_seqlens)  # [T, 3HK]
        q, kk, v = (part.view(t, h, k) for part in qkv.split(h * k, dim=-1))
        f_a, gate, beta_logits = split_linear(x, self._gate_inputs(), ops)  # beta_logits [T, H]
        f = self.f_b_proj(f_a, ops).view(t, h, k)
        if hasattr(self, "g_b_proj"):
            gate = self.g_b_proj(gate, ops)
        if batch.is_decode:
            o = ops.kda_decode(q, kk, v, f, beta_logits, self.A_log, self.dt_bias, self.lower_bound, recurrent,
                               batch.state_slots, batch.cu_seqlens)  # [T, H, V]
        else:
            o = ops.kda_prefill(q, kk, v, f, beta_logits, self.A_log, self.dt_bias, self.lower_bound, recurrent,
                                batch.state_slots, batch.cu_seqlens, snapshots=batch.snapshots)
        o = ops.gated_rms_norm(o, self.o_norm.weight, gate.view(t, h, k), self.eps)
        return self.o_proj(o.reshape(t, h * k), ops)
