"""Fused MoE for bf16 experts: token sort by expert, grouped GEMMs with the gated activation fused, weighted combine.

Reference: `shard_svc/ops/moe/eager.py::moe_experts` (and `ops/activations.py::glu`).

Every (token, choice) pair is one row. The rows are laid out by expert, each expert's run padded to a multiple of
the M-block `BM` (`moe_align`), so every M-block of the GEMMs reads one expert's weights:

1. align: `sorted_ids` [max_blocks * BM] int32 (pair index, or `n_pairs` for padding), `expert_ids` [max_blocks],
   `num_padded` [1] (rows in use). One launch (one program) for up to `SMALL_ALIGN_MAX` pairs (decode); for more
   pairs a histogram grid, a one-program scan writing the runs, and a placing grid. Positions inside an expert's run
   are taken with atomics, so their order varies between runs, but no row's result depends on its position.
2. `_moe_gate_up_kernel`: per (M-block, N-tile) gather x rows, two accumulators (w1, w3), the activation in fp32
   (each product first rounded to x's dtype, as the eager path does) -> h [max_blocks * BM, I] by sorted position.
3. `_moe_down_kernel`: h rows (contiguous) @ w2[e]^T -> y [T*k, Din] by pair index, in x's dtype.
4. `_moe_combine_kernel`: out[t] = sum_j weights[t, j] * y[t*k + j] in fp32, in a fixed order.

No host syncs: every grid and buffer is sized from shapes alone (`max_blocks` bounds the padded rows for any
routing), and M-blocks past `num_padded` exit at once, so the op can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, dot_precision, interpreting, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import dot_k_loop, pdl_prologue, round_to, situ_glu

CHUNK_PAIRS = 65536  # pairs per pass: bounds the h / y intermediates (8,192 tokens at top-8)
SMALL_ALIGN_MAX = 4096  # pairs handled by the one-program align kernel (decode up to 512 x top-8)
ACTIVATIONS = {"silu": 0, "situ": 1}
SMEM_BUDGET = 200 * 1024  # bytes of shared memory the pipelined tiles may take (H200: 227 KB per block)


# -- align: rows sorted by expert ----------------------------------------------------------------------------------

@triton.jit
def _expert_of(ids, o, N, E, E_PAD: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr):
    """Expert of pairs o as int32; pairs past N and ids outside [0, E) go to the spare bin E_PAD - 1 (> E).
    SHARED: pair o is choice o % (K + 1) of token o // (K + 1), where choices 0..K-1 are the token's row of ids [T, K]
    and choice K is the shared expert, numbered E."""
    m = o < N
    if SHARED:
        j = o % (K + 1)
        routed = j < K
        e = tl.load(ids + (o // (K + 1)) * K + j, mask=m & routed, other=E_PAD - 1)
        ok = m & (((e >= 0) & (e < E)) | ~routed)
        e = tl.where(routed, e, E)
    else:
        e = tl.load(ids + o, mask=m, other=E_PAD - 1)
        ok = m & (e >= 0) & (e < E)
    return tl.where(ok, e, E_PAD - 1).to(tl.int32)


@triton.jit
def _write_runs(counts, scratch, sorted_ids, expert_ids, num_padded, N, E, E_PAD: tl.constexpr, BM: tl.constexpr,
                RB: tl.constexpr):
    """From per-expert counts [E_PAD] (in registers): each run's start goes to scratch[0:E_PAD] (the next free row,
    taken by atomics when the pairs are placed), the expert of each of its M-blocks to expert_ids, the sentinel N
    to its padding rows, the rows in use to num_padded. Vectorised over experts: no search per block."""
    o_e = tl.arange(0, E_PAD)
    counts = tl.where(o_e < E, counts, 0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(scratch + o_e, starts)
    tl.store(num_padded, tl.sum(padded, 0))
    blocks = padded // BM
    for j in range(0, tl.max(blocks, 0)):
        tl.store(expert_ids + starts // BM + j, o_e, mask=j < blocks)
    # Padding lies in the last BM rows of a run, past its count (empty runs have none).
    for r0 in tl.static_range(0, BM, RB):
        rows = ends[:, None] - BM + r0 + tl.arange(0, RB)[None, :]  # [E_PAD, RB]
        pad = (padded[:, None] > 0) & (rows >= (starts + counts)[:, None])
        tl.store(sorted_ids + rows, tl.zeros_like(rows) + N, mask=pad)


@triton.jit
def _place_pairs(ids, scratch, sorted_ids, o, N, E, NB, E_PAD: tl.constexpr, K: tl.constexpr, SHARED: tl.constexpr):
    e = _expert_of(ids, o, N, E, E_PAD, K, SHARED)
    valid = e < NB
    pos = tl.atomic_add(scratch + e, 1, mask=valid)  # next free row of the expert's run
    tl.store(sorted_ids + pos, o, mask=valid)


# E: routed experts; NB: experts with runs (E, or E + 1 with the shared expert); K: routed choices per token.
# Counts that follow a pass's size (pairs, M-blocks) are not specialized: Triton would otherwise compile a variant
# for each divisibility class a pass meets, and one the warm-up missed costs a request a compile (late_kernels.py).

@triton.jit(do_not_specialize=["N"])
def _moe_align_one_kernel(ids, sorted_ids, expert_ids, num_padded, scratch, N, E, NB,
                          BM: tl.constexpr, E_PAD: tl.constexpr, C: tl.constexpr, RB: tl.constexpr, K: tl.constexpr,
                          SHARED: tl.constexpr, PDL: tl.constexpr):
    """The whole align in one program (few pairs). The barrier orders the run starts before the atomics."""
    pdl_prologue(PDL)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, N, C):
        counts += tl.histogram(_expert_of(ids, c0 + tl.arange(0, C), N, E, E_PAD, K, SHARED), E_PAD)
    _write_runs(counts, scratch, sorted_ids, expert_ids, num_padded, N, NB, E_PAD, BM, RB)
    tl.debug_barrier()
    for c0 in range(0, N, C):
        _place_pairs(ids, scratch, sorted_ids, c0 + tl.arange(0, C), N, E, NB, E_PAD, K, SHARED)


@triton.jit(do_not_specialize=["N"])
def _moe_hist_kernel(ids, scratch, N, E, NB, E_PAD: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                     SHARED: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * C + tl.arange(0, C)
    hist = tl.histogram(_expert_of(ids, o, N, E, E_PAD, K, SHARED), E_PAD)
    o_e = tl.arange(0, E_PAD)
    tl.atomic_add(scratch + E_PAD + o_e, hist, mask=(o_e < NB) & (hist > 0))


@triton.jit(do_not_specialize=["N"])
def _moe_runs_kernel(scratch, sorted_ids, expert_ids, num_padded, N, NB,
                     BM: tl.constexpr, E_PAD: tl.constexpr, RB: tl.constexpr):
    counts = tl.load(scratch + E_PAD + tl.arange(0, E_PAD))
    _write_runs(counts, scratch, sorted_ids, expert_ids, num_padded, N, NB, E_PAD, BM, RB)


@triton.jit(do_not_specialize=["N"])
def _moe_place_kernel(ids, sorted_ids, scratch, N, E, NB, E_PAD: tl.constexpr, C: tl.constexpr, K: tl.constexpr,
                      SHARED: tl.constexpr):
    _place_pairs(ids, scratch, sorted_ids, tl.program_id(0).to(tl.int64) * C + tl.arange(0, C), N, E, NB, E_PAD, K,
                 SHARED)


@dataclass(frozen=True)
class Layout:
    sorted_ids: torch.Tensor  # [max_blocks * BM] int32 pair index (t * k + j), n_pairs for padding rows
    expert_ids: torch.Tensor  # [max_blocks] int32 expert of each M-block
    num_padded: torch.Tensor  # [1] int32 rows in use; M-blocks past it hold stale values and are never read
    block_m: int
    max_blocks: int


def max_blocks_for(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the M-blocks of any routing: each non-empty expert pads at most block_m - 1 rows."""
    return triton.cdiv(n_pairs + min(num_experts, n_pairs) * (block_m - 1), block_m)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, small_max: int = SMALL_ALIGN_MAX,
              shared: bool = False) -> Layout:
    """Rows of ids [T, k] grouped by expert, each expert's run padded to block_m; no host sync. shared: every token
    also has a last choice, the shared expert (numbered num_experts): pair t * (k + 1) + j."""
    flat = ids.reshape(-1)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    k = ids.shape[1]
    n = flat.shape[0] + (ids.shape[0] if shared else 0)
    runs = num_experts + shared
    max_blocks = max_blocks_for(n, runs, block_m)
    dev = ids.device
    e_pad = pow2_at_least(runs + 1, 32)  # a spare bin for pairs outside [0, E); >= a warp for tl.histogram
    rb = min(block_m, max(1, 8192 // e_pad))  # padding rows written [E_PAD, RB] at a time
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    if n <= small_max:
        scratch = torch.empty(e_pad, dtype=torch.int32, device=dev)
        _moe_align_one_kernel[(1,)](flat, sorted_ids, expert_ids, num_padded, scratch, n, num_experts, runs,
                                    BM=block_m, E_PAD=e_pad, C=256, RB=rb, K=k, SHARED=shared, num_warps=8,
                                    **pdl_args(dev))
    else:
        c = 1024
        scratch = torch.zeros(2 * e_pad, dtype=torch.int32, device=dev)  # run starts | counts
        _moe_hist_kernel[(triton.cdiv(n, c),)](flat, scratch, n, num_experts, runs, E_PAD=e_pad, C=c, K=k,
                                               SHARED=shared, num_warps=4)
        _moe_runs_kernel[(1,)](scratch, sorted_ids, expert_ids, num_padded, n, runs,
                               BM=block_m, E_PAD=e_pad, RB=rb, num_warps=8)
        _moe_place_kernel[(triton.cdiv(n, c),)](flat, sorted_ids, scratch, n, num_experts, runs, E_PAD=e_pad, C=c,
                                                K=k, SHARED=shared, num_warps=4)
    return Layout(sorted_ids, expert_ids, num_padded, block_m, max_blocks)


# -- grouped GEMMs -------------------------------------------------------------------------------------------------

@triton.jit
def tile_ids(num_m, num_n, GROUP_M: tl.constexpr):
    """(M-block, N-tile) of this program; GROUP_M M-blocks share each N-tile in turn (weight tiles stay in L2)."""
    pid = tl.program_id(0)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def expert_block(sorted_ids, expert_ids, pid_m, pid_n, n_pairs, N, BM: tl.constexpr, BN: tl.constexpr):
    """The rows and columns of an (M-block, N-tile) of a grouped GEMM: sorted positions o_p [BM], their pair indices
    and which are real rows (padding holds n_pairs), the block's expert (int64), output columns o_n [BN] and which
    are < N. Returns (o_p, pair, m_row, e, o_n, m_n)."""
    o_p = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_ids + o_p)
    e = tl.load(expert_ids + pid_m).to(tl.int64)
    o_n = pid_n * BN + tl.arange(0, BN)
    return o_p, pair, pair < n_pairs, e, o_n, o_n < N


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _moe_gate_up_kernel(
    x, w1, w3, sw1, sw3, h, sorted_ids, expert_ids, num_padded,
    n_pairs, num_m, E, D, I, stride_x, stride_we, stride_wn, stride_h,
    beta, beta_lin,
    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """TOP_K: choices per token (the shared expert's included). SHARED: expert E's gate / up rows are sw1 / sw3
    (rows of the same stride as an expert's)."""
    pdl_prologue(PDL)
    pid_m, pid_n = tile_ids(num_m, tl.cdiv(I, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded):
        return
    o_p, pair, m_row, e, o_n, m_n = expert_block(sorted_ids, expert_ids, pid_m, pid_n, n_pairs, I, BM, BN)
    tok = (pair // TOP_K).to(tl.int64)
    o_k = tl.arange(0, BK)
    p_a = x + tok[:, None] * stride_x + o_k[None, :]  # [BM, BK]
    w_off = o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]  # [BK, BN]
    p_b1 = w1 + e * stride_we + w_off
    p_b3 = w3 + e * stride_we + w_off
    if SHARED:
        if e == E:
            p_b1 = sw1 + w_off
            p_b3 = sw3 + w_off
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        if EVEN_K:
            a = tl.load(p_a, mask=m_row[:, None], other=0.0)
            b1 = tl.load(p_b1, mask=m_n[None, :], other=0.0)
            b3 = tl.load(p_b3, mask=m_n[None, :], other=0.0)
        else:
            m_k = (k0 + o_k) < D
            a = tl.load(p_a, mask=m_row[:, None] & m_k[None, :], other=0.0)
            b1 = tl.load(p_b1, mask=m_k[:, None] & m_n[None, :], other=0.0)
            b3 = tl.load(p_b3, mask=m_k[:, None] & m_n[None, :], other=0.0)
        if DOT_FP32:  # the interpreter multiplies bf16 dot operands wrongly
            a, b1, b3 = a.to(tl.float32), b1.to(tl.float32), b3.to(tl.float32)
        acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
        acc3 = tl.dot(a, b3, acc3, input_precision=PRECISION)
        p_a += BK
        p_b1 += BK
        p_b3 += BK
    store_glu(acc1, acc3, h, o_p, o_n, m_n, stride_h, beta, beta_lin, ACT, RNE)


@triton.jit
def store_glu(acc1, acc3, h, o_p, o_n, m_n, stride_h, beta, beta_lin, ACT: tl.constexpr, RNE: tl.constexpr):
    """h[o_p, o_n] = act(gate, up) in h's dtype, every row of the block (padding rows give 0)."""
    dt = h.dtype.element_ty
    g = round_to(acc1, dt, RNE).to(tl.float32)  # the eager path rounds each product to x's dtype first
    u = round_to(acc3, dt, RNE).to(tl.float32)
    if ACT == 0:  # SwiGLU in fp32 (rounding silu(g) first, as eager bf16 does, made ptxas serialize the wgmma)
        act = (g * tl.sigmoid(g)) * u
    else:  # SiTU-GLU in fp32
        act = situ_glu(g, u, beta, beta_lin)
    p_h = h + o_p[:, None].to(tl.int64) * stride_h + o_n[None, :]
    tl.store(p_h, round_to(act, dt, RNE), mask=m_n[None, :])


@triton.jit(do_not_specialize=["n_pairs", "num_m"])
def _moe_down_kernel(
    h, w2, sw2, y, sorted_ids, expert_ids, num_padded,
    n_pairs, num_m, E, D, I, stride_h, stride_we, stride_wn, stride_y,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr, RNE: tl.constexpr, SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """SHARED: expert E's down rows are sw2."""
    pdl_prologue(PDL)
    pid_m, pid_n = tile_ids(num_m, tl.cdiv(D, BN), GROUP_M)
    if pid_m * BM >= tl.load(num_padded):
        return
    o_p, pair, m_row, e, o_n, m_n = expert_block(sorted_ids, expert_ids, pid_m, pid_n, n_pairs, D, BM, BN)
    o_k = tl.arange(0, BK)
    p_a = h + o_p[:, None].to(tl.int64) * stride_h + o_k[None, :]  # [BM, BK] contiguous rows of h
    w_off = o_n[None, :].to(tl.int64) * stride_wn + o_k[:, None]  # [BK, BN]
    p_b = w2 + e * stride_we + w_off
    if SHARED:
        if e == E:
            p_b = sw2 + w_off
    # K over the whole of I; w2's rows are contiguous (K stride 1)
    acc = dot_k_loop(tl.zeros([BM, BN], dtype=tl.float32), p_a, p_b, m_n, o_k, 0, I, 1, BK, EVEN_K, DOT_FP32,
                     PRECISION)
    p_y = y + pair[:, None].to(tl.int64) * stride_y + o_n[None, :]
    tl.store(p_y, round_to(acc, y.dtype.element_ty, RNE), mask=m_row[:, None] & m_n[None, :])


@triton.jit
def _moe_combine_kernel(y, weights, ids, out, D, E, stride_y, stride_w, stride_i, stride_o,
                        TOP_K: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr, SHARED: tl.constexpr,
                        PDL: tl.constexpr):
    """SHARED: each token's y rows end with the shared expert's, added at weight 1 after the routed ones."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    acc = tl.zeros([BD], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        # the expert as a [BD] vector: the interpreter rejects scalar-derived load masks
        e = tl.zeros([BD], dtype=tl.int64) + tl.load(ids + t * stride_i + j)
        valid = (e >= 0) & (e < E)
        w = tl.load(weights + t * stride_w + j)
        row = tl.load(y + (t * (TOP_K + SHARED) + j) * stride_y + o_d, mask=m_d & valid, other=0.0)
        acc += tl.where(valid, w, 0.0) * row.to(tl.float32)
    if SHARED:
        acc += tl.load(y + (t * (TOP_K + 1) + TOP_K) * stride_y + o_d, mask=m_d, other=0.0).to(tl.float32)
    tl.store(out + t * stride_o + o_d, round_to(acc, out.dtype.element_ty, RNE), mask=m_d)


# -- host side -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_m_for(n_pairs: int, num_experts: int) -> int:
    """M-block from the mean rows per expert: small blocks waste no work on padding in decode."""
    mean = n_pairs / num_experts
    return 16 if mean <= 16 else 32 if mean <= 48 else 64 if mean <= 160 else 128


def _stages(want: int, per_stage: int) -> int:
    stages = want
    while stages > 1 and stages * per_stage > SMEM_BUDGET:
        stages -= 1
    return stages


def gemm_configs(block_m: int, elem: int) -> tuple[GemmConfig, GemmConfig]:
    """(gate/up, down) tile shapes for an M-block; stages cut down until the tiles fit in shared memory."""
    if block_m <= 32:
        up, down = (64, 128, 4), (64, 128, 4)
    elif block_m == 64:
        up, down = (64, 64, 4), (128, 64, 4)
    else:
        up, down = (64, 64, 8), (128, 64, 8)
    cfgs = []
    for (bn, bk, warps), n_b in ((up, 2), (down, 1)):
        per_stage = (block_m * bk + n_b * bk * bn) * elem
        cfgs.append(GemmConfig(bn, bk, warps, _stages(4, per_stage)))
    return cfgs[0], cfgs[1]


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, activation: str, situ_betas: tuple[float, float],
                small_align_max: int = SMALL_ALIGN_MAX, block_m: int | None = None,
                chunk_pairs: int = CHUNK_PAIRS) -> torch.Tensor:
    """Same contract as `ops.moe.eager.moe_experts`: x [T, Din], weights [T, k] fp32, ids [T, k], w1/w3 [E, I, Din],
    w2 [E, Din, I] -> [T, Din] in x's dtype. Long batches run in passes of `chunk_pairs` (token, choice) pairs."""
    check_experts("moe_experts", x, weights, ids, w1, w3, w2, activation)
    return run_in_chunks(x, weights, ids, chunk_pairs, lambda xs, ws, ids_s, out: moe_pass(
        xs, ws, ids_s, w1, w3, w2, activation, situ_betas, out, small_align_max, block_m))


def check_experts(op: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                  w3: torch.Tensor, w2: torch.Tensor, activation: str) -> None:
    """The token side (`check_routing`) and bf16-kernel expert weights: w1 / w3 [E, I, Din], w2 [E, Din, I] in x's
    dtype, rows contiguous."""
    check_routing(op, x, weights, ids, activation)
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        check(op, name, w, dtypes=(x.dtype,), dims=3)
    d = x.shape[1]
    num_experts, inter, _ = w1.shape
    if (tuple(w1.shape) != (num_experts, inter, d) or w3.shape != w1.shape
            or tuple(w2.shape) != (num_experts, d, inter)):
        raise TritonKernelError(f"{op}: w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)} do not "
                                f"match x {tuple(x.shape)} as [E, I, Din], [E, I, Din], [E, Din, I]")
    if w1.stride(1) != d or w3.stride(1) != d or w2.stride(1) != inter:
        raise TritonKernelError(f"{op}: expert weights must have contiguous rows (strides w1 {w1.stride()}, "
                                f"w3 {w3.stride()}, w2 {w2.stride()})")


def check_routing(op: str, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, activation: str) -> None:
    """The checks every expert kernel makes of its token side: x [T, Din], weights / ids [T, k], the activation."""
    check(op, "x", x, dims=2)
    check(op, "weights", weights, dtypes=(torch.float32,), dims=2)
    check(op, "ids", ids, dtypes=(torch.int32, torch.int64), dims=2)
    t = x.shape[0]
    if tuple(weights.shape) != (t, ids.shape[1]) or ids.shape[0] != t:
        raise TritonKernelError(f"{op}: weights {tuple(weights.shape)} and ids {tuple(ids.shape)} must both be "
                                f"[T={t}, k]")
    if activation not in ACTIVATIONS:
        raise TritonKernelError(f"{op}: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")


def run_in_chunks(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, chunk_pairs: int,
                  run_pass) -> torch.Tensor:
    """[T, Din] output of `run_pass(x, weights, ids, out)` over token chunks of at most `chunk_pairs` (token, choice)
    pairs, which bound the pass's sorted-pair and intermediate buffers."""
    t, k = ids.shape
    out = torch.empty(t, x.shape[1], dtype=x.dtype, device=x.device)
    if t == 0 or k == 0:
        return out.zero_()
    step = max(1, chunk_pairs // k)
    for s in range(0, t, step):
        run_pass(x[s:s + step], weights[s:s + step], ids[s:s + step], out[s:s + step])
    return out


def combine(y: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_experts: int,
            rne: bool, shared: bool = False) -> None:
    """out[t] = sum over t's choices of weight x that (token, choice) pair's expert output row of y (then the shared
    expert's row, weight 1)."""
    t, d = out.shape
    bd = min(1024, pow2_at_least(d, 16))
    _moe_combine_kernel[(t, triton.cdiv(d, bd))](
        y, weights, ids, out, d, num_experts, y.stride(0), weights.stride(0), ids.stride(0), out.stride(0),
        TOP_K=ids.shape[1], BD=bd, RNE=rne, SHARED=shared, num_warps=4, **pdl_args(out.device))


def moe_pass(x, weights, ids, w1, w3, w2, activation, situ_betas, out, small_align_max, block_m,
             shared=None) -> None:
    """One chunk of tokens through align, the two grouped GEMMs and the combine, into out. shared: (gate|up
    [2I, Din], down [Din, I]) of a shared expert run as every token's last choice, or None."""
    t, d = x.shape
    num_experts, inter, _ = w1.shape
    k = ids.shape[1] + (shared is not None)
    n = t * k
    bm = block_m or block_m_for(n, num_experts + (shared is not None))
    layout = moe_align(ids, num_experts, bm, small_align_max, shared=shared is not None)
    sw1, sw3, sw2 = (w1, w3, w2) if shared is None else (shared[0][:inter], shared[0][inter:], shared[1])
    up, down = gemm_configs(bm, x.element_size())
    h = torch.empty(layout.max_blocks * bm, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(n, d, dtype=x.dtype, device=x.device)
    dot_fp32 = interpreting()
    rne = interpreting() and x.dtype == torch.bfloat16
    precision = dot_precision(x.dtype)
    group_m = 8 if bm >= 64 else 1
    _moe_gate_up_kernel[(layout.max_blocks * triton.cdiv(inter, up.block_n),)](
        x, w1, w3, sw1, sw3, h, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, layout.max_blocks, num_experts, d, inter, x.stride(0), w1.stride(0), w1.stride(1), h.stride(0),
        float(situ_betas[0]), float(situ_betas[1]),
        TOP_K=k, BM=bm, BN=up.block_n, BK=up.block_k, GROUP_M=group_m, ACT=ACTIVATIONS[activation],
        EVEN_K=d % up.block_k == 0, DOT_FP32=dot_fp32, PRECISION=precision, RNE=rne, SHARED=shared is not None,
        num_warps=up.num_warps, num_stages=up.num_stages, **pdl_args(x.device))
    _moe_down_kernel[(layout.max_blocks * triton.cdiv(d, down.block_n),)](
        h, w2, sw2, y, layout.sorted_ids, layout.expert_ids, layout.num_padded,
        n, layout.max_blocks, num_experts, d, inter, h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BM=bm, BN=down.block_n, BK=down.block_k, GROUP_M=group_m,
        EVEN_K=inter % down.block_k == 0, DOT_FP32=dot_fp32, PRECISION=precision, RNE=rne,
        SHARED=shared is not None, num_warps=down.num_warps, num_stages=down.num_stages, **pdl_args(x.device))
    combine(y, weights, ids, out, num_experts, rne, shared=shared is not None)


moe_experts.graph_safe = True  # no host sync; buffers and grids sized from shapes only
