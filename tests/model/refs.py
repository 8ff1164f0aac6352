"""Small references written from docs/models.md, for the model tests.

Independent of `shard_svc`: plain torch, explicit loops, one sequence at a time, fp32 where the spec says so. They
read weights as plain tensors and never call the model's functions, so a test comparing the model against them
checks the model against the spec, not against itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

Tensor = torch.Tensor


# -- norms and activations -----------------------------------------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Statistics in fp32, cast back to x's dtype, then times the weight (docs/models.md#rmsnorm)."""
    xf = x.float()
    normed = xf / torch.sqrt((xf * xf).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return gate * torch.sigmoid(gate) * up


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> Tensor:
    """K3 SiTU-GLU in fp32: b*tanh(gate/b) * sigmoid(gate) * (bl*tanh(up/bl))."""
    g, u = gate.float(), up.float()
    return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))).to(gate.dtype)


def gated_mlp(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, act: Callable[[Tensor, Tensor], Tensor]):
    return act(x @ gate_w.t(), x @ up_w.t()) @ down_w.t()


# -- KDA -------------------------------------------------------------------------------------------------------------
def kda_gate(f: Tensor, a_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """f [T, H, K]; a_log [H]; dt_bias [H*K] -> log-decay g [T, H, K] fp32.

    Kimi-Linear: -exp(A_log[h]) * softplus(f + dt_bias), softplus linear above 20.
    K3: lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).
    """
    t, h, k = f.shape
    z = f.float() + dt_bias.float().reshape(h, k)
    a = torch.exp(a_log.float()).reshape(1, h, 1)
    if lower_bound is None:
        softplus = torch.where(z > 20, z, torch.log1p(torch.exp(torch.clamp(z, max=20))))
        return -a * softplus
    return lower_bound * torch.sigmoid(a * z)


def causal_depthwise_conv_silu(y: Tensor, weight: Tensor) -> Tensor:
    """y [T, C]; weight [C, W] (the last tap multiplies the current input) -> SiLU(conv) [T, C], zero history."""
    t_len, width = y.shape[0], weight.shape[1]
    yf, wf = y.float(), weight.float()
    out = torch.zeros_like(yf)
    for t in range(t_len):
        for j in range(width):
            src = t - (width - 1 - j)
            if src >= 0:
                out[t] += wf[:, j] * yf[src]
    return torch.nn.functional.silu(out).to(y.dtype)


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    xf = x.float()
    return xf / torch.sqrt((xf * xf).sum(dim=-1, keepdim=True) + eps)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None = None):
    """The docs/models.md#recurrence step, per head, token by token, fp32.

    q, k [T, H, K] (already normalised / scaled); v [T, H, V]; g [T, H, K] log-decay; beta [T, H]; state [H, K, V].
    Returns (o [T, H, V], final state [H, K, V]).
    """
    t_len, heads, kd = k.shape
    vd = v.shape[-1]
    s = torch.zeros(heads, kd, vd) if state is None else state.float().clone()
    out = torch.zeros(t_len, heads, vd)
    for t in range(t_len):
        for h in range(heads):
            s[h] = torch.exp(g[t, h]).unsqueeze(1) * s[h]  # diag(exp(g_t)) S
            u = beta[t, h] * (v[t, h].float() - s[h].t() @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
            out[t, h] = s[h].t() @ q[t, h]
    return out, s


@dataclass
class KDAWeights:
    q: Tensor
    k: Tensor
    v: Tensor  # [H*K, D]
    q_conv: Tensor
    k_conv: Tensor
    v_conv: Tensor  # [H*K, W]
    f_a: Tensor
    f_b: Tensor
    b: Tensor
    o_norm: Tensor
    o: Tensor
    a_log: Tensor  # [H]
    dt_bias: Tensor  # [H*K]
    g_full: Tensor | None = None  # K3 full-rank output gate g_proj [H*K, D]
    g_a: Tensor | None = None  # Kimi-Linear low-rank output gate
    g_b: Tensor | None = None


def kda_layer(x: Tensor, w: KDAWeights, heads: int, head_dim: int, lower_bound: float | None, eps: float) -> Tensor:
    """One KDA mixer over one sequence x [T, D] (normed input), from zero state."""
    t_len = x.shape[0]
    shape = (t_len, heads, head_dim)
    q = causal_depthwise_conv_silu(x @ w.q.t(), w.q_conv).reshape(shape)
    k = causal_depthwise_conv_silu(x @ w.k.t(), w.k_conv).reshape(shape)
    v = causal_depthwise_conv_silu(x @ w.v.t(), w.v_conv).reshape(shape)
    g = kda_gate(((x @ w.f_a.t()) @ w.f_b.t()).reshape(shape), w.a_log, w.dt_bias, lower_bound)
    beta = torch.sigmoid((x @ w.b.t()).float())
    qn = l2_normalize(q) * head_dim**-0.5
    kn = l2_normalize(k)
    o, _ = delta_rule(qn, kn, v.float(), g, beta)
    gate = x @ w.g_full.t() if w.g_full is not None else (x @ w.g_a.t()) @ w.g_b.t()
    o = rms_norm(o, torch.ones(head_dim), eps).float() * w.o_norm.float() * torch.sigmoid(gate.float().reshape(shape))
    return o.reshape(t_len, heads * head_dim).to(x.dtype) @ w.o.t()


# -- MLA -------------------------------------------------------------------------------------------------------------
@dataclass
class MLAWeights:
    kv_a: Tensor  # [kv_lora + rope, D]
    kv_a_norm: Tensor  # [kv_lora]
    kv_b: Tensor  # [nh * (nope + v), kv_lora]
    o: Tensor  # [D, nh * v]
    q: Tensor | None = None  # [nh * (nope + rope), D] when there is no q-LoRA
    q_a: Tensor | None = None  # K3 q-LoRA
    q_a_norm: Tensor | None = None
    q_b: Tensor | None = None
    g: Tensor | None = None  # K3 output gate [nh * v, D]


def mla_layer(x: Tensor, w: MLAWeights, heads: int, nope: int, rope: int, v_dim: int, latent_eps: float) -> Tensor:
    """One NoPE MLA mixer over one sequence x [T, D], causal, non-absorbed."""
    t_len = x.shape[0]
    kv_lora = w.kv_a_norm.shape[0]
    if w.q is not None:
        q = x @ w.q.t()
    else:
        q = rms_norm(x @ w.q_a.t(), w.q_a_norm, latent_eps) @ w.q_b.t()
    q = q.reshape(t_len, heads, nope + rope)
    latent = x @ w.kv_a.t()
    c_kv, k_pe = latent[:, :kv_lora], latent[:, kv_lora:]  # k_pe [T, rope] shared by every head
    kv = (rms_norm(c_kv, w.kv_a_norm, latent_eps) @ w.kv_b.t()).reshape(t_len, heads, nope + v_dim)
    out = torch.zeros(t_len, heads, v_dim)
    scale = (nope + rope) ** -0.5
    for h in range(heads):
        keys = torch.cat([kv[:, h, :nope], k_pe], dim=-1).float()  # [T, nope+rope], no rotation
        scores = (q[:, h].float() @ keys.t()) * scale
        scores = scores.masked_fill(torch.ones(t_len, t_len).triu(1).bool(), float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ kv[:, h, nope:].float()
    o = out.reshape(t_len, heads * v_dim).to(x.dtype)
    if w.g is not None:
        o = o * torch.sigmoid(x @ w.g.t())
    return o @ w.o.t()


# -- MoE -------------------------------------------------------------------------------------------------------------
def route(x: Tensor, gate_w: Tensor, bias: Tensor, top_k: int, renormalize: bool, scaling: float):
    """Per token: choose by sigmoid score + bias; weigh by the unbiased score, renormalised, times scaling.

    x [T, D] -> list over tokens of [(expert, weight), ...] in selection order.
    """
    out = []
    for row in x.float():
        s = torch.sigmoid(gate_w.float() @ row).tolist()
        b = bias.float().tolist()
        chosen = sorted(range(len(s)), key=lambda e: s[e] + b[e], reverse=True)[:top_k]
        weights = [s[e] for e in chosen]
        if renormalize:
            denom = sum(weights) + 1e-20
            weights = [wt / denom for wt in weights]
        out.append([(e, wt * scaling) for e, wt in zip(chosen, weights)])
    return out


@dataclass
class MoEWeights:
    gate: Tensor  # [E, D]
    bias: Tensor  # [E]
    w1: Tensor  # [E, I, Din] gate
    w3: Tensor  # [E, I, Din] up
    w2: Tensor  # [E, Din, I] down
    shared: tuple[Tensor, Tensor, Tensor] | None = None  # (gate, up, down) on the full x
    latent_down: Tensor | None = None  # [L, D]
    latent_up: Tensor | None = None  # [D, L]
    latent_norm: Tensor | None = None  # [L]


def moe(x: Tensor, w: MoEWeights, top_k: int, renormalize: bool, scaling: float,
        act: Callable[[Tensor, Tensor], Tensor], eps: float) -> Tensor:
    """Routed experts (in the latent when latent_down is set), weighted sum, [latent norm, up], + shared on x."""
    rows = []
    for t, choice in enumerate(route(x, w.gate, w.bias, top_k, renormalize, scaling)):
        xt = x[t]
        z = w.latent_down @ xt if w.latent_down is not None else xt
        y = torch.zeros(z.shape[0])
        for e, weight in choice:
            y = y + weight * (w.w2[e] @ act(w.w1[e] @ z, w.w3[e] @ z)).float()
        y = y.to(x.dtype)
        if w.latent_down is not None:
            if w.latent_norm is not None:
                y = rms_norm(y, w.latent_norm, eps)
            y = w.latent_up @ y
        if w.shared is not None:
            y = y + gated_mlp(xt, *w.shared, act)
        rows.append(y)
    return torch.stack(rows)


# -- K3 Block Attention Residuals -------------------------------------------------------------------------------------
def attn_res(cur: Tensor, blocks: list[Tensor], norm_w: Tensor, proj_w: Tensor, eps: float) -> Tensor:
    """AttnRes(cur, B): softmax over sources [B_0..B_{n-1}, cur] of RMSNorm(source) . proj (fp32, no scaling);
    the output mixes the raw sources. cur and each block [T, D]; proj_w [1, D] or [D]."""
    sources = [*blocks, cur]
    query = proj_w.float().reshape(-1)
    scores = torch.stack([rms_norm(src.float(), norm_w.float(), eps) @ query for src in sources])  # [n+1, T]
    probs = torch.softmax(scores, dim=0)
    mixed = sum(probs[i].unsqueeze(-1) * src.float() for i, src in enumerate(sources))
    return mixed.to(cur.dtype)


Mix = Callable[[Tensor, list[Tensor]], Tensor]  # (cur, blocks) -> AttnRes(cur, blocks) with one layer's weights


def attn_res_with(norm_w: Tensor, proj_w: Tensor, eps: float) -> Mix:
    return lambda cur, blocks: attn_res(cur, blocks, norm_w, proj_w, eps)


@dataclass
class K3Layer:
    mixer: Callable[[Tensor], Tensor]  # input_layernorm + mixer
    ffn: Callable[[Tensor], Tensor]  # post_attention_layernorm + ffn
    attn_res: Mix  # self_attention_res_*
    mlp_res: Mix  # mlp_res_*


@dataclass
class K3Trace:
    hidden: Tensor  # after the output mix and the final norm [T, D]
    boundaries: list[int]  # layers whose prefix was appended to the carry
    carry_len: int  # summaries in the carry after the last layer
    output_sources: int  # sources the output mix saw


def k3_forward(emb: Tensor, layers: list[K3Layer], output_res: Mix, final_norm: Callable[[Tensor], Tensor],
               block_size: int, *, mix_before_norm: bool = True, keep_carry: bool = True) -> K3Trace:
    """docs/models.md#block-attention-residuals steps 1-8 and the output mix, over one sequence.

    `mix_before_norm=False` applies the final norm first and mixes afterwards (the wrong order);
    `keep_carry=False` hands every layer an empty carry (docs/lessons.md#no-silent-wrong-output: the dropped carry).
    """
    x, blocks, boundaries = emb, [], []
    for idx, layer in enumerate(layers):
        if not keep_carry:
            blocks = []
        prefix = x  # 1
        if blocks:  # 2
            x = layer.attn_res(prefix, blocks)
        opens = idx % block_size == 0
        if opens:  # 3 (layer 0 appends the embedding)
            blocks.append(prefix)
            boundaries.append(idx)
        h = layer.mixer(x)  # 4
        prefix = h if opens else prefix + h  # 5
        m = layer.mlp_res(prefix, blocks)  # 6
        x = prefix + layer.ffn(m)  # 7, 8
    if mix_before_norm:
        out = final_norm(output_res(x, blocks))
    else:
        out = output_res(final_norm(x), blocks)
    return K3Trace(out, boundaries, len(blocks), len(blocks) + 1)


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))
