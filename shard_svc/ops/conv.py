"""Eager causal depthwise short convolution over packed variable-length sequences, with SiLU.

The conv state of a sequence is its last W-1 inputs (oldest first), kept in a pool slot so a later chunk or
decode step continues exactly where the previous call stopped.
"""

import torch
import torch.nn.functional as F

from shard_svc.ops.precision import upcast


def short_conv(
    x: torch.Tensor,  # [T, C] packed new inputs of all sequences
    weight: torch.Tensor,  # [C, W]
    conv_state: torch.Tensor,  # [slots, C, W-1] one layer's pool view, updated in place
    slots: torch.Tensor,  # [B] pool slot of each sequence
    cu_seqlens: torch.Tensor,  # [B+1] offsets of each sequence in x
) -> torch.Tensor:
    """Returns SiLU(conv(x)) [T, C] in x's dtype; writes each sequence's last W-1 inputs back to its slot."""
    width = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for b, slot in enumerate(slots.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if start == end:  # an empty sequence (a padded pass's unused entry) keeps its state
            continue
        seq = torch.cat([conv_state[slot].to(x.dtype), x[start:end].t()], dim=1)  # [C, W-1+L]
        y = F.conv1d(upcast(seq.unsqueeze(0)), upcast(weight).unsqueeze(1), groups=weight.shape[0])  # [1, C, L]
        out[start:end] = F.silu(y[0].t()).to(x.dtype)
        conv_state[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_state.dtype)
    return out


def snapshot_conv_states(x: torch.Tensor, conv_state: torch.Tensor, points) -> None:
    """The conv state at each snapshot point (StateSnapshots.points, ops/kda/snapshots.py) into the point's slot:
    the last W-1 inputs before it, from the pass's inputs x [T, C] and the sequence's state before the pass. Runs
    before short_conv, which overwrites that state; plain copies, so the same for every op backend."""
    keep = conv_state.shape[-1]
    for slot, start, m, target in points:
        tail = x[start + max(0, m - keep):start + m].t()  # only the inputs the window can hold, not all m
        window = torch.cat([conv_state[slot].to(x.dtype), tail], dim=1)
        conv_state[target] = window[:, window.shape[1] - keep:].to(conv_state.dtype)
