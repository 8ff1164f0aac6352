"""MXFP4 rounding for training: the values a checkpoint's MXFP4 experts dequantise to, with a straight-through
gradient, so experts are trained as they will be served. Same rule as shard_svc/checkpoint/mxfp4.py's
`quantize_mxfp4` (power-of-two scale per group of 32 bringing the max within 6, nearest E2M1 magnitude, ties to the
smaller), computed on the weight's device with no host sync; tests check the two agree bit for bit."""

from __future__ import annotations

import functools

import torch

from shard_svc.checkpoint.mxfp4 import E8M0_BIAS, GROUP


@functools.cache
def e2m1_grid(device: torch.device) -> torch.Tensor:
    """E2M1_MAGNITUDES (0, 0.5, 1, 1.5, 2, 3, 4, 6), built by device ops from the 3-bit codes: a tensor made from host
    data would copy from the host inside the training pass, which a captured CUDA graph cannot hold. Built once per
    device (each MoE layer's every expert weight reads it, every step)."""
    code = torch.arange(8, dtype=torch.float32, device=device)
    exponent, mantissa = torch.div(code, 2, rounding_mode="floor"), code % 2
    return torch.where(exponent == 0, mantissa * 0.5, torch.exp2(exponent - 1) * (1 + mantissa * 0.5))


def mxfp4_round(weight: torch.Tensor) -> torch.Tensor:
    """[..., in] (in a multiple of 32) -> the dequantised MXFP4 values, fp32, same shape."""
    groups = weight.detach().float().reshape(*weight.shape[:-1], weight.shape[-1] // GROUP, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax.clamp_min(torch.finfo(torch.float32).tiny) / 6.0))
    exponent = exponent + (amax > 6.0 * torch.exp2(exponent)).float()
    scale = torch.exp2(exponent.clamp(-E8M0_BIAS, E8M0_BIAS))
    grid = e2m1_grid(weight.device)
    scaled = groups / scale
    magnitude = grid[(scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)]
    return (torch.where(scaled < 0, -magnitude, magnitude) * scale).reshape(weight.shape)


def fake_quantize_mxfp4(weight: torch.Tensor) -> torch.Tensor:
    """MXFP4-rounded values in the forward pass, identity in the backward pass (straight-through)."""
    return weight + (mxfp4_round(weight).to(weight.dtype) - weight).detach()
