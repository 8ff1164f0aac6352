"""Eager KDA ops behind the op seam: chunked prefill (docs/models.md#chunked-prefill) and one-token decode.

Both read each sequence's initial state from the pool by slot and write its final state back in place.
"""

import torch

from shard_svc.ops.kda.snapshots import StateSnapshots
from shard_svc.ops.precision import acc_dtype, upcast

from shard_svc.ops.kda.gate import kda_gate, prepare_qkb
from shard_svc.ops.kda.varlen import kda_varlen

CHUNK = 64


def _chunk_kda(q, k, v, g, beta, state):
    """One sequence. q, k, g [L, H, K], v [L, H, V], beta [L, H] (all fp32), state [H, K, V] -> (o, state)."""
    length = q.shape[0]
    o = torch.empty(length, *v.shape[1:], dtype=acc_dtype(v.dtype), device=v.device)
    s = upcast(state).clone()
    for c0 in range(0, length, CHUNK):
        c1 = min(c0 + CHUNK, length)
        qc, kc, vc, bc = (x[c0:c1].transpose(0, 1) for x in (q, k, upcast(v), beta))  # head-major [H, C, *]
        gc = g[c0:c1].transpose(0, 1).cumsum(1)  # [H, C, K] cumulative log-decay inside the chunk
        n = c1 - c0
        # Pairwise decays exp(G_i - G_j) only where j <= i, so every exponent is <= 0 (no overflow).
        diff = gc.unsqueeze(2) - gc.unsqueeze(1)  # [H, C(i), C(j), K]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.exp(diff.masked_fill(~causal.unsqueeze(-1), float("-inf")))
        a_kk = torch.einsum("hik,hjk,hijk->hij", kc, kc, decay).tril(-1) * bc.unsqueeze(-1)
        a_qk = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
        eye = torch.eye(n, device=q.device).expand_as(a_kk)
        w = torch.linalg.solve_triangular(eye + a_kk, bc.unsqueeze(-1) * torch.exp(gc) * kc, upper=False,
                                          unitriangular=True)
        u = torch.linalg.solve_triangular(eye + a_kk, bc.unsqueeze(-1) * vc, upper=False, unitriangular=True)
        v_new = u - w @ s  # [H, C, V]
        o[c0:c1] = ((qc * torch.exp(gc)) @ s + a_qk @ v_new).transpose(0, 1)
        g_last = gc[:, -1:, :]  # [H, 1, K]
        s = torch.exp(g_last).transpose(1, 2) * s + (kc * torch.exp(g_last - gc)).transpose(1, 2) @ v_new
    return o, s


def kda_prefill(
    q: torch.Tensor,  # [T, H, K] conv outputs (not yet normalised)
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    f: torch.Tensor,  # [T, H, K] raw gate projection
    beta_logits: torch.Tensor,  # [T, H]
    a_log: torch.Tensor,  # [H] fp32
    dt_bias: torch.Tensor,  # [H*K] fp32
    lower_bound: float | None,
    state_pool: torch.Tensor,  # [slots, H, K, V] fp32, one layer's view, updated in place
    slots: torch.Tensor,  # [B]
    cu_seqlens: torch.Tensor,  # [B+1]
    snapshots: StateSnapshots | None = None,  # states to copy out at points inside the sequences
) -> torch.Tensor:
    """Packed varlen prefill; returns o [T, H, V] in v's dtype."""
    return kda_varlen(_chunk_kda, q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens,
                      snapshots)


def kda_decode(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens) -> torch.Tensor:
    """One new token per sequence (T == B), all sequences stepped at once; same contract as `kda_prefill`."""
    g = kda_gate(f, a_log, dt_bias, lower_bound)  # [B, H, K]
    qn, kn, beta = prepare_qkb(q, k, beta_logits)
    s = state_pool[slots] * torch.exp(g).unsqueeze(-1)  # [B, H, K, V]
    u = beta.unsqueeze(-1) * (upcast(v) - torch.einsum("bhkv,bhk->bhv", s, kn))
    s = s + kn.unsqueeze(-1) * u.unsqueeze(-2)
    state_pool[slots] = s
    return torch.einsum("bhkv,bhk->bhv", s, qn).to(v.dtype)
