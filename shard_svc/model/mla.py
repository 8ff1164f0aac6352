"""MLA mixer without rotary: (optional q-LoRA) queries, a latent KV cache, optional sigmoid output gate.

The linears of the layer input (q_a or q_proj, kv_a_proj_with_mqa, the output gate's g_proj) run as one product
split into views: over the buffer `kimi.pack_weights` packed their weights into (`packed_groups`, layers.py), or
over their weights concatenated per step where they are not packed (streamed layers), with the same values.
"""

import torch
from torch import nn

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardContext
from shard_svc.model.layers import PackedWeights, RMSNorm, linear, split_linear

# q_a_layernorm / kv_a_layernorm use the RMSNorm default 1e-6, not rms_norm_eps: Moonshot's modeling code (Kimi-Linear
# remote code, K3) and transformers' kimi_linear build them without an eps (as DeepSeek-V3 does). vLLM passes
# rms_norm_eps; the choice moves a latent by about (1e-5 - 1e-6) / (2 * its mean square), relative.
LATENT_NORM_EPS = 1e-6


class MLAttention(PackedWeights):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        c = cfg.mla
        d = cfg.hidden_size
        self.layer_idx = layer_idx
        self.nh, self.nope, self.rope, self.v_dim, self.kv_lora = (
            c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank)
        self.scale = c.qk_head_dim**-0.5
        if c.q_lora_rank is None:
            self.q_proj = linear(c.num_heads * c.qk_head_dim, d, dtype)
        else:
            self.q_a_proj = linear(c.q_lora_rank, d, dtype)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = linear(c.num_heads * c.qk_head_dim, c.q_lora_rank, dtype)
        self.kv_a_proj_with_mqa = linear(c.kv_lora_rank + c.qk_rope_head_dim, d, dtype)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = linear(c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, dtype)
        if c.output_gate:
            self.g_proj = linear(c.num_heads * c.v_head_dim, d, dtype)
        self.o_proj = linear(d, c.num_heads * c.v_head_dim, dtype)

    def _input_linears(self) -> tuple[nn.Module, ...]:
        """Every linear of x: the queries' first (q_a) or only (q_proj) projection, kv_a, then g_proj if any."""
        q = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        return (q, self.kv_a_proj_with_mqa, *((self.g_proj,) if hasattr(self, "g_proj") else ()))

    def packed_groups(self) -> list[tuple[nn.Module, ...]]:
        return [self._input_linears()]

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        ops, batch = ctx.ops, ctx.batch
        q, kv_a, *gate = split_linear(x, self._input_linears(), ops)  # gate: [g_proj's output], or []
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(q, ops), ops)
        q = q.view(t, self.nh, self.nope + self.rope)
        c_kv, k_pe = kv_a.split([self.kv_lora, self.rope], dim=-1)
        cache = ctx.kv_cache.layer(self.layer_idx)
        norm = self.kv_a_layernorm
        ops.mla_cache_write(cache, c_kv, k_pe, norm.weight, norm.eps, batch.slot_mapping)  # writes norm(c_kv) | k_pe
        args = (q[..., : self.nope], q[..., self.nope:], cache, self.kv_b_proj.weight, batch.block_tables,
                batch.ctx_lens, batch.cu_seqlens, self.scale)
        if batch.is_decode:
            o = ops.mla_decode(*args)
        else:
            o = ops.mla_prefill(*args, lengths=batch.host_lengths)
        o = o.reshape(t, self.nh * self.v_dim)
        if gate:
            o = o * torch.sigmoid(gate[0])
        return self.o_proj(o, ops)
