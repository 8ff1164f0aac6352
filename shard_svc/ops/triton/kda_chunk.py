"""KDA chunked prefill over packed variable-length sequences (chunks of 16 rows, 32 or 64 on request), state read from
and written to the pool.

Reference: `shard_svc/ops/kda/eager.py::kda_prefill` (UT/WY chunk form, docs/models.md#chunked-prefill) and the token
loop `ops/kda/naive.py::naive_kda_varlen`. Two launches:

1. `_kda_chunk_intra_kernel`, one program per (chunk, head), all chunks in parallel. Fuses the gate, its
   cumulative sum G inside the chunk (log2 units), the q/k L2 norm and beta = sigmoid, then builds
       A_qk[i, j] = sum_c q_ic k_jc 2^(G_ic - G_jc)             (j <= i)
       A_kk[i, j] = beta_i sum_c k_ic k_jc 2^(G_ic - G_jc)      (j <  i)
   and inverts (I + A_kk) to write w = (I + A_kk)^-1 (beta 2^G k), u = (I + A_kk)^-1 (beta v), q 2^G,
   k 2^(G_last - G), A_qk and 2^G_last. It reads q and k twice (the L2 norms first, then everything else slice by
   slice, writing each slice's outputs as it goes) and the gate once.
2. `_kda_chunk_state_kernel`, one program per (sequence, head, V-block), walks the sequence's chunks in order:
       v_new = u - w S;  o = (q 2^G) S + A_qk v_new;  S = 2^G_last S + (k 2^(G_last - G))^T v_new
   starting from the pool slot's state and writing the final state back to it. With snapshot points
   (ops/kda/snapshots.py) a sequence is cut into segments there: chunks restart at a point, and the state at
   each point is written to the point's slot on the way, as a pass ending there would have left it.

Numerics: G reaches -320 nats in one chunk with K3's lower-bound gate (-5 per step) and is unbounded with the
softplus gate, so 2^-G overflows fp32. Every decay factor here is 2^x with x <= 0. A pair j < i is split by the
first row r of the second half of the smallest power-of-two block (64, 32, ..., 2 rows) holding both, and
2^(G_i - G_j) = 2^(G_i - G_r) * 2^(G_r - G_j) with both factors <= 1, so each level is a masked matrix product
on the tensor cores (batched [16, 16] tiles for levels up to 16 rows). (I + A_kk)^-1 is built by block merges
over the same levels, [[X11, 0], [-X22 A21 X11, X22]], which only multiply already-bounded blocks.
Inside a 16-row block whose channels span at most REF_SPAN_LOG2 on each side of its middle row (always, for K3's
gate; per channel slice, checked, for the softplus gate) the levels give way to one product per matrix around that
row.
Products run in tf32 (fp32 operands), as fla's intra-chunk kernels; in exact fp32 when the model computes in fp32
(`common.dot_precision`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from shard_svc.ops.kda.snapshots import StateSnapshots
from shard_svc.ops.triton.common import (TritonKernelError, check, check_index, dot_precision, interpreting,
                                         pow2_at_least, sm_count)
from shard_svc.ops.triton.kda_gate import kda_gate_log2

# BT: rows per chunk. 16 rows (as FlashKDA) move work from the intra kernel, whose cost per token grows with the chunk,
# to the state walk (more, smaller steps). H100 (bench/results/kda_kernels_k3_h100_2026-12-06b, c): 16 beats 64 on
# every shape, 1.3-1.9x with K3's gate, 1.24-1.27x with the softplus gate at 4k and 16k. 32 and 64 stay on request.
CHUNK = 16
CHUNKS = (16, 32, 64)
SUB = 16  # BC: rows per sub-block; pairs inside one are products of batched [16, 16] tiles
# With K3's bounded gate (>= lower_bound nats a step) a 16-row block spans at most 8 |lower_bound| log2(e) on each
# side of its middle row, so one product per matrix, factors 2^(G_i - G_mid) and 2^(G_mid - G_j), stays inside
# fp32's exponent range (2^+-126) where this bound holds: K3's -5 gives 2^+-58. Else the levels below.
REF_SPAN_LOG2 = tl.constexpr(100.0)
SLICE_BOUNDED, SLICE = 64, 32  # BKS: channels per slice of the intra kernel's loops (kda_prefill_stages says which)
# A lone sequence runs as T // PIECE_TOKENS pipelined token ranges (`kda_prefill`'s pieces), at most MAX_PIECES. When
# each range still cost a whole stages call on the host (~0.2-0.3 ms), ranges much below 4k tokens lost more than the
# overlap won (H100, K3's gate, ..._2026-12-06c: 16k 1.44 vs 1.54 ms in 4 ranges, 64k 5.40 vs 6.03 in 8, 8k a tie in
# 2; 8k in 4 ranges 1.40 ms). A range now costs two launches: shorter ones are worth timing.
PIECE_TOKENS = 4096
MAX_PIECES = 8


@triton.jit
def _ref_rows(b_G, BT: tl.constexpr, BKS: tl.constexpr, S: tl.constexpr):
    """G of the reference row r of each S-row block (the first row of its second half), on every row of the block."""
    NS: tl.constexpr = BT // S
    g3 = tl.reshape(b_G, [NS, S, BKS])
    g_ref = tl.sum(tl.where(tl.arange(0, S)[None, :, None] == S // 2, g3, 0.0), 1)  # [NS, BKS]
    return tl.reshape(tl.broadcast_to(g_ref[:, None, :], [NS, S, BKS]), [BT, BKS])


@triton.jit
def _ref_factor(b_G, BT: tl.constexpr, BKS: tl.constexpr, S: tl.constexpr):
    """Decay factors to the reference row r of each S-row block (the first row of its second half).

    Rows i of the second half get 2^(G_i - G_r) (i >= r), rows j of the first half 2^(G_r - G_j) (j < r): both
    exponents are <= 0, and for a pair (i, j) split by r their product is the exact decay 2^(G_i - G_j).
    """
    g_ref = _ref_rows(b_G, BT, BKS, S)
    second = ((tl.arange(0, BT) % S) >= S // 2)[:, None]
    return tl.exp2(tl.where(second, b_G - g_ref, g_ref - b_G)), second


@triton.jit
def _near_levels(b_q, b_k, b_G, diag_qk, d_qk, d_kk, BT: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr,
                 NEAR_LEVELS: tl.constexpr, PRECISION: tl.constexpr):
    """A slice's pairs inside each BC-block by levels of BC, BC/2, ..., 2 rows (batched [BC, BC] products, every
    factor <= 1), and the diagonal's q.k."""
    NB: tl.constexpr = BT // BC
    ri = tl.arange(0, BC)[None, :, None]
    cj = tl.arange(0, BC)[None, None, :]
    for lvl in tl.static_range(NEAR_LEVELS):
        e, second = _ref_factor(b_G, BT, BKS, BC >> lvl)
        k_f = tl.permute(tl.reshape(tl.where(second, 0.0, b_k * e), [NB, BC, BKS]), (0, 2, 1))
        same = (ri // (BC >> lvl)) == (cj // (BC >> lvl))
        q3 = tl.reshape(tl.where(second, b_q * e, 0.0), [NB, BC, BKS])
        k3 = tl.reshape(tl.where(second, b_k * e, 0.0), [NB, BC, BKS])
        d_qk += tl.where(same, tl.dot(q3, k_f, input_precision=PRECISION), 0.0)
        d_kk += tl.where(same, tl.dot(k3, k_f, input_precision=PRECISION), 0.0)
    return diag_qk + tl.sum(b_q * b_k, 1), d_qk, d_kk


@triton.jit
def _near_one_ref(b_q, b_k, b_G, g_mid, d_qk, d_kk, BT: tl.constexpr, BKS: tl.constexpr, BC: tl.constexpr,
                  PRECISION: tl.constexpr):
    """A slice's pairs inside each BC-block as one batched product per matrix around the block's middle row
    (factors 2^(G_i - G_mid), 2^(G_mid - G_j): the caller has bounded them). Every pair, the diagonal and those above
    it included: the caller keeps the causal ones."""
    NB: tl.constexpr = BT // BC
    e_row = tl.exp2(b_G - g_mid)
    k_f = tl.permute(tl.reshape(b_k * tl.exp2(g_mid - b_G), [NB, BC, BKS]), (0, 2, 1))
    d_qk += tl.dot(tl.reshape(b_q * e_row, [NB, BC, BKS]), k_f, input_precision=PRECISION)
    d_kk += tl.dot(tl.reshape(b_k * e_row, [NB, BC, BKS]), k_f, input_precision=PRECISION)
    return d_qk, d_kk


@triton.jit
def _block_diag(d, NB: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """[NB, BC, BC] blocks -> the [BT, BT] block-diagonal matrix holding them."""
    a = tl.arange(0, NB)[:, None, None, None]
    b = tl.arange(0, NB)[None, None, :, None]
    return tl.reshape(tl.where(a == b, d[:, :, None, :], 0.0), [BT, BT])


@triton.jit
def _slice_mask(m_t, o_c, N: tl.constexpr, BN: tl.constexpr):
    """Mask of a [BT, slice] tile whose columns o_c run over N channels padded to BN."""
    if N == BN:
        m = m_t[:, None]  # no mask along the contiguous dim, so the loads vectorise
    else:
        m = m_t[:, None] & (o_c < N)[None, :]
    return m


@triton.jit
def _load_qk(q, k, t0, i_h, o_t, o_ks, m_t, stride_q, stride_k, K: tl.constexpr, BK: tl.constexpr):
    """Raw q, k [BT, BKS] (fp32) of one channel slice and their mask."""
    m = _slice_mask(m_t, o_ks, K, BK)
    b_q = tl.load(q + t0 * stride_q + i_h * K + (o_t[:, None] * stride_q + o_ks[None, :]), mask=m,
                  other=0.0).to(tl.float32)
    b_k = tl.load(k + t0 * stride_k + i_h * K + (o_t[:, None] * stride_k + o_ks[None, :]), mask=m,
                  other=0.0).to(tl.float32)
    return b_q, b_k, m


@triton.jit
def _load_slice(q, k, f, dt_bias, t0, i_h, o_t, o_ks, m_t, stride_q, stride_k, stride_f, a, lower_bound,
                K: tl.constexpr, BK: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """Raw q, k [BT, BKS] (fp32) of one channel slice and its cumulative log2-decay G (rows past the end flat)."""
    m_ks = o_ks < K
    b_q, b_k, m = _load_qk(q, k, t0, i_h, o_t, o_ks, m_t, stride_q, stride_k, K, BK)
    b_f = tl.load(f + t0 * stride_f + i_h * K + (o_t[:, None] * stride_f + o_ks[None, :]), mask=m,
                  other=0.0).to(tl.float32)
    b_dt = tl.load(dt_bias + i_h * K + o_ks, mask=m_ks, other=0.0)
    # Padded rows and columns get g = 0, so G stays flat past the end and G[BT-1] is the last real row's.
    b_g = tl.where(m_t[:, None] & m_ks[None, :], kda_gate_log2(b_f, b_dt[None, :], a, lower_bound, USE_LOWER_BOUND),
                   0.0)
    return b_q, b_k, tl.cumsum(b_g, axis=0), m


@triton.jit
def _kda_chunk_intra_kernel(
    q, k, v, f, beta_logits, a_log, dt_bias, seg_starts, seg_ends, chunk_offsets,
    w, u, qg, kg, aqk, decay,
    stride_q, stride_k, stride_v, stride_f, stride_b,  # token strides; heads are contiguous rows of K (V)
    n_seqs, scale, lower_bound,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKS: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, FAR_LEVELS: tl.constexpr, NEAR_LEVELS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, PRECISION: tl.constexpr, REF_MODE: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    # The sequence owning global chunk i_c: chunk_offsets[n] <= i_c < chunk_offsets[n + 1] (binary search, so
    # the grid needs no host copy of the sequence lengths).
    lo = i_c * 0
    hi = lo + n_seqs
    for _step in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        end = tl.load(chunk_offsets + tl.minimum(mid, n_seqs - 1) + 1).to(tl.int32)
        right = i_c >= end
        active = lo < hi
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    if lo >= n_seqs:  # the grid is an upper bound on the number of chunks
        return
    bos = tl.load(seg_starts + lo).to(tl.int64)
    eos = tl.load(seg_ends + lo).to(tl.int64)
    t0 = bos + (i_c - tl.load(chunk_offsets + lo)).to(tl.int64) * BT  # int64 only in scalar bases

    NB: tl.constexpr = BT // BC
    o_t = tl.arange(0, BT)
    m_t = (t0 + o_t) < eos
    b_a = tl.exp(tl.load(a_log + i_h).to(tl.float32))
    b_beta = tl.where(m_t, tl.sigmoid(tl.load(beta_logits + t0 * stride_b + i_h + o_t * stride_b, mask=m_t,
                                              other=0.0).to(tl.float32)), 0.0)

    # Pass 1 over channel slices: every A entry is a sum over channels, and the L2 norms are row / column
    # scalings applied afterwards, so [BT, BKS] tiles suffice (register pressure).
    a_qk = tl.zeros([BT, BT], dtype=tl.float32)  # pairs in different BC-blocks
    a_kk = tl.zeros([BT, BT], dtype=tl.float32)
    d_qk = tl.zeros([NB, BC, BC], dtype=tl.float32)  # pairs inside a BC-block, one [BC, BC] tile per block
    d_kk = tl.zeros([NB, BC, BC], dtype=tl.float32)
    diag_qk = tl.zeros([BT], dtype=tl.float32)
    ssq_q = tl.zeros([BT], dtype=tl.float32)
    ssq_k = tl.zeros([BT], dtype=tl.float32)
    o_i = o_t[:, None]
    o_j = o_t[None, :]
    ri = tl.arange(0, BC)[None, :, None]
    cj = tl.arange(0, BC)[None, None, :]
    # Pass 0: the L2 norms, which need every channel, so that pass 1 can write each slice's outputs whole.
    for i_k in range(0, BK // BKS):
        b_q, b_k, _m = _load_qk(q, k, t0, i_h, o_t, i_k * BKS + tl.arange(0, BKS), m_t, stride_q, stride_k, K, BK)
        ssq_q += tl.sum(b_q * b_q, 1)
        ssq_k += tl.sum(b_k * b_k, 1)
    rq = scale / tl.sqrt(ssq_q + 1e-6)  # q's L2 norm and K^-0.5 in one row factor
    rk = 1.0 / tl.sqrt(ssq_k + 1e-6)
    base_k = (t0 * H + i_h) * K  # outputs are [T, H, K] (V, BT) contiguous
    for i_k in range(0, BK // BKS):
        o_ks = i_k * BKS + tl.arange(0, BKS)
        b_q, b_k, b_G, m = _load_slice(q, k, f, dt_bias, t0, i_h, o_t, o_ks, m_t, stride_q, stride_k, stride_f,
                                       b_a, lower_bound, K, BK, USE_LOWER_BOUND)
        # Everything that needs only this slice is written as it is read (from L2: pass 0 brought it in): q 2^G,
        # k 2^(G_last - G), 2^G_last, and beta k 2^G, which pass 2 turns into w in its place.
        b_eg = tl.exp2(b_G)
        b_glast = tl.sum(tl.where(o_t[:, None] == BT - 1, b_G, 0.0), 0)  # [BKS]
        off = base_k + (o_t[:, None] * (H * K) + o_ks[None, :])
        tl.store(qg + off, (b_q * rq[:, None] * b_eg).to(qg.dtype.element_ty), mask=m)
        tl.store(kg + off, (b_k * rk[:, None] * tl.exp2(b_glast[None, :] - b_G)).to(kg.dtype.element_ty), mask=m)
        tl.store(w + off, (b_k * (rk * b_beta)[:, None] * b_eg).to(w.dtype.element_ty), mask=m)
        tl.store(decay + (i_c * H + i_h) * K + o_ks, tl.exp2(b_glast), mask=o_ks < K)
        # Every pair i > j in different BC-blocks is split by exactly one far level: the smallest power-of-two
        # block holding both. Levels of BT and BT/2 rows: full [BT, BT] products, masked to same-block halves.
        for lvl in tl.static_range(FAR_LEVELS):
            e, second = _ref_factor(b_G, BT, BKS, BT >> lvl)
            k_f = tl.trans(tl.where(second, 0.0, b_k * e))
            same = (o_i // (BT >> lvl)) == (o_j // (BT >> lvl))
            a_qk += tl.where(same, tl.dot(tl.where(second, b_q * e, 0.0), k_f, input_precision=PRECISION), 0.0)
            a_kk += tl.where(same, tl.dot(tl.where(second, b_k * e, 0.0), k_f, input_precision=PRECISION), 0.0)
        # Pairs inside a BC-block: one product per matrix around each block's middle row where the gate's span
        # allows (REF_MODE 1: always; 2: this slice, checked), else levels of BC, BC/2, ..., 2 rows.
        if REF_MODE == 0:
            diag_qk, d_qk, d_kk = _near_levels(b_q, b_k, b_G, diag_qk, d_qk, d_kk, BT, BKS, BC, NEAR_LEVELS,
                                               PRECISION)
        else:
            g_mid = _ref_rows(b_G, BT, BKS, BC)
            if REF_MODE == 1:
                d_qk, d_kk = _near_one_ref(b_q, b_k, b_G, g_mid, d_qk, d_kk, BT, BKS, BC, PRECISION)
            elif tl.max(tl.max(tl.abs(b_G - g_mid), 1), 0) <= REF_SPAN_LOG2:
                d_qk, d_kk = _near_one_ref(b_q, b_k, b_G, g_mid, d_qk, d_kk, BT, BKS, BC, PRECISION)
            else:
                diag_qk, d_qk, d_kk = _near_levels(b_q, b_k, b_G, diag_qk, d_qk, d_kk, BT, BKS, BC, NEAR_LEVELS,
                                                   PRECISION)

    rk_col = rk[None, :]
    rk3 = tl.reshape(rk, [NB, BC])
    rkb3 = tl.reshape(rk * b_beta, [NB, BC])
    # One-reference products hold every pair of a block (the levels only pairs below its diagonal): keep the causal
    # ones. A pair above the diagonal grows as 2^(G_j - G_i) and may be inf or NaN there; the select drops it before
    # anything multiplies it. A_kk's own diagonal is the identity's.
    d_qk = tl.where(ri >= cj, d_qk, 0.0)
    d_kk = tl.where(ri > cj, d_kk, 0.0)
    a_qk = a_qk + _block_diag(d_qk, NB, BC, BT) + tl.where(o_i == o_j, diag_qk[:, None], 0.0)
    a_qk = a_qk * rq[:, None] * rk_col
    tl.store(aqk + (t0 * H + i_h) * BT + (o_t[:, None] * (H * BT) + o_t[None, :]), a_qk.to(aqk.dtype.element_ty),
             mask=m_t[:, None])
    d_kk = d_kk * rkb3[:, :, None] * rk3[:, None, :]  # beta_i k_i . k_j (strictly lower by construction)
    a_kk = a_kk * (rk * b_beta)[:, None] * rk_col

    # (I + A_kk)^-1 by block merges, 2 rows up to BT: with X block-diagonal holding the inverses of the halves,
    # the doubled block's inverse is X - X (A21 X), A21 its lower-left quadrant. Only bounded blocks multiply,
    # unlike a Neumann series, so it stays accurate when (I + A) is badly conditioned (e.g. repeated keys).
    x3 = tl.where(ri == cj, 1.0, 0.0) + tl.zeros([NB, BC, BC], dtype=tl.float32)
    for lvl in tl.static_range(NEAR_LEVELS):
        span = 2 << lvl
        quad = ((ri // span) == (cj // span)) & ((ri % span) >= span // 2) & ((cj % span) < span // 2)
        x3 = x3 - tl.dot(x3, tl.dot(tl.where(quad, d_kk, 0.0), x3, input_precision=PRECISION),
                         input_precision=PRECISION)
    b_x = _block_diag(x3, NB, BC, BT)
    for lvl in tl.static_range(FAR_LEVELS):
        span = BC * (2 << lvl)
        quad = ((o_i // span) == (o_j // span)) & ((o_i % span) >= span // 2) & ((o_j % span) < span // 2)
        b_x = b_x - tl.dot(b_x, tl.dot(tl.where(quad, a_kk, 0.0), b_x, input_precision=PRECISION),
                           input_precision=PRECISION)

    # Pass 2 over channel slices: w from the beta k 2^G pass 1 left in its place (the barrier makes every thread's
    # stores visible to the others), then u.
    tl.debug_barrier()
    for i_k in range(0, BK // BKS):
        o_ks = i_k * BKS + tl.arange(0, BKS)
        m = _slice_mask(m_t, o_ks, K, BK)
        off = base_k + (o_t[:, None] * (H * K) + o_ks[None, :])
        b_w = tl.dot(b_x, tl.load(w + off, mask=m, other=0.0).to(tl.float32), input_precision=PRECISION)
        tl.store(w + off, b_w.to(w.dtype.element_ty), mask=m)
    for i_v in range(0, BV // BKS):
        o_vs = i_v * BKS + tl.arange(0, BKS)
        m_v = _slice_mask(m_t, o_vs, V, BV)
        b_v = tl.load(v + t0 * stride_v + i_h * V + (o_t[:, None] * stride_v + o_vs[None, :]), mask=m_v,
                      other=0.0).to(tl.float32)
        tl.store(u + (t0 * H + i_h) * V + (o_t[:, None] * (H * V) + o_vs[None, :]),
                 tl.dot(b_x, b_v * b_beta[:, None], input_precision=PRECISION).to(u.dtype.element_ty), mask=m_v)


@triton.jit
def _kda_chunk_state_kernel(
    w, u, qg, kg, aqk, decay, o, state, slots, seg_starts, seg_ends, chunk_offsets, sequence_segments,
    segment_slots,
    stride_s_slot, stride_s_h, stride_s_k,
    H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, SEGMENTED: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_n = i_bh // H
    i_h = i_bh % H
    slot = tl.load(slots + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    if K == BK and V % BV == 0:
        m_s = o_k[:, None] < BK
    else:
        m_s = m_k[:, None] & (o_v < V)[None, :]
    p_s = state + slot * stride_s_slot + i_h * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] fp32
    # Products in the intermediates' dtype (bf16 on the tensor cores, as fla). Triton's CPU interpreter
    # multiplies bf16 dot operands wrongly, so under it they are widened to fp32 (DOT_FP32).
    dt: tl.constexpr = tl.float32 if DOT_FP32 else w.dtype.element_ty
    o_t = tl.arange(0, BT)
    # int32 offsets inside a chunk, loop-invariant; the int64 part is the scalar chunk base.
    off_tk = o_t[:, None] * (H * K) + o_k[None, :]  # [BT, BK]
    off_kt = o_k[:, None] + o_t[None, :] * (H * K)  # [BK, BT]
    off_tv = o_t[:, None] * (H * V) + o_v[None, :]
    off_tt = o_t[:, None] * (H * BT) + o_t[None, :]
    # The sequence's segments (rows [seg_starts[g], seg_ends[g]): the sequence, cut at its snapshot points if any, or
    # its part of one pipelined range) in order, the state carried from one to the next and written after each to
    # its segment's slot: the last segment's is the sequence's own.
    # Without snapshot points sequence b is segment b (no index tensor to build per call).
    if SEGMENTED:
        g_first = tl.load(sequence_segments + i_n)
        g_end = tl.load(sequence_segments + i_n + 1)
    else:
        g_first = i_n
        g_end = i_n + 1
    for i_g in range(g_first, g_end):
        bos = tl.load(seg_starts + i_g).to(tl.int64)
        seq_len = (tl.load(seg_ends + i_g) - bos).to(tl.int32)
        c0 = tl.load(chunk_offsets + i_g).to(tl.int64)
        for i_t in range(0, tl.cdiv(seq_len, BT)):
            row0 = bos + i_t * BT
            m_t = (i_t * BT + o_t) < seq_len
            if K == BK:
                m_tk = m_t[:, None]
                m_kt = m_t[None, :]
            else:
                m_tk = m_t[:, None] & m_k[None, :]
                m_kt = m_k[:, None] & m_t[None, :]
            if V % BV == 0:
                m_tv = m_t[:, None]
            else:
                m_tv = m_t[:, None] & (o_v < V)[None, :]
            base_k = (row0 * H + i_h) * K
            base_v = (row0 * H + i_h) * V
            b_w = tl.load(w + base_k + off_tk, mask=m_tk, other=0.0)
            b_qg = tl.load(qg + base_k + off_tk, mask=m_tk, other=0.0)
            b_kgt = tl.load(kg + base_k + off_kt, mask=m_kt, other=0.0)  # [BK, BT]
            b_u = tl.load(u + base_v + off_tv, mask=m_tv, other=0.0)
            b_a = tl.load(aqk + (row0 * H + i_h) * BT + off_tt, mask=m_t[:, None], other=0.0)
            b_d = tl.load(decay + ((c0 + i_t) * H + i_h) * K + o_k, mask=m_k, other=0.0)

            b_sb = b_s.to(dt)
            b_vn = (b_u.to(tl.float32) - tl.dot(b_w.to(dt), b_sb, input_precision=PRECISION)).to(dt)  # [BT, BV]
            b_o = (tl.dot(b_qg.to(dt), b_sb, input_precision=PRECISION)
                   + tl.dot(b_a.to(dt), b_vn, input_precision=PRECISION))
            tl.store(o + base_v + off_tv, b_o.to(o.dtype.element_ty), mask=m_tv)
            b_s = b_s * b_d[:, None] + tl.dot(b_kgt.to(dt), b_vn, input_precision=PRECISION)

        p_out = state + tl.load(segment_slots + i_g).to(tl.int64) * stride_s_slot + i_h * stride_s_h
        tl.store(p_out + o_k[:, None] * stride_s_k + o_v[None, :], b_s, mask=m_s)


def _check_inputs(op, q, k, v, f, beta_logits, a_log, dt_bias, state_pool, slots, cu_seqlens):
    t, heads, dk = q.shape
    dv = v.shape[-1]
    for name, x, shape in (("q", q, (t, heads, dk)), ("k", k, (t, heads, dk)), ("v", v, (t, heads, dv)),
                           ("f", f, (t, heads, dk))):
        check(op, name, x, dims=3)
        if tuple(x.shape) != shape or (x.shape[1] > 1 and x.stride(1) != x.shape[2]):
            raise TritonKernelError(f"{op}: {name} {tuple(x.shape)} strides {x.stride()} must be {shape} with "
                                    "contiguous heads")
    check(op, "beta_logits", beta_logits, dims=2)
    if tuple(beta_logits.shape) != (t, heads):
        raise TritonKernelError(f"{op}: beta_logits {tuple(beta_logits.shape)} must be [{t}, {heads}]")
    check(op, "state_pool", state_pool, dtypes=(torch.float32,), dims=4)
    check(op, "a_log", a_log, dtypes=(torch.float32,), dims=1)
    check(op, "dt_bias", dt_bias, dtypes=(torch.float32,), dims=1)
    if tuple(state_pool.shape[1:]) != (heads, dk, dv) or a_log.shape[0] < heads or dt_bias.shape[0] != heads * dk:
        raise TritonKernelError(f"{op}: state_pool {tuple(state_pool.shape)}, a_log {tuple(a_log.shape)}, dt_bias "
                                f"{tuple(dt_bias.shape)} do not match H={heads} K={dk} V={dv}")
    if dk > 256 or dv > 256:
        raise TritonKernelError(f"{op}: head dims K={dk} V={dv} above 256 are not supported (register tiles)")
    check_index(op, "slots", slots, slots.shape[0])
    check_index(op, "cu_seqlens", cu_seqlens, slots.shape[0] + 1)


def kda_prefill_stages(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens,
                       snapshots: StateSnapshots | None = None, **layout):
    """Validate, allocate, and return (o, intra launch, state launch) so a benchmark can time each stage. `layout`:
    `_stages`' keyword arguments.

    Defaults (bench/results/kda_kernels_k3_h100_2026-12-06*.json, one H100, against FlashKDA and fla):
    - chunk: CHUNK (16), both gates.
    - intra_warps: 1 for 16-row chunks (K3's gate, 8k: 0.33 vs 0.41 ms at 2 warps, 0.57 at 4; the same ratio on
      every FlashKDA shape), 4 for longer (2.25 vs 3.08 ms at 8, H200).
    - intra_slice: 64 channels for 16-row chunks with one-reference block products (a bounded gate such as K3's:
      0.29 vs 0.33 ms at 8 x 1k, 1.14 vs 1.26 at 8 x 4k, 2.25 vs 2.47 at 64k; kda_kernels_k3_h100_2026-12-06d), else
      32: the levels' block products and longer chunks hold more registers, and 64 spills there at sm_90.
    - block_v, state_warps: for 16-row chunks with at least 4 programs of 32 columns per SM (8 packed sequences at
      32 heads), 32 columns in one warp (8 x 1k: walk 0.17 vs 0.18 ms, whole 0.476 vs 0.489 ms; 8 x 4k: 0.62 vs
      0.67, 1.758 vs 1.805; FlashKDA 0.489 and 1.789 in the same run, kda_kernels_k3_h100_2026-12-07b); else 64 in
      4 warps when that still gives every SM a (sequence, head, V-block) program (8 x 1k: 0.19 vs 0.27 ms), else
      32 in 4 (one 16k sequence: 0.85 vs 0.89 ms).
    - pieces: packed sequences in one (8 x 1k: 0.49 ms in one, 0.57 in 2, 0.65 in 4; 8 x 4k: 1.80, 1.89, 2.08;
      their walks already hold every SM, so a range's launches and its walk's state loads cost more than the
      overlap wins).
    """
    o, intra, state, _, _ = _stages(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots,
                                    cu_seqlens, snapshots, **layout)
    return o, intra, state


def _stages(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens, snapshots,
            block_v: int | None = None, state_warps: int | None = None, state_stages: int | None = None,
            intra_warps: int | None = None, intra_slice: int | None = None, intra_stages: int = 3,
            block_ref: bool = True, chunk: int | None = None, decay_rows: int | None = None):
    """kda_prefill_stages with launches that take other segments (starts, ends) and chunk offsets (token ranges of
    the same call: rows are absolute, chunks count from the decay buffer passed), the chunk size it chose and its
    decay buffer (`decay_rows` rows of chunks when given: the pipelined ranges' blocks)."""
    op = "kda_prefill"
    _check_inputs(op, q, k, v, f, beta_logits, a_log, dt_bias, state_pool, slots, cu_seqlens)
    chunk = chunk or CHUNK
    if intra_warps is None:
        intra_warps = 1 if chunk == SUB else 4
    if chunk not in CHUNKS:
        raise TritonKernelError(f"{op}: chunk {chunk} is not one of {CHUNKS}")
    t, heads, dk = q.shape
    dv = v.shape[-1]
    n = slots.shape[0]
    o = torch.empty(t, heads, dv, dtype=v.dtype, device=v.device)
    if t == 0 or n == 0:
        return o, lambda *_: None, lambda *_: None, chunk, None
    # Both kernels see segments: the sequences, or with snapshots the sequences cut at their points (the intra
    # kernel's chunks restart at a point; the state kernel carries a sequence's state across its segments).
    if snapshots is None:
        segments, segment_slots, sequence_segments = cu_seqlens, slots, cu_seqlens  # the last: unread
    else:
        segments, segment_slots = snapshots.cu_segments, snapshots.segment_slots
        sequence_segments = snapshots.sequence_segments
        check_index(op, "snapshots.cu_segments", segments, segment_slots.shape[0] + 1)
        check_index(op, "snapshots.sequence_segments", sequence_segments, n + 1)
    num_segments = segments.shape[0] - 1
    # Chunk offsets of each segment, on the device: no host sync, so the call can be graph-captured.
    lens = segments[1:] - segments[:-1]
    chunk_offsets = torch.zeros(num_segments + 1, dtype=torch.int64, device=q.device)
    torch.cumsum((lens + chunk - 1) // chunk, 0, out=chunk_offsets[1:])
    max_chunks = t // chunk + num_segments  # sum of ceil(len / chunk) <= floor(T / chunk) + segments
    inter = v.dtype if v.dtype in (torch.bfloat16, torch.float16) else torch.float32
    w = torch.empty(t, heads, dk, dtype=inter, device=q.device)
    qg = torch.empty_like(w)
    kg = torch.empty_like(w)
    u = torch.empty(t, heads, dv, dtype=inter, device=q.device)
    aqk = torch.empty(t, heads, chunk, dtype=inter, device=q.device)
    decay = torch.empty(decay_rows or max_chunks, heads, dk, dtype=torch.float32, device=q.device)
    bk, bvp = pow2_at_least(dk, 16), pow2_at_least(dv, 16)
    lb = float(lower_bound) if lower_bound is not None else 0.0
    # Pairs inside a 16-row block: one-reference products always (a bounded gate within REF_SPAN_LOG2: 1) or in
    # each channel slice whose span allows it (2); `block_ref=False`: the levels only (0).
    if not block_ref:
        ref_mode = 0
    elif lower_bound is not None and -lb * math.log2(math.e) * (SUB // 2) <= REF_SPAN_LOG2.value:
        ref_mode = 1
    else:
        ref_mode = 2
    slice_k = intra_slice or (SLICE_BOUNDED if ref_mode == 1 and chunk == SUB else SLICE)
    sms = sm_count(q.device)
    if chunk == SUB and n * heads * triton.cdiv(dv, 32) >= 4 * sms:  # many walks: one warp each, 32 columns
        bv, state_warps = block_v or 32, state_warps or 1
    else:
        bv = block_v or min(bvp, 64 if chunk == SUB and n * heads * triton.cdiv(dv, 64) >= sms else 32)
        state_warps = state_warps or 4

    def intra(starts=segments[:-1], ends=segments[1:], chunk_offsets=chunk_offsets, decay=decay,
              grid_chunks=max_chunks):
        num_segments = starts.shape[0]
        _kda_chunk_intra_kernel[(grid_chunks, heads)](
            q, k, v, f, beta_logits, a_log, dt_bias, starts, ends, chunk_offsets,
            w, u, qg, kg, aqk, decay,
            q.stride(0), k.stride(0), v.stride(0), f.stride(0), beta_logits.stride(0),
            num_segments, dk**-0.5, lb,
            H=heads, K=dk, V=dv, BK=bk, BV=bvp, BKS=min(bk, bvp, slice_k), BT=chunk, BC=SUB,
            FAR_LEVELS=int(math.log2(chunk // SUB)), NEAR_LEVELS=int(math.log2(SUB)),
            SEARCH_STEPS=max(1, math.ceil(math.log2(num_segments + 1)) + 1), USE_LOWER_BOUND=lower_bound is not None,
            PRECISION=dot_precision(v.dtype), REF_MODE=ref_mode, num_warps=intra_warps, num_stages=intra_stages,
        )

    def state(starts=segments[:-1], ends=segments[1:], chunk_offsets=chunk_offsets, decay=decay):
        _kda_chunk_state_kernel[(triton.cdiv(dv, bv), n * heads)](
            w, u, qg, kg, aqk, decay, o, state_pool, slots, starts, ends, chunk_offsets, sequence_segments,
            segment_slots,
            state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
            H=heads, K=dk, V=dv, BK=bk, BV=bv, BT=chunk, DOT_FP32=interpreting(),
            PRECISION=dot_precision(v.dtype), SEGMENTED=snapshots is not None,
            # 3 stages of bf16 tiles fit in shared memory (fastest on the H200); fp32 tiles only fit 1
            num_warps=state_warps, num_stages=state_stages or (3 if inter != torch.float32 else 1),
        )

    return o, intra, state, chunk, decay


def kda_prefill(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots, cu_seqlens,
                snapshots: StateSnapshots | None = None, pieces: int | None = None, **layout) -> torch.Tensor:
    """Same contract as `ops.kda.eager.kda_prefill`; returns o [T, H, V] in v's dtype.

    `pieces` > 1 (default for a lone sequence: one per PIECE_TOKENS, at most MAX_PIECES; for packed ones 1, which
    timed faster: kda_prefill_stages) cuts the pass into that many token ranges and pipelines them: the state walk
    of one range runs on a high-priority side stream while the intra kernel of the next fills the SMs the walk
    leaves idle (it holds one program per sequence, head and V-block). A range holds each
    sequence's part between two global token edges, both moved up to the sequence's own chunk grid, so every
    sequence is chunked as in one piece; each part's walk starts from the state the previous range left in the
    slot, so the result is bit for bit the one-piece result. Validation, buffers and every range's bounds are set up
    once for the call, on the device. Passes with snapshot points run as one piece.
    """
    t = q.shape[0]
    if pieces is None:
        pieces = min(MAX_PIECES, max(1, t // PIECE_TOKENS)) if slots.shape[0] == 1 else 1
    if pieces < 1:
        raise TritonKernelError(f"kda_prefill: pieces {pieces} must be at least 1")
    chunk = layout.get("chunk") or CHUNK  # _stages refuses one not in CHUNKS
    length = triton.cdiv(triton.cdiv(t, pieces), chunk) * chunk
    piped = pieces > 1 and snapshots is None and length < t
    grid = length // chunk + 1 + slots.shape[0]  # a range's chunks at most (_ranges)
    rows = triton.cdiv(t, length) * grid if piped else None
    o, intra, state, chunk, decay = _stages(q, k, v, f, beta_logits, a_log, dt_bias, lower_bound, state_pool, slots,
                                            cu_seqlens, snapshots, decay_rows=rows, **layout)
    if not piped:
        intra()
        state()
        return o
    launches = []
    for starts, ends, chunk_offsets, block, grid in _ranges(cu_seqlens, t, length, chunk, decay, grid):
        launches.append((functools.partial(intra, starts, ends, chunk_offsets, block, grid),
                         functools.partial(state, starts, ends, chunk_offsets, block)))
    _run_pipelined(launches, q.device)
    return o


def _ranges(cu_seqlens: torch.Tensor, t: int, length: int, chunk: int, decay: torch.Tensor,
            grid: int) -> list[tuple]:
    """(starts, ends, chunk offsets, decay rows, grid of chunks) of each token range [r * length, (r + 1) *
    length), built on the device: sequence s's part is cut at the first point of its own chunk grid at or past each
    edge. Only the sequence holding an edge crosses it, by less than a chunk, so a range holds at most `grid` =
    length / chunk + 1 + (sequences) chunks: range r's decay rows are block r of that size in `decay`."""
    ranges = triton.cdiv(t, length)
    seq_starts, seq_ends = cu_seqlens[:-1], cu_seqlens[1:]
    edges = torch.arange(ranges + 1, device=cu_seqlens.device, dtype=cu_seqlens.dtype)[:, None] * length
    past = (edges - seq_starts).clamp_(min=0)
    cuts = torch.minimum(seq_starts + (past + chunk - 1) // chunk * chunk, seq_ends)  # [ranges + 1, n]
    offsets = torch.zeros(ranges, cuts.shape[1] + 1, dtype=torch.int64, device=cu_seqlens.device)
    torch.cumsum((cuts[1:] - cuts[:-1] + chunk - 1) // chunk, 1, out=offsets[:, 1:])
    return [(cuts[r], cuts[r + 1], offsets[r], decay[r * grid:(r + 1) * grid], grid) for r in range(ranges)]


_WALK_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _run_pipelined(launches: list, device: torch.device) -> None:
    """Intra kernels in order on the current stream, each range's walk after its own intra kernel and the previous
    walk on the side stream; the current stream waits for the last walk. The launches keep every buffer referenced
    until then, so none is reused while the side stream still reads it."""
    if device.type != "cuda":
        for intra, state in launches:
            intra()
            state()
        return
    main = torch.cuda.current_stream(device)
    if device not in _WALK_STREAMS:
        _WALK_STREAMS[device] = torch.cuda.Stream(device, priority=-100)  # clamped to the highest the GPU has
    side = _WALK_STREAMS[device]
    side.wait_stream(main)
    for intra, state in launches:
        intra()
        side.wait_event(main.record_event())
        with torch.cuda.stream(side):
            state()
    main.wait_stream(side)


# No host sync; buffers and grids sized from shapes only. Snapshot layouts are built by the runner before the pass
# (ops/kda/snapshots.py), and passes with points are never captured (engine/prefill_graphs.py).
kda_prefill.graph_safe = True
