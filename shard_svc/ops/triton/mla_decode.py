"""Absorbed MLA decode: one new token per sequence, MQA over the paged 576-wide latent cache.

Reference: `shard_svc/ops/mla/eager.py::mla_attention` (decode layout: T == B, each sequence's new token already
written at position ctx_lens[b]). With `kv_b_proj` = [W_UK; W_UV] per head:

    q_lat = q_nope W_UK                                  [T, nh, kv_lora]   (torch.bmm)
    s_j   = scale * (q_lat . c_kv_j + q_pe . k_pe_j)     over the sequence's ctx_lens[b] + 1 latents
    o_lat = softmax(s) . c_kv                            [T, nh, kv_lora]   (`_mla_decode_kernel`, `_mla_merge_kernel`)
    o     = o_lat W_UV^T                                 [T, nh, v]          (torch.bmm)

All heads share the latent, so one program takes a block of heads (the M side of its dot products) against a tile of
cached tokens. Long contexts are split along the tokens (split-K, flash-decoding): every sequence's own length is
cut into `num_splits` parts inside the kernel, the partial results (normalised output and log2-sum-exp per head)
are merged by a second kernel. The split count comes from shapes alone (batch, heads, block-table width), so the
op makes no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import (TritonKernelError, check_mla_layer, dot_precision, interpreting, pdl_args,
                                         pow2_at_least, sm_count)
from shard_svc.ops.triton.jit_helpers import LOG2E, online_softmax_step, pdl_prologue

MAX_SPLITS = 64
BLOCK_N = 64  # cached tokens per tile: a whole 64-token page; 1.5x faster than 32 at batch >= 64 on the H200


@triton.jit
def _mla_decode_kernel(
    q_lat, q_pe, kv_cache, block_tables, ctx_lens, o_part, lse_part,
    nh, stride_ql_t, stride_ql_h, stride_qp_t, stride_qp_h, stride_c_blk, stride_c_tok, stride_bt,
    stride_o_t, stride_o_h, stride_o_s, scale_log2,
    KV_LORA: tl.constexpr, ROPE: tl.constexpr, KV_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    i_b = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    i_b64 = i_b.to(tl.int64)
    length = tl.load(ctx_lens + i_b).to(tl.int32) + 1  # cached tokens plus the new one
    chunk = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BN) * BN
    start = i_s * chunk
    end = tl.minimum(start + chunk, length)

    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < nh
    o_c = tl.arange(0, KV_PAD)
    o_r = tl.arange(0, ROPE_PAD)
    m_c = o_c < KV_LORA
    m_r = o_r < ROPE
    b_ql = tl.load(q_lat + i_b64 * stride_ql_t + o_h[:, None] * stride_ql_h + o_c[None, :],
                   mask=m_h[:, None] & m_c[None, :], other=0.0)  # [BH, KV_PAD]
    b_qp = tl.load(q_pe + i_b64 * stride_qp_t + o_h[:, None] * stride_qp_h + o_r[None, :],
                   mask=m_h[:, None] & m_r[None, :], other=0.0)  # [BH, ROPE_PAD]
    if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
        b_ql, b_qp = b_ql.to(tl.float32), b_qp.to(tl.float32)

    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, KV_PAD], dtype=tl.float32)
    p_bt = block_tables + i_b64 * stride_bt
    for n0 in range(start, end, BN):
        tok = n0 + tl.arange(0, BN)
        m_t = tok < end
        blk = tl.load(p_bt + tok // BLOCK_SIZE, mask=m_t, other=0).to(tl.int64)
        row = blk * stride_c_blk + (tok % BLOCK_SIZE).to(tl.int64) * stride_c_tok  # [BN]
        b_kc = tl.load(kv_cache + row[:, None] + o_c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        b_kp = tl.load(kv_cache + row[:, None] + KV_LORA + o_r[None, :], mask=m_t[:, None] & m_r[None, :],
                       other=0.0)
        if DOT_FP32:
            b_kc, b_kp = b_kc.to(tl.float32), b_kp.to(tl.float32)
        s = (tl.dot(b_ql, tl.trans(b_kc), input_precision=PRECISION)
             + tl.dot(b_qp, tl.trans(b_kp), input_precision=PRECISION))  # [BH, BN]
        s = tl.where(m_t[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, b_kc, PRECISION)

    # An empty split (start >= length) leaves l_i = 0: output 0 and weight -inf for the merge.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    p_o = o_part + i_b64 * stride_o_t + o_h[:, None] * stride_o_h + i_s * stride_o_s + o_c[None, :]
    tl.store(p_o, out.to(o_part.dtype.element_ty), mask=m_h[:, None] & m_c[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_part + (i_b64 * nh + o_h) * NUM_SPLITS + i_s, lse, mask=m_h)


@triton.jit
def _mla_merge_kernel(o_part, lse_part, o_lat, nh, stride_p_t, stride_p_h, stride_p_s, stride_o_t, stride_o_h,
                      KV_LORA: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, BC: tl.constexpr,
                      PDL: tl.constexpr):
    pdl_prologue(PDL)
    i_b = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    o_c = tl.program_id(2) * BC + tl.arange(0, BC)
    m_c = o_c < KV_LORA
    o_s = tl.arange(0, S_PAD)
    m_s = o_s < NUM_SPLITS
    lse = tl.load(lse_part + (i_b * nh + i_h) * NUM_SPLITS + o_s, mask=m_s, other=float("-inf"))
    m = tl.max(lse, 0)  # finite: the split holding the new token is never empty
    w = tl.where(m_s, tl.exp2(lse - m), 0.0)
    part = tl.load(o_part + i_b * stride_p_t + i_h * stride_p_h + o_s[:, None] * stride_p_s + o_c[None, :],
                   mask=m_s[:, None] & m_c[None, :], other=0.0)  # [S_PAD, BC]
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(o_lat + i_b * stride_o_t + i_h * stride_o_h + o_c, out.to(o_lat.dtype.element_ty), mask=m_c)


def num_splits_for(batch: int, head_blocks: int, max_tokens: int, sm_count: int, waves: int = 2,
                   block_n: int = BLOCK_N) -> int:
    """Enough programs for `waves` waves over the multiprocessors, at least one token tile per split."""
    want = triton.cdiv(waves * sm_count, max(1, batch * head_blocks))
    return max(1, min(want, MAX_SPLITS, triton.cdiv(max_tokens, block_n)))


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
               block_tables: torch.Tensor, ctx_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
               num_splits: int | None = None, waves: int = 2, block_n: int = BLOCK_N,
               num_stages: int = 2) -> torch.Tensor:
    """Same contract as `ops.mla.eager.mla_attention` for a decode batch (one new token per sequence, T == B);
    returns o [T, nh, v] in q's dtype. The keyword arguments after `scale` are layout knobs (bench sweeps)."""
    op = "mla_decode"
    t, nh, nope, rope, kv_lora, v_dim, block_size, width = check_mla_layer(
        op, q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens)
    if block_tables.shape[0] != t:
        raise TritonKernelError(f"{op}: {t} query tokens for {block_tables.shape[0]} sequences; decode takes one "
                                "token per sequence")
    if kv_cache.stride(1) != width or block_tables.stride(1) != 1:
        raise TritonKernelError(f"{op}: kv_cache strides {kv_cache.stride()} and block_tables strides "
                                f"{block_tables.stride()} must be row-contiguous")
    if kv_lora > 1024 or rope > 256:
        raise TritonKernelError(f"{op}: kv_lora {kv_lora} > 1024 or rope {rope} > 256 do not fit the register tiles")
    out_dtype = q_nope.dtype
    if t == 0:
        return torch.empty(0, nh, v_dim, dtype=out_dtype, device=q_nope.device)

    w = w_kv_b.view(nh, nope + v_dim, kv_lora)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, :nope, :])  # [nh, T, kv_lora]
    bh = min(32, pow2_at_least(nh, 16))  # 64 heads a program spill registers (ptxas, sm_90)
    head_blocks = triton.cdiv(nh, bh)
    splits = num_splits or num_splits_for(t, head_blocks, block_tables.shape[1] * block_size,
                                          sm_count(q_nope.device), waves, block_n)
    kv_pad, rope_pad = pow2_at_least(kv_lora, 16), pow2_at_least(rope, 16)
    part_dtype = torch.float32 if splits > 1 else out_dtype
    o_part = torch.empty(t, nh, splits, kv_lora, dtype=part_dtype, device=q_nope.device)
    lse = torch.empty(t, nh, splits, dtype=torch.float32, device=q_nope.device)
    _mla_decode_kernel[(t, head_blocks, splits)](
        q_lat, q_pe, kv_cache, block_tables, ctx_lens, o_part, lse,
        nh, q_lat.stride(1), q_lat.stride(0), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(0),
        kv_cache.stride(1), block_tables.stride(0), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        scale * LOG2E,
        KV_LORA=kv_lora, ROPE=rope, KV_PAD=kv_pad, ROPE_PAD=rope_pad, BLOCK_SIZE=block_size, BH=bh, BN=block_n,
        NUM_SPLITS=splits, DOT_FP32=interpreting(), PRECISION=dot_precision(q_nope.dtype),
        num_warps=8 if kv_pad * bh >= 16384 else 4,
        num_stages=num_stages, **pdl_args(q_nope.device))
    if splits > 1:
        o_lat = torch.empty(t, nh, kv_lora, dtype=out_dtype, device=q_nope.device)
        bc = min(128, kv_pad)
        _mla_merge_kernel[(t, nh, triton.cdiv(kv_lora, bc))](
            o_part, lse, o_lat, nh, o_part.stride(0), o_part.stride(1), o_part.stride(2), o_lat.stride(0),
            o_lat.stride(1), KV_LORA=kv_lora, NUM_SPLITS=splits, S_PAD=pow2_at_least(splits, 2), BC=bc,
            num_warps=4, **pdl_args(o_lat.device))
    else:
        o_lat = o_part[:, :, 0]
    out = torch.bmm(o_lat.transpose(0, 1), w[:, nope:, :].transpose(1, 2))  # [nh, T, v]
    return out.transpose(0, 1)


mla_decode.graph_safe = True  # no host sync; grids and buffers sized from shapes only
