"""Gated activations: SwiGLU (Kimi-Linear) and SiTU-GLU (K3, computed in fp32)."""

import torch
import torch.nn.functional as F

from shard_svc.ops.precision import upcast


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str, situ_betas: tuple[float, float]) -> torch.Tensor:
    """act(gate) * up for `silu`; `b*tanh(gate/b) * sigmoid(gate) * bl*tanh(up/bl)` for `situ`."""
    if activation == "silu":
        return F.silu(gate) * up
    b, bl = situ_betas
    g, u = upcast(gate), upcast(up)
    return (b * torch.tanh(g / b) * torch.sigmoid(g) * (bl * torch.tanh(u / bl))).to(gate.dtype)
