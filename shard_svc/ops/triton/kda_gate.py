"""KDA gate and q/k/beta preprocessing as Triton device functions, shared by the decode and chunk kernels.

Reference: `shard_svc/ops/kda/gate.py` (kda_gate, prepare_qkb). The gate is returned in log2 units so the
kernels can use exp2 throughout.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def kda_gate_log2(f, dt_bias, a, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Per-channel log2-decay (every entry <= 0) from the raw gate projection f (fp32), dt_bias, a = exp(A_log).

    Kimi-Linear: -a * softplus(f + dt_bias), softplus linear above 20 (torch's threshold). Below -9,
    log(1 + e^x) rounds to zero in fp32, so e^x (its first-order value) is used instead.
    K3: lower_bound * sigmoid(a * (f + dt_bias)).
    """
    x = f + dt_bias
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        ex = tl.exp(tl.minimum(x, 20.0))
        sp = tl.where(x > 20.0, x, tl.where(x < -9.0, ex, tl.log(1.0 + ex)))
        g = -a * sp
    return g * LOG2E


@triton.jit
def l2_rnorm(x, axis: tl.constexpr):
    """1 / sqrt(sum x^2 + 1e-6) over `axis` (eps inside the root, as gate.l2_normalize)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis) + 1e-6)
