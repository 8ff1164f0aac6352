"""Eager MLA attention over the paged latent KV cache: the reference for the MLA kernels.

The cache holds, per token and MLA layer, `[RMSNorm(c_kv) (kv_lora) | k_pe (rope)]`. New tokens are written first
(`mla_cache_write`, which applies the norm), then each query attends causally to its sequence's cached prefix plus
itself.
"""

import torch

from shard_svc.ops.host_lengths import HostLengths
from shard_svc.ops.norm import rms_norm
from shard_svc.ops.precision import upcast

QUERY_BLOCK = 1024


def mla_cache_write(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, slot_mapping: torch.Tensor) -> None:
    """kv_cache [blocks, block_size, kv_lora + rope] one layer's view; the new tokens' c_kv [T, kv_lora] (normed here:
    the cache holds the normed latent, so decode never re-normalises old tokens) and k_pe [T, rope]; slot_mapping
    [T] flat token positions."""
    latent = torch.cat([rms_norm(c_kv, norm_weight, eps), k_pe], dim=-1)
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = latent.to(kv_cache.dtype)


def mla_attention(
    q_nope: torch.Tensor,  # [T, nh, nope]
    q_pe: torch.Tensor,  # [T, nh, rope]
    kv_cache: torch.Tensor,  # [blocks, block_size, kv_lora + rope], already holding the new tokens
    w_kv_b: torch.Tensor,  # [nh * (nope + v), kv_lora]
    block_tables: torch.Tensor,  # [B, max_blocks]
    ctx_lens: torch.Tensor,  # [B] tokens cached before this step
    cu_seqlens: torch.Tensor,  # [B+1] new-token offsets
    scale: float,
    lengths: HostLengths | None = None,  # cu_seqlens and ctx_lens on the host, if the caller has them
) -> torch.Tensor:
    """Returns o [T, nh, v] in q's dtype. Non-absorbed form: expand the latent to per-head K/V, then softmax."""
    nh, nope = q_nope.shape[1], q_nope.shape[2]
    kv_lora = w_kv_b.shape[1]
    v_dim = w_kv_b.shape[0] // nh - nope
    block_size = kv_cache.shape[1]
    out = torch.empty(q_nope.shape[0], nh, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    bounds, ctx = (lengths.cu_seqlens, lengths.ctx_lens) if lengths else (cu_seqlens.tolist(), ctx_lens.tolist())
    for b in range(len(ctx)):
        s, e = bounds[b], bounds[b + 1]
        total = ctx[b] + (e - s)
        nblocks = -(-total // block_size)
        lat = kv_cache[block_tables[b, :nblocks].long()].reshape(-1, kv_cache.shape[-1])[:total]
        lat = upcast(lat)
        kv = (lat[:, :kv_lora] @ upcast(w_kv_b).t()).view(total, nh, nope + v_dim)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        # Queries in blocks, so a long prompt never materialises a [heads, T, T] score matrix at once.
        for q0 in range(s, e, QUERY_BLOCK):
            q1 = min(q0 + QUERY_BLOCK, e)
            scores = torch.einsum("ihd,jhd->hij", upcast(q_nope[q0:q1]), k_nope)
            scores = scores + torch.einsum("ihd,jd->hij", upcast(q_pe[q0:q1]), lat[:, kv_lora:])
            pos = torch.arange(ctx[b] + q0 - s, ctx[b] + q1 - s, device=q_nope.device).unsqueeze(1)
            mask = torch.arange(total, device=q_nope.device).unsqueeze(0) > pos  # [i, j] future keys
            probs = torch.softmax((scores * scale).masked_fill(mask, float("-inf")), dim=-1)
            out[q0:q1] = torch.einsum("hij,jhd->ihd", probs, v).to(out.dtype)
    return out
