"""Per-step metadata for one forward pass over packed sequences, built by the runner, read by every layer.

A layer reads and writes its own views of the state pools and nothing else of them, so the context names only those
views (KDAStateLayers, MLACacheLayers); the pools that provide them (shard_svc/state/pools.py) sit above the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:  # the ops import this module's StateSnapshots
    from shard_svc.ops import Ops


class KDAStateLayers(Protocol):
    def layer(self, engine_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(recurrent [slots, H, K, V], conv [slots, 3HK, W-1]) views of one KDA layer, by engine layer index."""


class MLACacheLayers(Protocol):
    def layer(self, engine_layer: int) -> torch.Tensor:
        """The paged latent cache [blocks, block_size, latent] of one MLA layer, by engine layer index."""


@dataclass
class StateSnapshots:
    """KDA states copied out inside a prefill pass (the prefix cache's snapshot points, engine/prefix_cache.py): each
    sequence's new tokens are cut into segments at its points, the recurrence runs a sequence's segments one after
    another, and the state at each segment's end is written to that segment's slot (a sequence's last segment: its
    own slot). So the state at a point lands in the slot chosen for it without ending the pass there; the chunked
    kernels restart their chunks at a point, exactly as a pass that ended there would have."""

    cu_segments: torch.Tensor  # [S+1] int64 offsets of the segments in the packed input
    segment_slots: torch.Tensor  # [S] int64 the slot each segment's end state is written to
    sequence_segments: torch.Tensor  # [B+1] int64 sequence b's segments are sequence_segments[b] .. [b+1] - 1
    # host side, per point: (its sequence's slot, the sequence's first row in the packed input, the sequence's new
    # tokens before the point, the point's slot)
    points: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def build(cls, cu_seqlens: list[int], slots: list[int], points: list[tuple[int, int, int]],
              device: torch.device) -> StateSnapshots:
        """points: (sequence b, m, slot) with 0 < m < sequence b's new tokens, increasing m per sequence."""
        cu, seg_slots, seq_segs, resolved = [0], [], [0], []
        for b, slot in enumerate(slots):
            start, end = cu_seqlens[b], cu_seqlens[b + 1]
            for pb, m, target in points:
                if pb != b:
                    continue
                if not 0 < m < end - start or start + m <= cu[-1]:
                    raise ValueError(f"snapshot point {m} of sequence {b} must be increasing and inside its "
                                     f"{end - start} new tokens")
                cu.append(start + m)
                seg_slots.append(target)
                resolved.append((slot, start, m, target))
            cu.append(end)
            seg_slots.append(slot)
            seq_segs.append(len(seg_slots))
        cu_t, seg_t, seq_t = (torch.tensor(x, dtype=torch.int64, device=device) for x in (cu, seg_slots, seq_segs))
        return cls(cu_t, seg_t, seq_t, tuple(resolved))


@dataclass
class ForwardBatch:
    cu_seqlens: torch.Tensor  # [B+1] int64 offsets of each sequence's new tokens in the packed input
    ctx_lens: torch.Tensor  # [B] int64 tokens already in state / cache before this pass
    state_slots: torch.Tensor  # [B] int64 KDA pool slot of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32 MLA cache blocks of each sequence
    slot_mapping: torch.Tensor  # [T] int64 flat cache position (block * block_size + offset) of each new token
    is_decode: bool  # every sequence has exactly one new token
    snapshots: StateSnapshots | None = None  # KDA states to copy out inside this (prefill) pass


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input: the batch layout, the pools and the op backend."""

    batch: ForwardBatch
    kda_pool: KDAStateLayers
    kv_cache: MLACacheLayers
    ops: Ops
