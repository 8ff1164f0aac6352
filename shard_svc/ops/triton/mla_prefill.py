"""MLA prefill: flash-style causal attention over each sequence's latent cache (no rotary), variable lengths, with
the cached prefix of chunked prefill.

Reference: `shard_svc/ops/mla/eager.py::mla_attention` (the new tokens already written to the cache; query i of
sequence b sits at position ctx_lens[b] + i and sees keys 0 .. that position). Not absorbed: for prefill the
per-head form costs nope + rope + v = 320 multiply-adds per (query, key, head) against 2 x 512 + 64 for the latent
form, so each sequence's latents are gathered from the paged cache once and expanded by `kv_b_proj` in one GEMM:

    k_nope | v = c_kv W_kv_b^T       [L, nh, nope + v]   (torch.mm over all sequences' latents, packed)
    s_ij = scale * (q_nope_i . k_nope_j + q_pe_i . k_pe_j)   with k_pe shared by the heads
    o_i  = softmax_j<=i(s) v                               (`_mla_prefill_kernel`)

One program per (query block of one sequence, head), online softmax over the key tiles up to the block's last
position. The per-sequence lengths are read to the host once to lay out the blocks: prefill is not captured in a
CUDA graph (the op does not declare `graph_safe`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check_mla_layer, interpreting, pow2_at_least
from shard_svc.ops.triton.jit_helpers import LOG2E, online_softmax_step


@triton.jit
def _mla_prefill_kernel(
    q_nope, q_pe, kv, k_pe, out, blocks,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h, stride_kv, stride_kp, stride_o_t, stride_o_h,
    scale_log2,
    NOPE: tl.constexpr, ROPE: tl.constexpr, V: tl.constexpr, NOPE_P: tl.constexpr, ROPE_P: tl.constexpr,
    V_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DOT_FP32: tl.constexpr,
):
    i_blk = tl.program_id(0)
    i_h = tl.program_id(1)
    # block layout: query row of the block's first query, queries left in the sequence from there, position of the
    # first query, packed key row of the sequence's position 0
    q_row = tl.load(blocks + i_blk * 4).to(tl.int64)
    n_q = tl.load(blocks + i_blk * 4 + 1)
    pos0 = tl.load(blocks + i_blk * 4 + 2)
    kv_row = tl.load(blocks + i_blk * 4 + 3).to(tl.int64)

    o_m = tl.arange(0, BM)
    m_m = o_m < n_q
    pos_q = pos0 + o_m
    last = pos0 + tl.minimum(n_q, BM) - 1  # the block's last query position: no key after it is seen
    o_dn = tl.arange(0, NOPE_P)
    o_dr = tl.arange(0, ROPE_P)
    o_dv = tl.arange(0, V_P)
    m_dn = o_dn < NOPE
    m_dr = o_dr < ROPE
    m_dv = o_dv < V
    rows = q_row + o_m
    b_qn = tl.load(q_nope + rows[:, None] * stride_qn_t + i_h * stride_qn_h + o_dn[None, :],
                   mask=m_m[:, None] & m_dn[None, :], other=0.0)
    b_qp = tl.load(q_pe + rows[:, None] * stride_qp_t + i_h * stride_qp_h + o_dr[None, :],
                   mask=m_m[:, None] & m_dr[None, :], other=0.0)
    if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
        b_qn, b_qp = b_qn.to(tl.float32), b_qp.to(tl.float32)

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, V_P], dtype=tl.float32)
    head = i_h * (NOPE + V)
    for n0 in range(0, last + 1, BN):
        keys = n0 + tl.arange(0, BN)
        m_n = keys <= last
        krow = kv_row + keys
        b_kn = tl.load(kv + krow[:, None] * stride_kv + head + o_dn[None, :], mask=m_n[:, None] & m_dn[None, :],
                       other=0.0)
        b_kp = tl.load(k_pe + krow[:, None] * stride_kp + o_dr[None, :], mask=m_n[:, None] & m_dr[None, :],
                       other=0.0)
        b_v = tl.load(kv + krow[:, None] * stride_kv + head + NOPE + o_dv[None, :],
                      mask=m_n[:, None] & m_dv[None, :], other=0.0)
        if DOT_FP32:
            b_kn, b_kp, b_v = b_kn.to(tl.float32), b_kp.to(tl.float32), b_v.to(tl.float32)
        s = tl.dot(b_qn, tl.trans(b_kn)) + tl.dot(b_qp, tl.trans(b_kp))  # [BM, BN]
        s = tl.where(keys[None, :] <= pos_q[:, None], s * scale_log2, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, m_i, l_i, acc, b_v)
    # Every valid query sees at least its own key, so l_i > 0 on the rows that are stored.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out + rows[:, None] * stride_o_t + i_h * stride_o_h + o_dv[None, :], o.to(out.dtype.element_ty),
             mask=m_m[:, None] & m_dv[None, :])


def _layout(ctx: list[int], bounds: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """Query blocks as (first query row, queries left, first position, key row of position 0), the blocks with the
    most keys first; and the packed key row where each sequence starts."""
    blocks, kv_starts, kv_at = [], [], 0
    for b, c in enumerate(ctx):
        start, n = bounds[b], bounds[b + 1] - bounds[b]
        kv_starts.append(kv_at)
        blocks.extend((start + i, n - i, c + i, kv_at) for i in range(0, n, block_m))
        kv_at += c + n
    blocks.sort(key=lambda blk: -(blk[2] + min(blk[1], block_m)))  # longest key range first: fewer stragglers
    return [v for blk in blocks for v in blk], kv_starts


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, w_kv_b: torch.Tensor,
                block_tables: torch.Tensor, ctx_lens: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                block_m: int = 128, block_n: int = 64) -> torch.Tensor:
    """Same contract as `ops.mla.eager.mla_attention`; returns o [T, nh, v] in q's dtype."""
    op = "mla_prefill"
    t, nh, nope, rope, kv_lora, v_dim, bs, width = check_mla_layer(
        op, q_nope, q_pe, kv_cache, w_kv_b, block_tables, ctx_lens, cu_seqlens)
    n_seq = block_tables.shape[0]
    if max(nope, rope, v_dim) > 256:
        raise TritonKernelError(f"{op}: head dims nope {nope}, rope {rope}, v {v_dim} above 256 are not supported")
    out = torch.empty(t, nh, v_dim, dtype=q_nope.dtype, device=q_nope.device)
    if t == 0 or n_seq == 0:
        return out
    ctx, bounds = ctx_lens.tolist(), cu_seqlens.tolist()  # one host sync: prefill is never graph-captured
    if bounds[-1] != t:
        raise TritonKernelError(f"{op}: cu_seqlens ends at {bounds[-1]} for {t} query tokens")
    blocks, kv_starts = _layout(ctx, bounds, block_m)
    totals = [c + bounds[b + 1] - bounds[b] for b, c in enumerate(ctx)]
    if max(-(-n // bs) for n in totals) > block_tables.shape[1]:
        raise TritonKernelError(f"{op}: a sequence of {max(totals)} tokens needs more than the "
                                f"{block_tables.shape[1]} blocks of its table")
    dev = q_nope.device
    # Cache rows of every sequence's positions 0 .. total-1, packed: gather the latents once.
    lengths = torch.tensor(totals, device=dev)
    seq = torch.repeat_interleave(torch.arange(n_seq, device=dev), lengths)
    pos = torch.arange(seq.shape[0], device=dev) - torch.tensor(kv_starts, device=dev)[seq]
    rows = block_tables[seq, pos // bs].long() * bs + pos % bs
    latent = kv_cache.reshape(-1, width)[rows]  # [L, kv_lora + rope]
    kv = latent[:, :kv_lora] @ w_kv_b.t()  # [L, nh * (nope + v)]
    k_pe = latent[:, kv_lora:]
    blocks_t = torch.tensor(blocks, dtype=torch.int32, device=dev)
    grid = (len(blocks) // 4, nh)
    _mla_prefill_kernel[grid](
        q_nope, q_pe, kv, k_pe, out, blocks_t,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), k_pe.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E,
        NOPE=nope, ROPE=rope, V=v_dim, NOPE_P=pow2_at_least(nope, 16), ROPE_P=pow2_at_least(rope, 16),
        V_P=pow2_at_least(v_dim, 16), BM=block_m, BN=block_n, DOT_FP32=interpreting(),
        num_warps=8 if block_m >= 128 else 4, num_stages=2)
    return out
