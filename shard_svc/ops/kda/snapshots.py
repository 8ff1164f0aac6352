"""A prefill batch's snapshot points in the form the kda_prefill ops and the KDA layer's conv copy read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
