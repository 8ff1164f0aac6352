"""Host memory for what the shard keeps off the device (streamed weights, offloaded KV pages): how much the host
has, a check against it and a pinned budget before anything is allocated, and page-locked buffers of exact size.

On a CUDA machine buffers are page-locked with cudaHostRegister (exact size; torch's pinned caching allocator would
round a 16 GiB buffer up to 32 GiB), so copies from them are asynchronous DMA.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shard_svc.errors import CapacityError

log = logging.getLogger(__name__)

GiB = float(1 << 30)


class HostMemoryError(CapacityError):
    """Host (pinned) memory is too small for what was asked (streamed weights, a host KV pool); the message names
    the sizes."""


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(need: int, budget: int | None, what: str) -> None:
    """Raises HostMemoryError when `need` bytes exceed the pinned budget or the host's available memory."""
    available = host_available_bytes()
    if budget is not None and need > budget:
        raise HostMemoryError(f"{what} needs {need / GiB:.2f} GiB of pinned host memory; the pinned-memory budget is "
                              f"{budget / GiB:.2f} GiB (host has {_gib(available)} available)")
    if available is not None and need > available:
        raise HostMemoryError(f"{what} needs {need / GiB:.2f} GiB of host memory; the host has {available / GiB:.2f} "
                              f"GiB available")


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / GiB:.2f} GiB"


def alloc_host(nbytes: int, pinned: bool) -> tuple[torch.Tensor, bool]:
    """(uint8 buffer, registered with CUDA). Pinned: page-locked in place, exact size."""
    buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
    if not pinned:
        return buf, False
    register = getattr(torch.cuda.cudart(), "cudaHostRegister", None)
    if register is None:  # an old binding: torch's pinned allocator (rounds sizes up to a power of two)
        log.warning("torch.cuda.cudart() has no cudaHostRegister; pinning %.2f GiB with torch's pinned allocator",
                    nbytes / GiB)
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True), False
    rc = register(buf.data_ptr(), buf.numel(), 0)
    if int(rc) != 0:
        raise HostMemoryError(f"cannot page-lock {nbytes / GiB:.2f} GiB of host memory (cudaHostRegister returned "
                              f"{rc}); lower --pinned-memory-gb (streamed layers) or --host-kv-gb (offloaded KV pages)")
    return buf, True
