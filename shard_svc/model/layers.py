"""Leaf modules shared by every block. Parameters are created empty: the loader fills every one of them."""

import torch
from torch import nn


def linear(out_features: int, in_features: int, dtype: torch.dtype) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
