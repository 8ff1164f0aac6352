"""RMSNorm kernels: the KDA gated output norm, the plain RMSNorm, and the plain RMSNorm after a residual add, one
row block per program.

Reference: `shard_svc/ops/norm.py`. Statistics in fp32. gated_rms_norm: (x * rstd * weight * sigmoid(gate))
rounded once to x's dtype. rms_norm keeps the checkpoints' convention: normalise, round to x's dtype, then
multiply by the weight (result in promote(weight, x)). add_rms_norm first forms h = residual + x rounded to their
dtype, exactly the unfused add, writes it, and normalises that rounded h: a decode step's 54 residual adds stop
being launches of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, interpreting, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue, round_to


@triton.jit
def _rms_norm_kernel(x, weight, gate, res, out, h_out, rows, stride_x, stride_g, stride_r, stride_o, stride_h, eps,
                     N: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr,
                     RNE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_n = tl.arange(0, BN)
    m = (o_r < rows)[:, None] & (o_n < N)[None, :]
    b_x = tl.load(x + o_r[:, None] * stride_x + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    if ADD:
        b_r = tl.load(res + o_r[:, None] * stride_r + o_n[None, :], mask=m, other=0.0).to(tl.float32)
        b_h = round_to(b_r + b_x, h_out.dtype.element_ty, RNE)
        tl.store(h_out + o_r[:, None] * stride_h + o_n[None, :], b_h, mask=m)
        b_x = b_h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, 1) / N + eps)
    b_w = tl.load(weight + o_n, mask=o_n < N, other=0.0).to(tl.float32)
    if GATED:
        b_g = tl.load(gate + o_r[:, None] * stride_g + o_n[None, :], mask=m, other=0.0).to(tl.float32)
        y = b_x * rstd[:, None] * b_w[None, :] * tl.sigmoid(b_g)
    else:
        y = (b_x * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32) * b_w[None, :]
    tl.store(out + o_r[:, None] * stride_o + o_n[None, :], y.to(out.dtype.element_ty), mask=m)


def _rows(op: str, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` checked against x's shape (and dtype), as [rows, N]."""
    check(op, name, t, dtypes=(like.dtype,))
    if t.shape != like.shape:
        raise TritonKernelError(f"{op}: {name} {tuple(t.shape)} must match x {tuple(like.shape)}")
    return t.reshape(-1, like.shape[-1])


def _launch(op, x, weight, eps, out_dtype, gate=None, residual=None):
    check(op, "x", x)
    check(op, "weight", weight, dims=1)
    n = x.shape[-1]
    if weight.shape[0] != n:
        raise TritonKernelError(f"{op}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    x2 = x.reshape(-1, n)
    g2 = x2 if gate is None else _rows(op, "gate", gate, x)
    r2 = x2 if residual is None else _rows(op, "residual", residual, x)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = out if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        bn = pow2_at_least(n)
        br = max(1, min(64, 4096 // bn))
        h2 = h.view(-1, n)
        _rms_norm_kernel[(triton.cdiv(rows, br),)](
            x2, weight, g2, r2, out, h2, rows, x2.stride(0), g2.stride(0), r2.stride(0), n, h2.stride(0), eps,
            N=n, BN=bn, BR=br, GATED=gate is not None, ADD=residual is not None,
            RNE=interpreting() and x.dtype == torch.bfloat16, num_warps=4, **pdl_args(x.device))
    return out, h


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops.norm.gated_rms_norm`: x, gate [..., N], weight [N] -> [..., N] in x's dtype."""
    return _launch("gated_rms_norm", x, weight, eps, x.dtype, gate=gate)[0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as `ops.norm.rms_norm`: x [..., N], weight [N]."""
    return _launch("rms_norm", x, weight, eps, torch.promote_types(weight.dtype, x.dtype))[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `ops.norm.add_rms_norm`: x, residual [..., N] of one dtype, weight [N] ->
    (rms_norm(h), h = residual + x)."""
    return _launch("add_rms_norm", x, weight, eps, torch.promote_types(weight.dtype, x.dtype), residual=residual)
