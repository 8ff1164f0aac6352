"""A differentiable op backend for training the project's own model (shard_svc/model) on fixed-shape batches.

Serving runs the model over packed variable-length sequences with in-place state pools and a paged cache; training
runs it over `batch` sequences of exactly `seq_len` tokens each, all starting from empty state, and needs gradients.
`training_ops` fills the same op seam (shard_svc/ops.Ops) with implementations of the same functions that are batched
over sequences and keep the autograd graph: norms, linears and the router are the eager ops themselves; the short
conv, KDA (the chunked UT/WY form of ops/kda/eager.py, all sequences and chunks at once), MLA attention and the
experts are rewritten. `tests/training/test_ops.py` checks every model's logits against the eager engine's.

The model reads its pools through the forward context: `training_context` hands it stand-ins (no KDA state, a
latent "cache" that holds this pass's latents for the attention that follows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shard_svc.forward_batch import ForwardBatch, ForwardContext
from shard_svc.ops import EAGER, Ops
from shard_svc.ops.activations import glu
from shard_svc.ops.kda.gate import kda_gate, prepare_qkb
from shard_svc.ops.norm import rms_norm
from shard_svc.ops.precision import upcast

from training.mxfp4 import fake_quantize_mxfp4


class TrainingOpsError(RuntimeError):
    """An op was called in a way training never calls it (decode, or a batch of another shape)."""


@dataclass
class RouterLoads:
    """Tokens routed to each expert, one [E] count per MoE layer call of the last forward, in layer order."""

    per_layer: list[torch.Tensor] = field(default_factory=list)


class _NoKDAState:
    """Training sequences start from empty state and their final state is not kept."""

    def layer(self, engine_layer: int) -> tuple[None, None]:
        return None, None


class _Latents:
    def __init__(self) -> None:
        self.latent: torch.Tensor | None = None


class _LatentsOfThisPass:
    def layer(self, engine_layer: int) -> _Latents:
        return _Latents()


def training_context(ops: Ops, device: torch.device) -> ForwardContext:
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    batch = ForwardBatch(cu_seqlens=empty, ctx_lens=empty, state_slots=empty, block_tables=empty,
                         slot_mapping=empty, is_decode=False)
    return ForwardContext(batch=batch, kda_pool=_NoKDAState(),  # type: ignore[arg-type]
                          kv_cache=_LatentsOfThisPass(), ops=ops)


def training_ops(batch: int, seq_len: int, chunk: int = 32, mxfp4_experts: bool = False,
                 loads: RouterLoads | None = None) -> Ops:
    """Ops for inputs of `batch` x `seq_len` tokens packed as [batch * seq_len, ...]. `mxfp4_experts`: routed experts
    run on their MXFP4-rounded values (straight-through gradient), as a served MXFP4 checkpoint holds them."""
    if seq_len % chunk:
        raise TrainingOpsError(f"seq_len {seq_len} must be a multiple of the KDA chunk {chunk}")

    def rows(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != batch * seq_len:
            raise TrainingOpsError(f"{x.shape[0]} tokens in a pass built for {batch} x {seq_len}")
        return x.view(batch, seq_len, *x.shape[1:])

    def short_conv(x, weight, conv_state, slots, cu_seqlens):
        width = weight.shape[1]
        xs = F.pad(upcast(rows(x)).transpose(1, 2), (width - 1, 0))  # [B, C, W-1+L], empty state = zeros
        y = F.conv1d(xs, upcast(weight).unsqueeze(1), groups=weight.shape[0])
        return F.silu(y).transpose(1, 2).reshape(x.shape).to(x.dtype)

    def kda_prefill(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens,
                    snapshots=None):
        if snapshots is not None:
            raise TrainingOpsError("training passes carry no prefix-cache snapshot points")
        g = kda_gate(f, a_log, dt_bias, lower_bound)
        qn, kn, beta = prepare_qkb(q, k, beta_logits)
        o = chunked_kda(*(rows(t) for t in (qn, kn, upcast(v), g, beta)), chunk)
        return o.reshape(v.shape).to(v.dtype)

    def mla_cache_write(cache, c_kv, k_pe, norm_weight, eps, slot_mapping):
        cache.latent = torch.cat([rms_norm(c_kv, norm_weight, eps), k_pe], dim=-1)

    def mla_prefill(q_nope, q_pe, cache, w_kv_b, block_tables, ctx_lens, cu_seqlens, scale, lengths=None):
        nh, nope = q_nope.shape[1], q_nope.shape[2]
        kv_lora = w_kv_b.shape[1]
        lat = upcast(rows(cache.latent))  # [B, L, kv_lora + rope]
        kv = (lat[..., :kv_lora] @ upcast(w_kv_b).t()).view(batch, seq_len, nh, -1)
        k_pe = lat[..., kv_lora:].unsqueeze(2).expand(-1, -1, nh, -1)
        query = torch.cat([upcast(rows(q_nope)), upcast(rows(q_pe))], dim=-1).transpose(1, 2)
        key = torch.cat([kv[..., :nope], k_pe], dim=-1).transpose(1, 2)
        o = F.scaled_dot_product_attention(query, key, kv[..., nope:].transpose(1, 2), is_causal=True, scale=scale)
        return o.transpose(1, 2).reshape(batch * seq_len, nh, -1).to(q_nope.dtype)

    def moe_route(x, gate_weight, correction_bias, top_k, renormalize, scaling):
        weights, ids = EAGER["moe_route"](x, gate_weight, correction_bias, top_k, renormalize, scaling)
        if loads is not None:  # scatter_add, not bincount: bincount reads the largest id back to the host on a GPU
            flat = ids.flatten()
            counts = torch.zeros(gate_weight.shape[0], dtype=flat.dtype, device=flat.device)
            loads.per_layer.append(counts.scatter_add_(0, flat, torch.ones_like(flat)))
        return weights, ids

    def moe_experts(x, weights, ids, w1, w3, w2, activation, situ_betas):
        """Every expert on every token, mixed by the routing weights scattered to [T, E] (zero where not chosen):
        the eager op's sum over chosen experts, as dense products (tiny experts: no gather, no loop)."""
        if mxfp4_experts:
            w1, w3, w2 = (fake_quantize_mxfp4(w) for w in (w1, w3, w2))
        mix = torch.zeros(x.shape[0], w1.shape[0], dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        h = glu(torch.einsum("td,eid->tei", x, w1), torch.einsum("td,eid->tei", x, w3), activation, situ_betas)
        y = torch.einsum("tei,edi->ted", h, w2)
        return torch.einsum("te,ted->td", mix, upcast(y)).to(x.dtype)

    def no_decode(*args, **kwargs):
        raise TrainingOpsError("training runs whole sequences: no decode step")

    impls = dict(EAGER, short_conv=short_conv, kda_prefill=kda_prefill, kda_decode=no_decode,
                 mla_cache_write=mla_cache_write, mla_prefill=mla_prefill, mla_decode=no_decode,
                 moe_route=moe_route, moe_experts=moe_experts)
    return Ops(**impls, backends=tuple((name, "training") for name in sorted(impls)))


def chunked_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                chunk: int) -> torch.Tensor:
    """KDA from zero state for [B, L, H, *] fp32 inputs (q, k normalised; g log-decay; beta [B, L, H])
    -> o [B, L, H, V].

    The UT/WY form of ops/kda/eager.py::_chunk_kda with every chunk's intra-chunk part computed at once; only the
    state passes from chunk to chunk. Pairwise decays exp(G_i - G_j) are taken for j <= i only (exponents <= 0).
    """
    b, length, h, kd = k.shape
    n = length // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, *] -> [B, H, N, C, *]
        return x.reshape(b, n, chunk, h, -1).permute(0, 3, 1, 2, 4)

    qc, kc, vc, gc = chunks(q), chunks(k), chunks(v), chunks(g).cumsum(3)
    bc = chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = torch.exp((gc.unsqueeze(4) - gc.unsqueeze(3)).masked_fill(~causal[:, :, None], float("-inf")))
    a_kk = ((kc.unsqueeze(4) * kc.unsqueeze(3)) * decay).sum(-1).tril(-1) * bc  # [B, H, N, C(i), C(j)]
    a_qk = ((qc.unsqueeze(4) * kc.unsqueeze(3)) * decay).sum(-1)
    lower = a_kk + torch.eye(chunk, device=k.device)
    w = torch.linalg.solve_triangular(lower, bc * torch.exp(gc) * kc, upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(lower, bc * vc, upper=False, unitriangular=True)
    g_last = gc[:, :, :, -1:, :]  # [B, H, N, 1, K]
    q_decayed, k_to_end = qc * torch.exp(gc), kc * torch.exp(g_last - gc)
    state = k.new_zeros(b, h, kd, v.shape[-1])
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_decayed[:, :, i] @ state + a_qk[:, :, i] @ v_new)
        state = torch.exp(g_last[:, :, i]).transpose(-1, -2) * state + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).permute(0, 2, 3, 1, 4).reshape(b, length, h, -1)
