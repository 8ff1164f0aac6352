"""The lengths of a pass's sequences on the host, beside the device tensors every op takes (ForwardBatch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostLengths:
    """A batch's cu_seqlens and ctx_lens as host lists, which the runner has anyway: an op that lays out its work on
    the host (the MLA prefill) reads these instead of copying the device tensors back, a sync that would stop the
    host from queueing work ahead of the GPU."""

    cu_seqlens: list[int]
    ctx_lens: list[int]
