"""W4A16 fused MoE for MXFP4 routed experts (Kimi-K3): the weights stay packed and are dequantised tile by tile
inside the grouped GEMMs; activations and the intermediate stay in the model dtype.

Reference: the eager MoE (`shard_svc/ops/moe/eager.py::moe_experts`) over `checkpoint/mxfp4.py::dequantize_mxfp4`
weights, which `weight_streaming/experts.py::w4a16_moe_experts` equals bit for bit. The weights as the checkpoint stores
them (docs/models.md#mxfp4-experts): `packed` uint8 [E, out, in/2], two E2M1 codes a byte, LOW NIBBLE FIRST (bit 3 sign,
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6); `scale` uint8 [E, out, in/32], an E8M0 exponent: the multiplier is
2^(byte - 127), never the byte's value.

A byte holds inputs 2j (low nibble) and 2j + 1 (high nibble), so a K-tile is two half-tiles: the even inputs times
the low nibbles plus the odd inputs times the high nibbles; each decoded value times its power of two is exact in
bf16, so the tensor cores see exactly the dequantised weights. Align, padding and combine are `moe.py`'s, and so is
the host-sync-free contract (`graph_safe`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, dot_precision, interpreting
from shard_svc.ops.triton.jit_helpers import round_to
from shard_svc.ops.triton.moe import (
    ACTIVATIONS, CHUNK_PAIRS, SMALL_ALIGN_MAX, GemmConfig, block_m_for, check_routing, combine, expert_block,
    gemm_configs, moe_align, run_in_chunks, store_glu, tile_ids)

GROUP = 32  # inputs per E8M0 scale
TWO_POW_M127 = tl.constexpr(5.877471754111438e-39)  # 2^-127: scale byte 0 (a subnormal)


@triton.jit
def _e2m1(code):
    """4-bit E2M1 code -> fp32: exponent bits 1-2, mantissa bit 0, sign bit 3."""
    m = code & 7
    e = m >> 1
    half = (m & 1).to(tl.float32) * 0.5
    power = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, half, (1.0 + half) * power)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _e8m0(s):
    """E8M0 byte -> 2^(s - 127) in fp32, built from the exponent bits (exact; 255 was refused at load)."""
    s = s.to(tl.int32)
    return tl.where(s == 0, TWO_POW_M127, (s << 23).to(tl.float32, bitcast=True))


@triton.jit
def _w4_tiles(p_q, p_s, mask, dt: tl.constexpr):
    """Packed bytes [BKH, BN] and their scales -> (even-input, odd-input) weight tiles [BKH, BN] in dt."""
    q = tl.load(p_q, mask=mask, other=0).to(tl.int32)
    scale = _e8m0(tl.load(p_s, mask=mask, other=127))
    return (_e2m1(q & 15) * scale).to(dt), (_e2m1(q >> 4) * scale).to(dt)


@triton.jit
def _moe_gate_up_w4_kernel(
    x, w1q, w1s, w3q, w3s, h, sorted_ids, expert_ids, num_padded,
    n_pairs, num_m, D, I, stride_x, stride_qe, stride_qn, stride_se, stride_sn, stride_h,
    beta, beta_lin,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr,
):
    pid_m, pid_n = tile_ids(num_m, tl.cdiv(I, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded):
        return
    BKH: tl.constexpr = BK // 2
    o_p, pair, m_row, e, o_n, m_n = expert_block(sorted_ids, expert_ids, pid_m, pid_n, n_pairs, I, BM, BN)
    tok = (pair // TOP_K).to(tl.int64)
    o_j = tl.arange(0, BKH)  # bytes of the tile: inputs 2j and 2j + 1
    p_a = x + tok[:, None] * stride_x + 2 * o_j[None, :]  # [BM, BKH] even inputs; odd ones at + 1
    q_off = e * stride_qe + o_n[None, :].to(tl.int64) * stride_qn + o_j[:, None]  # [BKH, BN]
    s_row = e * stride_se + o_n[None, :].to(tl.int64) * stride_sn  # [1, BN]
    dt: tl.constexpr = tl.float32 if DOT_FP32 else x.dtype.element_ty  # the interpreter: fp32 dot operands
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        grp = ((k0 + 2 * o_j) // 32)[:, None]
        if EVEN_K:
            m_a = m_row[:, None]
            m_b = m_n[None, :]
        else:
            m_j = (k0 + 2 * o_j) < D
            m_a = m_row[:, None] & m_j[None, :]
            m_b = m_j[:, None] & m_n[None, :]
        a_even = tl.load(p_a, mask=m_a, other=0.0).to(dt)
        a_odd = tl.load(p_a + 1, mask=m_a, other=0.0).to(dt)
        w_even, w_odd = _w4_tiles(w1q + q_off, w1s + s_row + grp, m_b, dt)
        acc1 = tl.dot(a_even, w_even, acc1, input_precision=PRECISION)
        acc1 = tl.dot(a_odd, w_odd, acc1, input_precision=PRECISION)
        w_even, w_odd = _w4_tiles(w3q + q_off, w3s + s_row + grp, m_b, dt)
        acc3 = tl.dot(a_even, w_even, acc3, input_precision=PRECISION)
        acc3 = tl.dot(a_odd, w_odd, acc3, input_precision=PRECISION)
        p_a += BK
        q_off += BKH
    store_glu(acc1, acc3, h, o_p, o_n, m_n, stride_h, beta, beta_lin, ACT, RNE)


@triton.jit
def _moe_down_w4_kernel(
    h, w2q, w2s, y, sorted_ids, expert_ids, num_padded,
    n_pairs, num_m, D, I, stride_h, stride_qe, stride_qn, stride_se, stride_sn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr,
):
    pid_m, pid_n = tile_ids(num_m, tl.cdiv(D, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded):
        return
    BKH: tl.constexpr = BK // 2
    o_p, pair, m_row, e, o_n, m_n = expert_block(sorted_ids, expert_ids, pid_m, pid_n, n_pairs, D, BM, BN)
    o_j = tl.arange(0, BKH)
    p_a = h + o_p[:, None].to(tl.int64) * stride_h + 2 * o_j[None, :]  # [BM, BKH] even inputs of h rows
    q_off = e * stride_qe + o_n[None, :].to(tl.int64) * stride_qn + o_j[:, None]
    s_row = e * stride_se + o_n[None, :].to(tl.int64) * stride_sn
    dt: tl.constexpr = tl.float32 if DOT_FP32 else h.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        grp = ((k0 + 2 * o_j) // 32)[:, None]
        if EVEN_K:
            a_even = tl.load(p_a).to(dt)
            a_odd = tl.load(p_a + 1).to(dt)
            m_b = m_n[None, :]
        else:
            m_j = (k0 + 2 * o_j) < I
            a_even = tl.load(p_a, mask=m_j[None, :], other=0.0).to(dt)
            a_odd = tl.load(p_a + 1, mask=m_j[None, :], other=0.0).to(dt)
            m_b = m_j[:, None] & m_n[None, :]
        w_even, w_odd = _w4_tiles(w2q + q_off, w2s + s_row + grp, m_b, dt)
        acc = tl.dot(a_even, w_even, acc, input_precision=PRECISION)
        acc = tl.dot(a_odd, w_odd, acc, input_precision=PRECISION)
        p_a += BK
        q_off += BKH
    p_y = y + pair[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, round_to(acc, y.dtype.element_ty, RNE), mask=m_row[:, None] & m_n[None, :])


def _check_packed(op: str, name: str, q: torch.Tensor, s: torch.Tensor, experts: int, out: int, width: int) -> None:
    check(op, f"{name} packed", q, dtypes=(torch.uint8,), dims=3)
    check(op, f"{name} scale", s, dtypes=(torch.uint8,), dims=3)
    if tuple(q.shape) != (experts, out, width // 2) or tuple(s.shape) != (experts, out, width // GROUP):
        raise TritonKernelError(f"{op}: {name} packed {tuple(q.shape)} / scale {tuple(s.shape)} must be "
                                f"[{experts}, {out}, {width // 2}] / [{experts}, {out}, {width // GROUP}] uint8 "
                                "(MXFP4: two E2M1 codes per byte, one E8M0 exponent per 32 inputs)")
    if q.stride(1) != width // 2 or s.stride(1) != width // GROUP:
        raise TritonKernelError(f"{op}: {name} packed/scale rows must be contiguous (strides {q.stride()}, "
                                f"{s.stride()})")


def moe_experts_w4a16(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      packed: dict[str, tuple[torch.Tensor, torch.Tensor]], activation: str,
                      situ_betas: tuple[float, float], small_align_max: int = SMALL_ALIGN_MAX,
                      block_m: int | None = None, chunk_pairs: int = CHUNK_PAIRS) -> torch.Tensor:
    """Same contract as `weight_streaming/experts.py::w4a16_moe_experts`: x [T, Din] (bf16/fp16/fp32), weights
    [T, k] fp32, ids [T, k], packed {"w1"|"w3": (uint8 [E, I, Din/2], uint8 [E, I, Din/32]), "w2": (uint8 [E, Din,
    I/2], uint8 [E, Din, I/32])} -> [T, Din] in x's dtype."""
    op = "moe_experts_w4a16"
    check_routing(op, x, weights, ids, activation)
    if set(packed) != {"w1", "w2", "w3"}:
        raise TritonKernelError(f"{op}: packed weights must be w1, w3, w2; got {sorted(packed)}")
    d = x.shape[1]
    (w1q, w1s), (w3q, w3s), (w2q, w2s) = packed["w1"], packed["w3"], packed["w2"]
    num_experts, inter = w1q.shape[0], w1q.shape[1] if w1q.dim() == 3 else -1
    if d % GROUP or inter % GROUP:
        raise TritonKernelError(f"{op}: Din {d} and I {inter} must be multiples of the MXFP4 group {GROUP}")
    _check_packed(op, "w1", w1q, w1s, num_experts, inter, d)
    _check_packed(op, "w3", w3q, w3s, num_experts, inter, d)
    _check_packed(op, "w2", w2q, w2s, num_experts, d, inter)
    if w1q.stride() != w3q.stride() or w1s.stride() != w3s.stride():
        raise TritonKernelError(f"{op}: w1 and w3 must share strides ({w1q.stride()} vs {w3q.stride()})")
    return run_in_chunks(x, weights, ids, chunk_pairs, lambda xs, ws, ids_s, out: _w4_pass(
        xs, ws, ids_s, packed, activation, situ_betas, out, small_align_max, block_m))


