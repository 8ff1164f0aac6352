"""KDA (Kimi Delta Attention) mixer: projections, short convs, gate, delta-rule recurrence, gated output norm.

q/k/v run as one projection and one short conv over [T, 3HK]. `pack` (called once by the model runner) moves the
three projection weights, and the three conv weights, into one buffer each that the checkpoint-named parameters
then view, so a step reads the packed weights without a per-step `torch.cat`. Layers whose weights are not packed
(streamed layers: their parameters are bound to slot views per pass) concatenate per step, with the same values.
"""

import torch
from torch import nn

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardContext
from shard_svc.model.layers import linear, pack_rows, packed_rows


class KDAttention(nn.Module):
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

    def pack(self) -> bool:
        """Packs the q/k/v projection and conv weights (see the module docstring); False when they are not
        materialised (streamed placeholders), leaving them as they are."""
        return pack_rows(self._projections()) and pack_rows(self._convs())

    def _qkv(self, x: torch.Tensor, ops) -> torch.Tensor:
        """[T, 3HK] projections, one product when the weights are packed."""
        w = packed_rows([m.weight for m in self._projections()])
        if w is not None:
            return ops.linear(x, w)
        return torch.cat([m(x, ops) for m in self._projections()], dim=-1)

    def _conv_weight(self) -> torch.Tensor:
        parts = [m.weight for m in self._convs()]
        w = packed_rows(parts)
        return (torch.cat(parts) if w is None else w).squeeze(1)  # [3HK, W]

    def _output_gate(self, x: torch.Tensor, ops) -> torch.Tensor:
        if hasattr(self, "g_proj"):
            return self.g_proj(x, ops)
        return self.g_b_proj(self.g_a_proj(x, ops), ops)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t, h, k = x.shape[0], self.num_heads, self.head_dim
        ops, batch = ctx.ops, ctx.batch
        recurrent, conv_state = ctx.kda_pool.layer(self.layer_idx)
        qkv = ops.short_conv(self._qkv(x, ops), self._conv_weight(), conv_state, batch.state_slots, batch.cu_seqlens)
        q, kk, v = (part.view(t, h, k) for part in qkv.split(h * k, dim=-1))
        f = self.f_b_proj(self.f_a_proj(x, ops), ops).view(t, h, k)
        beta_logits = self.b_proj(x, ops)  # [T, H]
        kda = ops.kda_decode if batch.is_decode else ops.kda_prefill
        o = kda(q, kk, v, f, beta_logits, self.A_log, self.dt_bias, self.lower_bound, recurrent,
                batch.state_slots, batch.cu_seqlens)  # [T, H, V]
        o = ops.gated_rms_norm(o, self.o_norm.weight, self._output_gate(x, ops).view(t, h, k), self.eps)
        return self.o_proj(o.reshape(t, h * k), ops)
