"""Eager RMSNorm variants. Statistics in fp32, cast back, then the weight (the checkpoints' convention)."""

import torch

from shard_svc.ops.precision import upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] -> [..., N] in x's dtype."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """KDA output norm: RMSNorm over the last dim times weight times sigmoid(gate). x, gate [..., N]."""
    xf = upcast(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * upcast(weight)
    return (y * torch.sigmoid(upcast(gate))).to(x.dtype)
