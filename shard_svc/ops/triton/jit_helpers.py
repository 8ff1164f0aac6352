"""Device functions (`@triton.jit`) that kernels of several files share. Triton inlines a called device function into
the kernel, so a kernel compiles the same whether these lines are written in it or called from here."""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax in base 2: scores scaled by scale * LOG2E, then exp2


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a kernel launched with `common.pdl_args`: wait until the previous kernel's writes are
    visible (nothing before this reads or writes memory), then let the next kernel launch as soon as every program of
    this one has started (it waits in its own prologue). A no-op when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def round_to(x, dt: tl.constexpr, RNE: tl.constexpr):
    """fp32 x rounded to dt. RNE: round to nearest even by hand first (the CPU interpreter truncates to bf16)."""
    if RNE:
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
        x = b.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def tanh(x):
    """tanh without cancellation for large |x| and without libdevice (runs in the interpreter too)."""
    z = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - z) / (1.0 + z)
    return tl.where(x < 0, -t, t)


@triton.jit
def situ_glu(g, u, beta, beta_lin):
    """K3's SiTU-GLU of fp32 gate and up: beta*tanh(g/beta) * sigmoid(g) * beta_lin*tanh(u/beta_lin)."""
    return beta * tanh(g / beta) * tl.sigmoid(g) * (beta_lin * tanh(u / beta_lin))


@triton.jit
def online_softmax_step(s, m_i, l_i, acc, v, PRECISION: tl.constexpr):
    """One key tile of a streaming softmax(s) @ v in base 2. s [BQ, BN]: the tile's scores times scale * LOG2E,
    -inf where a key is not seen; m_i, l_i [BQ]: the running max and sum of exp2; acc [BQ, V]: the unnormalised
    output; v [BN, V]: the tile's values (the probabilities are cast to v's dtype for the dot, at PRECISION).
    A row that has seen no key yet and sees none in this tile keeps m = -inf, l = 0 and acc = 0 (not NaN).
    Returns the updated (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)


@triton.jit
def dot_k_loop(acc, p_a, p_b, m_b, o_k, k_lo, k_hi, stride_bk, BK: tl.constexpr, EVEN_K: tl.constexpr,
               DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """acc + A @ B over K in [k_lo, k_hi), BK at a time. A [R, BK] tiles at p_a, K contiguous, every row read (the
    caller points rows it will not store at memory that exists); B [BK, C] tiles at p_b, K stride stride_bk, columns
    masked by m_b [C]; o_k = arange(0, BK). EVEN_K: every step is whole, so no per-element K mask and the loads
    vectorise."""
    for k0 in range(k_lo, k_hi, BK):
        if EVEN_K:
            a = tl.load(p_a)
            b = tl.load(p_b, mask=m_b[None, :], other=0.0)
        else:
            m_k = (k0 + o_k) < k_hi
            a = tl.load(p_a, mask=m_k[None, :], other=0.0)
            b = tl.load(p_b, mask=m_k[:, None] & m_b[None, :], other=0.0)
        if DOT_FP32:
            # The interpreter multiplies bf16 dot operands wrongly, and its dot is the host BLAS's, whose rows can
            # round differently by their place in the tile (OpenBLAS's FMA kernels on x86); a tensor-core product's
            # do not, and batch invariance rests on that. Products summed over K in one order for every row instead.
            a, b = a.to(tl.float32), b.to(tl.float32)
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        p_a += BK
        p_b += BK * stride_bk
    return acc
