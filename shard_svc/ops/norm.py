"""Eager RMSNorm variants. Statistics in fp32, cast back, then the weight (the checkpoints' convention)."""

import torch

from shard_svc.ops.precision import upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in x's dtype."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's output x added to the residual stream, then the next block's input norm: (rms_norm(h), h) with
    h = residual + x in their dtype. One op so that a backend can run both steps in one pass over the row."""
    h = residual + x
    return rms_norm(h, weight, eps), h


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over the last dim times weight times sigmoid(gate). x, gate [..., N]."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * upcast(weight)
    return (y * torch.sigmoid(upcast(gate))).to(x.dtype)
