"""Tensor parallelism as edits to a built KimiForCausalLM (the model file knows nothing of it).

Attention (tp ranks of an attention group): KDA and MLA heads are split; each rank runs its heads with the
unchanged mixer code (head counts come from the sliced weights and the edited `num_heads` / `nh`), and a forward
hook all-reduces the mixer's o_proj partial sums. Per rank a KDA layer holds H/tp heads of q/k/v/f_b/g(_b)/b
projections, convs, A_log and dt_bias, and the matching input columns of o_proj; f_a, g_a and o_norm (per head
width, shared by heads) are replicated. An MLA layer holds nh/tp heads of q(_b), kv_b, the output gate and o_proj
columns; the latent path (q_a, kv_a_proj_with_mqa and their norms) is replicated, so every rank writes the same
latent into its own MLA cache (the cache is shared by all heads and cannot be split by head).

World (every rank, input replicated): the dense MLP is split on its intermediate width (gate/up rows, down
columns, all-reduce); the embedding and lm_head are split by vocab rows (masked lookup + all-reduce; local logits +
all-gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shard_svc.model import KimiForCausalLM
from shard_svc.model.ffn import GatedMLP
from shard_svc.model.kda import KDAttention
from shard_svc.model.mla import MLAttention
from shard_svc.ops.precision import upcast
from shard_svc.parallel.group import ModelComm
from shard_svc.parallel.layout import ParallelLayout
from shard_svc.parallel.plan import ShardPlan


def _reduce_output(reduce):
    def hook(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        return reduce(output)

    return hook


def shard_kda(attn: KDAttention, name: str, layout: ParallelLayout, plan: ShardPlan) -> None:
    k = attn.head_dim
    h0, hl = layout.heads(attn.num_heads)
    rows = (0, h0 * k, hl * k)
    gates = ("g_proj",) if hasattr(attn, "g_proj") else ("g_b_proj",)
    for proj in ("q_proj", "k_proj", "v_proj", "f_b_proj", *gates):
        plan.narrow(getattr(attn, proj), f"{name}.{proj}", "weight", rows)
    for conv_name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(attn, conv_name)
        plan.narrow(conv, f"{name}.{conv_name}", "weight", rows)
        conv.in_channels = conv.out_channels = conv.groups = hl * k
    plan.narrow(attn.b_proj, f"{name}.b_proj", "weight", (0, h0, hl))
    plan.narrow(attn.o_proj, f"{name}.o_proj", "weight", (1, h0 * k, hl * k))
    plan.narrow(attn, name, "A_log", (0, h0, hl))
    plan.narrow(attn, name, "dt_bias", rows)
    attn.num_heads = hl


def shard_mla(attn: MLAttention, name: str, layout: ParallelLayout, plan: ShardPlan) -> None:
    n0, nl = layout.heads(attn.nh)
    qk, kv = attn.nope + attn.rope, attn.nope + attn.v_dim
    q = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
    plan.narrow(getattr(attn, q), f"{name}.{q}", "weight", (0, n0 * qk, nl * qk))
    plan.narrow(attn.kv_b_proj, f"{name}.kv_b_proj", "weight", (0, n0 * kv, nl * kv))
    if hasattr(attn, "g_proj"):
        plan.narrow(attn.g_proj, f"{name}.g_proj", "weight", (0, n0 * attn.v_dim, nl * attn.v_dim))
    plan.narrow(attn.o_proj, f"{name}.o_proj", "weight", (1, n0 * attn.v_dim, nl * attn.v_dim))
    attn.nh = nl


SHARD_MIXER = {KDAttention: shard_kda, MLAttention: shard_mla}


def shard_gated_mlp(mlp: GatedMLP, name: str, layout: ParallelLayout, plan: ShardPlan) -> None:
    """Intermediate width split over the world: the output is this rank's partial sum (the caller reduces)."""
    start, size = layout.world_split(mlp.gate_proj.out_features)
    plan.narrow(mlp.gate_proj, f"{name}.gate_proj", "weight", (0, start, size))
    plan.narrow(mlp.up_proj, f"{name}.up_proj", "weight", (0, start, size))
    plan.narrow(mlp.down_proj, f"{name}.down_proj", "weight", (1, start, size))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; other ids look up zeros, and the all-reduce fills them in (exactly: one
    non-zero term per element)."""

    def __init__(self, weight: nn.Parameter, first: int, comm: ModelComm):
        super().__init__()
        self.weight, self.first, self.comm = weight, first, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)  # [T, D]
        return self.comm.all_reduce_world(out.masked_fill(~mine.unsqueeze(-1), 0))


class VocabParallelCausalLM(nn.Module):
    """The same children under the same names as KimiForCausalLM (so parameter names stay the checkpoint's), with
    vocab-parallel logits: each rank multiplies by its lm_head rows and the slices are all-gathered."""

    def __init__(self, base: KimiForCausalLM, comm: ModelComm):
        super().__init__()
        self.cfg, self.comm = base.cfg, comm
        self.model = base.model
        if hasattr(base, "lm_head"):
            self.lm_head = base.lm_head

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        return self.model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor, ops) -> torch.Tensor:
        """hidden [N, D] -> fp32 logits [N, vocab], the same on every rank."""
        weight = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        return self.comm.all_gather_last_dim(upcast(ops.linear(hidden, weight)))


def shard_attention(model: KimiForCausalLM, comm: ModelComm, plan: ShardPlan) -> None:
    if comm.layout.tp == 1:
        return  # replicated: every rank runs every head on the same input
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        SHARD_MIXER[type(attn)](attn, f"model.layers.{i}.self_attn", comm.layout, plan)
        attn.register_forward_hook(_reduce_output(comm.all_reduce_attn))


def shard_dense(model: KimiForCausalLM, comm: ModelComm, plan: ShardPlan) -> KimiForCausalLM | VocabParallelCausalLM:
    """Dense MLPs, embedding and lm_head over the world; returns the new root module."""
    layout = comm.layout
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "mlp"):
            shard_gated_mlp(layer.mlp, f"model.layers.{i}.mlp", layout, plan)
            layer.mlp.register_forward_hook(_reduce_output(comm.all_reduce_world))
    first, count = layout.world_split(model.cfg.vocab_size)
    plan.narrow(model.model.embed_tokens, "model.embed_tokens", "weight", (0, first, count))
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens.weight, first, comm)
    if hasattr(model, "lm_head"):
        plan.narrow(model.lm_head, "lm_head", "weight", (0, first, count))
    return VocabParallelCausalLM(model, comm)
