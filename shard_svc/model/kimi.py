"""Decoder layer, model and causal LM for both families. Reads top-down; no generation logic here."""

from __future__ import annotations

import torch
from torch import nn

from shard_svc.config import ModelConfig
from shard_svc.forward_batch import ForwardContext
from shard_svc.model.attn_res import AttnResMix, BlockCarry
from shard_svc.model.ffn import MoE, GatedMLP
from shard_svc.model.kda import KDAttention
from shard_svc.model.layers import PackedWeights, RMSNorm, linear, pack_rows
from shard_svc.model.mla import MLAttention
from shard_svc.ops.precision import upcast

MIXERS = {"kda": KDAttention, "mla": MLAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.idx = idx
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.self_attn = MIXERS[cfg.layer_kinds[idx]](cfg, idx, dtype)
        if cfg.mlp_kinds[idx] == "dense":
            self.mlp = GatedMLP(cfg, d, cfg.intermediate_size, dtype)
        else:
            self.block_sparse_moe = MoE(cfg, dtype)
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnResMix(d, eps, dtype)
            self.mlp_res = AttnResMix(d, eps, dtype)

    @property
    def ffn_block(self) -> nn.Module:
        return self.mlp if hasattr(self, "mlp") else self.block_sparse_moe

    def mixer(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(x, ctx.ops), ctx)

    def ffn(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.ffn_block(self.post_attention_layernorm(x, ctx.ops), ctx)

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain residual path: h + mixer(h), then that + ffn(that). `pending` is the previous layer's FFN output
        not yet added to the residual stream h (None at the first layer): each add runs with the norm after it as
        one op (`add_rms_norm`), so this layer hands its own FFN output on the same way. Returns (h, pending)."""
        ops = ctx.ops
        if pending is None:
            x = self.input_layernorm(h, ops)
        else:
            x, h = self.input_layernorm.add_then_norm(pending, h, ops)
        x, h = self.post_attention_layernorm.add_then_norm(self.self_attn(x, ctx), h, ops)
        return h, self.ffn_block(x, ctx)

    def forward_attn_res(self, x: torch.Tensor, carry: BlockCarry, ctx: ForwardContext) -> torch.Tensor:
        """Block Attention Residuals path (docs/models.md#block-attention-residuals, steps 1-8)."""
        prefix = x
        if carry.count:
            x = self.self_attention_res(prefix, carry.filled(), ctx.ops)
        opens = carry.opens_block(self.idx)
        if opens:
            carry.append(prefix)
        h = self.mixer(x, ctx)
        prefix = h if opens else prefix + h
        m = self.mlp_res(prefix, carry.filled(), ctx.ops)
        return prefix + self.ffn(m, ctx)


class KimiModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        # Weights come from a checkpoint or an explicit init, so the table is left uninitialised: Embedding's own
        # normal_ init on the meta device imports torch._dynamo, 1.5 s in every process that builds a model.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if cfg.attn_res_block_size:
            self.output_attn_res = AttnResMix(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] packed -> final-normed hidden states [T, D]."""
        h = self.embed_tokens(input_ids)
        if not self.cfg.attn_res_block_size:
            pending = None
            for layer in self.layers:
                h, pending = layer(h, pending, ctx)
            return self.norm.add_then_norm(pending, h, ctx.ops)[0]
        carry = BlockCarry(self.cfg.num_layers, self.cfg.attn_res_block_size, h)
        for layer in self.layers:
            h = layer.forward_attn_res(h, carry, ctx)
        # Mix, then norm: the order is part of the model (docs/lessons.md#no-silent-wrong-output).
        return self.norm(self.output_attn_res(h, carry.filled(), ctx.ops), ctx.ops)


def pack_weights(model: nn.Module) -> int:
    """Packs every `packed_groups` group (KDA q/k/v projections and convs, KDA f_a/g/b, MLA q/kv_a(/g), MLP gate/up)
    into one buffer each (layers.py); done once before serving, after loading, tensor parallelism and weight
    streaming have edited the model. Returns how many groups were packed: streamed layers' placeholders are left
    alone (their groups concatenate their weights per step)."""
    return sum(pack_rows(group) for m in model.modules() if isinstance(m, PackedWeights) for group in m.packed_groups())


class KimiForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.model = KimiModel(cfg, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.vocab_size, cfg.hidden_size, dtype)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits [N, vocab]."""
        weight = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return upcast(ops.linear(hidden, weight))
