"""Token-by-token KDA recurrence: the reference every faster KDA path is tested against. fp32, explicit loop."""

import torch

from shard_svc.ops.precision import acc_dtype, upcast

from shard_svc.ops.kda.varlen import kda_varlen


def naive_recurrent_kda(
    q: torch.Tensor,  # [L, H, K] fp32, normalised and scaled
    k: torch.Tensor,  # [L, H, K] fp32, normalised
    v: torch.Tensor,  # [L, H, V]
    g: torch.Tensor,  # [L, H, K] fp32 log-decay
    beta: torch.Tensor,  # [L, H] fp32
    state: torch.Tensor,  # [H, K, V] fp32 initial state (not modified)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [L, H, V] fp32, final state [H, K, V] fp32)."""
    s = upcast(state).clone()
    out = []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t]).unsqueeze(-1)
        u = beta[t].unsqueeze(-1) * (upcast(v[t]) - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + torch.einsum("hk,hv->hkv", k[t], u)
        out.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(out) if out else v.new_zeros(v.shape, dtype=acc_dtype(v.dtype)), s


def naive_kda_varlen(
    q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens, snapshots=None
) -> torch.Tensor:
    """Same contract as the `kda_prefill` op, computed with the token loop (reference for tests)."""
    return kda_varlen(naive_recurrent_kda, q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots,
                      cu_seqlens, snapshots)
