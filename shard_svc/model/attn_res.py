"""K3 Block Attention Residuals: a depth-wise softmax mix over preallocated block summaries."""

import torch

from shard_svc.ops.precision import upcast
from torch import nn

from shard_svc.model.layers import RMSNorm


class AttnResMix(nn.Module):
    """AttnRes(cur, B): softmax over sources [B_0..B_{n-1}, cur] of RMSNorm(source) . proj; mixes raw values."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(hidden, eps, dtype)
        self.proj = nn.Linear(hidden, 1, bias=False, dtype=dtype)

    def forward(self, cur: torch.Tensor, blocks: torch.Tensor, ops) -> torch.Tensor:
        """cur [T, D]; blocks [n, T, D] (the filled prefix of the preallocated carry) -> [T, D]."""
        w, eps = upcast(self.norm.weight), self.norm.eps
        q = upcast(self.proj.weight).squeeze(0)  # [D] pseudo-query
        keys_b, key_c = ops.rms_norm(upcast(blocks), w, eps), ops.rms_norm(upcast(cur), w, eps)
        scores = torch.cat([keys_b @ q, (key_c @ q)[None]])
        probs = torch.softmax(scores, dim=0)  # [n+1, T] over sources
        mixed = torch.einsum("nt,ntd->td", probs[:-1], upcast(blocks)) + probs[-1].unsqueeze(-1) * upcast(cur)
        return mixed.to(cur.dtype)


class BlockCarry:
    """The block summaries of one forward pass, preallocated for every boundary (never grown by concat)."""

    def __init__(self, num_layers: int, block_size: int, like: torch.Tensor):
        self.block_size = block_size
        self.buf = like.new_empty(-(-num_layers // block_size), *like.shape)
        self.count = 0

    def filled(self) -> torch.Tensor:
        return self.buf[: self.count]

    def opens_block(self, layer: int) -> bool:
        return layer % self.block_size == 0

    def append(self, summary: torch.Tensor) -> None:
        if summary.requires_grad:
            # Training (training/): earlier mixes saved views of the buffer for their backward; write a copy.
            self.buf = self.buf.clone()
        self.buf[self.count] = summary
        self.count += 1
