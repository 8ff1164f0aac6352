"""The MLA cache write: the new tokens' latent normalised, joined with their rope key and written to their cache
slots, in one launch (three in the eager op: the norm, the concatenation, the indexed write).

Reference: `shard_svc/ops/mla/eager.py::mla_cache_write`. The norm follows the checkpoints' convention, as
`ops/norm.py::rms_norm` does: statistics in fp32, normalise, round to the latent's dtype, times the weight, then the
cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, check_index, interpreting, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue, round_to


@triton.jit
def _mla_cache_write_kernel(c_kv, k_pe, weight, cache, slots, T, stride_c, stride_p, eps,
                            KV_LORA: tl.constexpr, ROPE: tl.constexpr, BL: tl.constexpr, BP: tl.constexpr,
                            RNE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    o_l = tl.arange(0, BL)
    o_p = tl.arange(0, BP)
    m_l = o_l < KV_LORA
    m_p = o_p < ROPE
    x = tl.load(c_kv + t * stride_c + o_l, mask=m_l, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / KV_LORA + eps)
    w = tl.load(weight + o_l, mask=m_l, other=0.0).to(tl.float32)
    normed = round_to(x * rstd, c_kv.dtype.element_ty, RNE).to(tl.float32) * w
    row = cache + tl.load(slots + t) * (KV_LORA + ROPE)
    tl.store(row + o_l, round_to(normed, cache.dtype.element_ty, RNE), mask=m_l)
    tl.store(row + KV_LORA + o_p, tl.load(k_pe + t * stride_p + o_p, mask=m_p).to(cache.dtype.element_ty), mask=m_p)


def mla_cache_write(kv_cache: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, norm_weight: torch.Tensor,
                    eps: float, slot_mapping: torch.Tensor) -> None:
    """Same contract as `ops.mla.eager.mla_cache_write`: kv_cache [blocks, block_size, kv_lora + rope] (one layer's
    view, contiguous), c_kv [T, kv_lora], k_pe [T, rope] (rows may be strided), norm_weight [kv_lora], slot_mapping
    [T] flat token positions."""
    op = "mla_cache_write"
    check(op, "kv_cache", kv_cache, dims=3)
    check(op, "c_kv", c_kv, dims=2)
    check(op, "k_pe", k_pe, dtypes=(c_kv.dtype,), dims=2)
    check(op, "norm_weight", norm_weight, dims=1)
    t, kv_lora = c_kv.shape
    rope = k_pe.shape[1]
    check_index(op, "slot_mapping", slot_mapping, t)
    if (k_pe.shape[0] != t or kv_cache.shape[2] != kv_lora + rope or norm_weight.shape[0] != kv_lora
            or not kv_cache.is_contiguous()):
        raise TritonKernelError(f"{op}: c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}, norm_weight "
                                f"{tuple(norm_weight.shape)} do not fit kv_cache {tuple(kv_cache.shape)} "
                                f"(width kv_lora + rope, contiguous: {kv_cache.is_contiguous()})")
    if t == 0:
        return
    rne = interpreting() and torch.bfloat16 in (c_kv.dtype, kv_cache.dtype)
    _mla_cache_write_kernel[(t,)](
        c_kv, k_pe, norm_weight, kv_cache, slot_mapping, t, c_kv.stride(0), k_pe.stride(0), eps,
        KV_LORA=kv_lora, ROPE=rope, BL=pow2_at_least(kv_lora, 16), BP=pow2_at_least(rope, 16), RNE=rne,
        num_warps=4, **pdl_args(c_kv.device))


mla_cache_write.graph_safe = True  # no host sync; one program per token
