"""Causal depthwise short convolution + SiLU over packed variable-length sequences, with the conv-state pool.

Reference: `shard_svc/ops/conv.py::short_conv`. out[t, c] = SiLU(sum_w weight[c, w] * x[t - (W-1) + w, c]) where
positions before a sequence's first new token come from its pool slot (the last W-1 inputs, oldest first); the
slot then holds the last W-1 inputs of (old state ++ new tokens).

Prefill: `_conv_fwd_kernel` over (token block, channel block) reads the *old* state, then `_conv_state_kernel`
writes the new one; two launches because a token block at a sequence's end would otherwise overwrite the state
that a block at its start still has to read. Decode (T == B): `_conv_seq_kernel`, one program per (sequence,
channel block) reads then writes its own slot in one launch; it is correct for any lengths, just serial per sequence.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, check_index, pow2_at_least


@triton.jit
def _conv_fwd_kernel(
    x, weight, conv_state, slots, cu_seqlens, out,
    T, C, n_seqs, stride_x, stride_o, stride_s_slot, stride_s_c,
    W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    i_t = tl.program_id(0)
    i_c = tl.program_id(1)
    tok = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t = tok < T
    m_c = o_c < C
    m = m_t[:, None] & m_c[None, :]
    # Sequence of each token: the n with cu_seqlens[n] <= t < cu_seqlens[n + 1].
    lo = tl.zeros([BT], dtype=tl.int32)
    hi = lo + n_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        end = tl.load(cu_seqlens + tl.minimum(mid, n_seqs - 1) + 1)
        right = tok >= end
        active = lo < hi
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    seq = tl.minimum(lo, n_seqs - 1)
    bos = tl.load(cu_seqlens + seq)
    slot = tl.load(slots + seq).to(tl.int64)

    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for i_w in tl.static_range(W):
        pos = tok - (W - 1) + i_w
        from_x = (pos >= bos)[:, None]
        b_x = tl.load(x + pos[:, None] * stride_x + o_c[None, :], mask=m & from_x, other=0.0)
        b_s = tl.load(conv_state + slot[:, None] * stride_s_slot + o_c[None, :] * stride_s_c
                      + (pos - bos + W - 1)[:, None], mask=m & (from_x == 0), other=0.0)
        # the eager path concatenates the state cast to x's dtype, then upcasts
        b_val = tl.where(from_x, b_x, b_s.to(x.dtype.element_ty)).to(tl.float32)
        b_w = tl.load(weight + o_c * W + i_w, mask=m_c, other=0.0).to(tl.float32)
        acc += b_val * b_w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out + tok[:, None] * stride_o + o_c[None, :], y.to(out.dtype.element_ty), mask=m)


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
):
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


def short_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
               cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Same contract as `ops.conv.short_conv`: x [T, C], weight [C, W], conv_state [slots, C, W-1] (in place)."""
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
            W=width, WP=wp, BC=bc, EVEN_C=c % bc == 0, num_warps=4)
        return out
    bt, bc = 16, 128  # [16, 128] tiles x 4 taps stay in registers (32 rows spilled)
    _conv_fwd_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
        x, weight, conv_state, slots, cu_seqlens, out, t, c, n, strides[0], out.stride(0), strides[1], strides[2],
        W=width, BT=bt, BC=bc, SEARCH_STEPS=max(1, math.ceil(math.log2(n + 1)) + 1), num_warps=4)
    _conv_state_kernel[(n, triton.cdiv(c, bc))](
        x, conv_state, slots, cu_seqlens, c, strides[0], strides[1], strides[2], W=width, WP=wp, BC=bc,
        num_warps=4)
    return out