def _w4_pass(x, weights, ids, packed, activation, situ_betas, out, small_align_max, block_m) -> None:
    (w1q, w1s), (w3q, w3s), (w2q, w2s) = packed["w1"], packed["w3"], packed["w2"]
    t, d = x.shape
    num_experts, inter = w1q.shape[0], w1q.shape[1]
    k = ids.shape[1]
    n = t * k
    bm = block_m or block_m_for(n, num_experts)
    layout = moe_align(ids, num_experts, bm, small_align_max)
    up, down = gemm_configs(bm, 2)
    if bm <= 32:  # decode: half-width K tiles keep the decoded weight tiles in registers (no spills)
        up, down = (GemmConfig(c.block_n, 64, c.num_warps, c.num_stages) for c in (up, down))
    elif bm == 64:  # 128-wide decoded down tiles spill at 4 warps
        down = GemmConfig(64, down.block_k, down.num_warps, down.num_stages)
    h = torch.empty(layout.max_blocks * bm, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    dot_fp32, precision = interpreting(), dot_precision(x.dtype)
    rne = interpreting() and x.dtype == torch.bfloat16
    group_m = 8 if bm >= 64 else 1
    _moe_gate_up_w4_kernel[(layout.max_blocks * triton.cdiv(inter, up.block_n),)](
        x, w1q, w1s, w3q, w3s, h, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, layout.max_blocks, d, inter, x.stride(0), w1q.stride(0), w1q.stride(1), w1s.stride(0), w1s.stride(1),
        h.stride(0), float(situ_betas[0]), float(situ_betas[1]),
        TOP_K=k, BM=bm, BN=up.block_n, BK=up.block_k, GROUP_M=group_m, ACT=ACTIVATIONS[activation],
        EVEN_K=d % up.block_k == 0, DOT_FP32=dot_fp32, PRECISION=precision, RNE=rne, num_warps=up.num_warps,
        num_stages=up.num_stages)
    _moe_down_w4_kernel[(layout.max_blocks * triton.cdiv(d, down.block_n),)](
        h, w2q, w2s, y, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, layout.max_blocks, d, inter, h.stride(0), w2q.stride(0), w2q.stride(1), w2s.stride(0), w2s.stride(1),
        y.stride(0), BM=bm, BN=down.block_n, BK=down.block_k, GROUP_M=group_m,
        EVEN_K=inter % down.block_k == 0, DOT_FP32=dot_fp32, PRECISION=precision, RNE=rne,
        num_warps=down.num_warps, num_stages=down.num_stages)
    combine(y, weights, ids, out, num_experts, rne)


moe_experts_w4a16.graph_safe = True  # no host sync; buffers and grids sized from shapes only
