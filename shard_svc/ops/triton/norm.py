"""RMSNorm kernels: the KDA gated output norm and the plain RMSNorm, one row block per program.

Reference: `shard_svc/ops/norm.py`. Statistics in fp32. gated_rms_norm: (x * rstd * weight * sigmoid(gate))
rounded once to x's dtype. rms_norm keeps the checkpoints' convention: normalise, round to x's dtype, then
multiply by the weight (result in promote(weight, x)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, pow2_at_least


@triton.jit
def _rms_norm_kernel(x, weight, gate, out, rows, stride_x, stride_g, stride_o, eps,
                     N: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, GATED: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_n = tl.arange(0, BN)
    m = (o_r < rows)[:, None] & (o_n < N)[None, :]
    b_x = tl.load(x + o_r[:, None] * stride_x + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / N + eps)
    b_w = tl.load(weight + o_n, mask=o_n < N, other=0.0).to(tl.float32)
    if GATED:
        b_g = tl.load(gate + o_r[:, None] * stride_g + o_n[None, :], mask=m, other=0.0).to(tl.float32)
        y = b_x * rstd[:, None] * b_w[None, :] * tl.sigmoid(b_g)
    else:
        y = (b_x * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32) * b_w[None, :]
    tl.store(out + o_r[:, None] * stride_o + o_n[None, :], y.to(out.dtype.element_ty), mask=m)


def _launch(op, x, weight, gate, eps, out_dtype):
    check(op, "x", x)
    check(op, "weight", weight, dims=1)
    n = x.shape[-1]
    if weight.shape[0] != n:
        raise TritonKernelError(f"{op}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    g2 = x2
    if gate is not None:
        check(op, "gate", gate)
        if gate.shape != x.shape:
            raise TritonKernelError(f"{op}: gate {tuple(gate.shape)} must match x {tuple(x.shape)}")
        g2 = gate.reshape(-1, n)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0:
        return out
    bn = pow2_at_least(n)
    br = max(1, min(64, 4096 // bn))
    _rms_norm_kernel[(triton.cdiv(rows, br),)](
        x2, weight, g2, out, rows, x2.stride(0), g2.stride(0), n, eps,
        N=n, BN=bn, BR=br, GATED=gate is not None, num_warps=4)
    return out


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops.norm.gated_rms_norm`: x, gate [..., N], weight [N] -> [..., N] in x's dtype."""
    return _launch("gated_rms_norm", x, weight, gate, eps, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops.norm.rms_norm`: x [..., N], weight [N]."""
    return _launch("rms_norm", x, weight, None, eps, torch.promote_types(weight.dtype, x.dtype))
