"""The gated activation of the dense MLP and the shared experts, one pass over gate and up.

Reference: `shard_svc/ops/activations.py::glu`. The eager SwiGLU is two launches (silu, then the product) with
silu(gate) rounded to the dtype in between; this kernel rounds at the same point, so only the exp differs. SiTU-GLU
(K3) is computed in fp32 and rounded once, as in the eager op. gate and up usually arrive as the two column halves
of one joint product (row stride 2I).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shard_svc.ops.triton.common import TritonKernelError, check, interpreting, pdl_args, pow2_at_least
from shard_svc.ops.triton.jit_helpers import pdl_prologue, round_to, situ_glu
from shard_svc.ops.triton.moe import ACTIVATIONS

BLOCK_COLS = 1024
ROW_ELEMENTS = 4096  # elements per program: a few rows of a decode step, one tile of a prefill chunk


@triton.jit
def _glu_kernel(gate, up, out, rows, I, stride_g, stride_u, stride_o, beta, beta_lin,
                BR: tl.constexpr, BI: tl.constexpr, ACT: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_i = tl.program_id(1) * BI + tl.arange(0, BI)
    m = (o_r < rows)[:, None] & (o_i < I)[None, :]
    g = tl.load(gate + o_r[:, None] * stride_g + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    u = tl.load(up + o_r[:, None] * stride_u + o_i[None, :], mask=m, other=0.0).to(tl.float32)
    dt = out.dtype.element_ty
    if ACT == 0:
        y = round_to(g / (1.0 + tl.exp(-g)), dt, RNE).to(tl.float32) * u
    else:
        y = situ_glu(g, u, beta, beta_lin)
    tl.store(out + o_r[:, None] * stride_o + o_i[None, :], round_to(y, dt, RNE), mask=m)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """Same contract as `ops.activations.glu`: gate, up [..., I] (rows may be strided, as column halves of one
    product are) -> [..., I] in gate's dtype."""
    op = "glu"
    check(op, "gate", gate)
    check(op, "up", up, dtypes=(gate.dtype,))
    if up.shape != gate.shape:
        raise TritonKernelError(f"{op}: up {tuple(up.shape)} must match gate {tuple(gate.shape)}")
    if activation not in ACTIVATIONS:
        raise TritonKernelError(f"{op}: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")
    inter = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    gate, up = gate.reshape(-1, inter), up.reshape(-1, inter)
    rows = gate.shape[0]
    if rows == 0 or inter == 0:
        return out
    bi = min(BLOCK_COLS, pow2_at_least(inter, 16))
    br = max(1, ROW_ELEMENTS // bi)
    _glu_kernel[(triton.cdiv(rows, br), triton.cdiv(inter, bi))](
        gate, up, out, rows, inter, gate.stride(0), up.stride(0), inter,
        float(situ_betas[0]), float(situ_betas[1]),
        BR=br, BI=bi, ACT=ACTIVATIONS[activation], RNE=interpreting() and gate.dtype == torch.bfloat16, num_warps=4,
        **pdl_args(gate.device))
    return out


glu.graph_safe = True  # no host sync; grid from shapes only
