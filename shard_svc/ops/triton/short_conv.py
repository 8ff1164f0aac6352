"""Causal depthwise short convolution + SiLU over packed variable-length sequences, with the conv-state pool.

Reference: `shard_svc/ops/conv.py::short_conv`. out[t, c] = SiLU(sum_w weight[c, w] * x[t - (W-1) + w, c]) where
positions before a sequence's first new token come from its pool slot (the last W-1 inputs, oldest first); the
slot then holds the last W-1 inputs of (old state ++ new tokens). Products and sums in fp32, tap by tap; a state
value is cast to x's dtype first, as the eager path concatenates it to x before upcasting.

Prefill: `_conv_fwd_kernel` reads the *old* state, then `_conv_state_kernel` writes the new one; two launches because
the program that reads a sequence's first tokens is not the one that reads its last. A prefill program owns a channel
block (4 contiguous channels per thread) and a span of token tiles; it loads the weights once, keeps the next tile's
rows in flight while it computes the current one, and per tile decides with two scalar comparisons whether the tile
and its W-1 halo rows lie inside one sequence. Such a tile (nearly all of a long prefill) uses each loaded row for
all its taps, with no masks along tokens (none at all when C is a multiple of the block) and no state reads; a tile
at a sequence start or boundary goes token by token, reading the state where a tap falls before the sequence.
Decode (T == B): `_conv_seq_kernel`, one program per (sequence, channel block) reads then writes its own slot in
one launch; it is correct for any lengths, just serial per sequence.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, check_index, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue


@triton.jit
def _load_c(p, m_c, EVEN_C: tl.constexpr):
    """A [BC] channel vector; unmasked when C is a multiple of BC, so it compiles to plain vector loads."""
    if EVEN_C:
        return tl.load(p)
    else:
        return tl.load(p, mask=m_c, other=0.0)


@triton.jit
def _store_c(p, value, m_c, EVEN_C: tl.constexpr):
    if EVEN_C:
        tl.store(p, value)
    else:
        tl.store(p, value, mask=m_c)


@triton.jit
def _tile_rows(x, t0, T, stride_x, o_c, m_c, W: tl.constexpr, BT: tl.constexpr, EVEN_C: tl.constexpr):
    """Rows t0-(W-1) .. t0+BT-1 of x (clamped into [0, T): rows outside are loaded but never used)."""
    rows = ()
    for r in tl.static_range(BT + W - 1):
        row = tl.minimum(tl.maximum(t0 + (r - (W - 1)), 0), T - 1)
        rows = rows + (_load_c(x + tl.cast(row, tl.int64) * stride_x + o_c, m_c, EVEN_C),)
    return rows


@triton.jit(do_not_specialize=["T", "n_seqs", "span"])  # sizes of the pass: one compiled variant for all
def _conv_fwd_kernel(
    x, weight, conv_state, slots, cu_seqlens, out,
    T, C, n_seqs, span, stride_x, stride_o, stride_s_slot, stride_s_c,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SEARCH_STEPS: tl.constexpr, EVEN_C: tl.constexpr,
):
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    ws = ()
    for i_w in tl.static_range(W):
        ws = ws + (_load_c(weight + o_c * W + i_w, m_c, EVEN_C).to(tl.float32),)

    t_start = tl.program_id(0) * span
    t_end = tl.minimum(t_start + span, T)
    # Software pipelining by hand: the next tile's rows are requested before this tile is computed (the compiler
    # otherwise spreads a tile's loads between its arithmetic, a memory round trip each).
    nxt = _tile_rows(x, t_start, T, stride_x, o_c, m_c, W, BT, EVEN_C)
    # Sequence of this program's first token (the n with cu_seqlens[n] <= t < cu_seqlens[n + 1]); later tiles only
    # move forward from it.
    lo = 0
    hi = n_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = tl.load(cu_seqlens + tl.minimum(mid, n_seqs - 1) + 1).to(tl.int32) <= t_start
        active = lo < hi
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    seq = tl.minimum(lo, n_seqs - 1)
    bos = tl.load(cu_seqlens + seq).to(tl.int32)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int32)

    for t0 in range(t_start, t_end, BT):
        cur = nxt
        if t0 + BT < t_end:  # the program's last tile prefetches nothing
            nxt = _tile_rows(x, t0 + BT, T, stride_x, o_c, m_c, W, BT, EVEN_C)
        while (eos <= t0) & (seq < n_seqs - 1):
            seq += 1
            bos = eos
            eos = tl.load(cu_seqlens + seq + 1).to(tl.int32)
        if (t0 - (W - 1) >= bos) & (t0 + BT <= eos):
            # The tile and its W-1 halo rows lie inside one sequence: no state, no masks along tokens.
            p_o = out + tl.cast(t0, tl.int64) * stride_o + o_c
            for r in tl.static_range(BT):
                acc = tl.zeros([BC], dtype=tl.float32)
                for i_w in tl.static_range(W):
                    acc += cur[r + i_w].to(tl.float32) * ws[i_w]
                _store_c(p_o + r * stride_o, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), m_c, EVEN_C)
        else:
            # A sequence starts (or the packed batch ends) within reach of this tile: token by token, with the
            # state for taps before the token's sequence. Tokens past cu_seqlens[-1] count as the last sequence's.
            for t in range(t0, tl.minimum(t0 + BT, T)):
                while (eos <= t) & (seq < n_seqs - 1):
                    seq += 1
                    bos = eos
                    eos = tl.load(cu_seqlens + seq + 1).to(tl.int32)
                p_s = conv_state + tl.load(slots + seq).to(tl.int64) * stride_s_slot + o_c * stride_s_c
                acc = tl.zeros([BC], dtype=tl.float32)
                for i_w in tl.static_range(W):
                    pos = t - (W - 1) + i_w
                    if pos >= bos:
                        b_val = tl.load(x + tl.cast(pos, tl.int64) * stride_x + o_c, mask=m_c, other=0.0)
                    else:
                        b_val = tl.load(p_s + (pos - bos + W - 1), mask=m_c, other=0.0).to(x.dtype.element_ty)
                    acc += b_val.to(tl.float32) * ws[i_w]
                tl.store(out + tl.cast(t, tl.int64) * stride_o + o_c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty),
                         mask=m_c)


@triton.jit
def _conv_new_state(x, conv_state, bos, eos, slot, o_c, m_c, stride_x, stride_s_slot, stride_s_c,
                    W: tl.constexpr, WP: tl.constexpr):
    """The last W-1 inputs of (old state ++ x[bos:eos]) for channels o_c, as a [BC, WP] tile (not yet stored)."""
    o_w = tl.arange(0, WP)
    pos = eos - (W - 1) + o_w
    from_x = (pos >= bos)[None, :]
    m = m_c[:, None] & (o_w < W - 1)[None, :]
    b_x = tl.load(x + pos[None, :] * stride_x + o_c[:, None], mask=m & from_x, other=0.0)
    b_s = tl.load(conv_state + slot * stride_s_slot + o_c[:, None] * stride_s_c + (pos - bos + W - 1)[None, :],
                  mask=m & (from_x == 0), other=0.0)
    return tl.where(from_x, b_x, b_s.to(x.dtype.element_ty)).to(conv_state.dtype.element_ty), m


@triton.jit
def _conv_state_kernel(
    x, conv_state, slots, cu_seqlens, C, stride_x, stride_s_slot, stride_s_c,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    slot = tl.load(slots + i_n).to(tl.int64)
    new, m = _conv_new_state(x, conv_state, bos, eos, slot, o_c, m_c, stride_x, stride_s_slot, stride_s_c, W, WP)
    o_w = tl.arange(0, WP)
    tl.store(conv_state + slot * stride_s_slot + o_c[:, None] * stride_s_c + o_w[None, :], new, mask=m)


@triton.jit
def _conv_seq_kernel(
    x, weight, conv_state, slots, cu_seqlens, out, C, stride_x, stride_o, stride_s_slot, stride_s_c,
    W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, EVEN_C: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    i_n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    if EVEN_C:  # no mask along the contiguous channels: vector loads
        m_c = o_c < (tl.program_id(1) + 1) * BC
    else:
        m_c = o_c < C
    bos = tl.load(cu_seqlens + i_n)
    eos = tl.load(cu_seqlens + i_n + 1)
    slot = tl.load(slots + i_n).to(tl.int64)
    p_s = conv_state + slot * stride_s_slot + o_c * stride_s_c
    for t in range(bos, eos):
        acc = tl.zeros([BC], dtype=tl.float32)
        for i_w in tl.static_range(W):
            # a [BC] vector rather than a scalar: the interpreter rejects scalar-derived load masks
            pos = tl.zeros([BC], dtype=tl.int64) + (t - (W - 1) + i_w)
            from_x = pos >= bos
            b_x = tl.load(x + pos * stride_x + o_c, mask=m_c & from_x, other=0.0)
            b_s = tl.load(p_s + (pos - bos + W - 1), mask=m_c & (from_x == 0), other=0.0)
            b_val = tl.where(from_x, b_x, b_s.to(x.dtype.element_ty)).to(tl.float32)
            acc += b_val * tl.load(weight + o_c * W + i_w, mask=m_c, other=0.0).to(tl.float32)
        tl.store(out + t * stride_o + o_c, (acc * tl.sigmoid(acc)).to(out.dtype.element_ty), mask=m_c)
    # All reads of the old state above come before this program's store to its own slot.
    new, m = _conv_new_state(x, conv_state, bos, eos, slot, o_c, m_c, stride_x, stride_s_slot, stride_s_c, W, WP)
    tl.store(p_s[:, None] + tl.arange(0, WP)[None, :], new, mask=m)


def search_steps(n_seqs: int) -> int:
    """Binary-search steps that find any of n_seqs sequences, rounded up to 4, 8, 16 or 32 (extra steps change
    nothing): a constexpr of few values, so passes of 1-7 sequences share one compiled kernel, 8-127 another."""
    need = math.ceil(math.log2(n_seqs + 1)) + 1
    return next(s for s in (4, 8, 16, 32) if s >= need)


def _prefill_warps(c: int) -> int:
    """4 warps (512 channels), fewer when C would leave most of the block masked."""
    warps = 4
    while warps > 1 and 4 * 32 * warps // 2 >= c:
        warps //= 2
    return warps


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor, *, block_t: int | None = None, tiles_per_program: int | None = None,
               num_warps: int | None = None) -> torch.Tensor:
    """Same contract as `ops.conv.short_conv`: x [T, C], weight [C, W], conv_state [slots, C, W-1] (in place).

    The keyword arguments override the prefill tiling (benchmarks and tests): tokens per tile, tiles per program,
    warps per program (the channel block is 4 channels x 32 lanes x warps)."""
    op = "short_conv"
    check(op, "x", x, dims=2)
    check(op, "weight", weight, dims=2)
    check(op, "conv_state", conv_state, dims=3)
    t, c = x.shape
    width = weight.shape[1]
    n = slots.shape[0]
    check_index(op, "slots", slots, n)
    check_index(op, "cu_seqlens", cu_seqlens, n + 1)
    if weight.shape[0] != c or not weight.is_contiguous() or width < 2:
        raise TritonKernelError(f"{op}: weight {tuple(weight.shape)} must be contiguous [C={c}, W>=2]")
    if tuple(conv_state.shape[1:]) != (c, width - 1):
        raise TritonKernelError(f"{op}: conv_state {tuple(conv_state.shape)} must be [slots, {c}, {width - 1}]")
    out = torch.empty_like(x)
    if t == 0 or n == 0:
        return out
    wp = pow2_at_least(width - 1)
    strides = (x.stride(0), conv_state.stride(0), conv_state.stride(1))
    if t == n:  # decode: one program per (sequence, channel block) reads then writes its own slot
        bc = 256
        _conv_seq_kernel[(n, triton.cdiv(c, bc))](
            x, weight, conv_state, slots, cu_seqlens, out, c, strides[0], out.stride(0), strides[1], strides[2],
            W=width, WP=wp, BC=bc, EVEN_C=c % bc == 0, num_warps=4, **pdl_args(x.device))
        return out
    warps = _prefill_warps(c) if num_warps is None else num_warps
    # 8 tokens: a thread holds 2 x (8 + W-1) rows of 4 channels (this tile's and the next), ~128 registers in bf16
    # (4 programs of 4 warps per SM, ~45 KB of loads in flight); 16 tokens need ~255 and halve the programs per SM.
    bt = 8 if block_t is None else block_t
    if bt < 1 or warps not in (1, 2, 4, 8, 16) or (tiles_per_program is not None and tiles_per_program < 1):
        raise TritonKernelError(f"{op}: block_t {block_t}, tiles_per_program {tiles_per_program}, num_warps "
                                f"{num_warps} (block_t and tiles_per_program >= 1, num_warps a power of two <= 16)")
    bc = 4 * 32 * warps
    n_cb = triton.cdiv(c, bc)
    # Several tiles per program amortise the weight loads, the sequence search and the first tile's exposed load;
    # about 3072 programs or more (~6 waves of 4 x 4-warp programs per SM on 132 SMs) keep the idle tail small.
    nb = tiles_per_program if tiles_per_program is not None else max(1, min(8, triton.cdiv(t, bt) * n_cb // 3072))
    _conv_fwd_kernel[(triton.cdiv(t, bt * nb), n_cb)](
        x, weight, conv_state, slots, cu_seqlens, out, t, c, n, bt * nb, strides[0], out.stride(0), strides[1],
        strides[2], W=width, BT=bt, BC=bc, SEARCH_STEPS=search_steps(n),
        EVEN_C=c % bc == 0, num_warps=warps)
    bc = 128
    _conv_state_kernel[(n, triton.cdiv(c, bc))](
        x, conv_state, slots, cu_seqlens, c, strides[0], strides[1], strides[2], W=width, WP=wp, BC=bc,
        num_warps=4)
    return out
