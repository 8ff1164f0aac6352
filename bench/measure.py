"""Timing helpers and the copy-bandwidth ceiling shared by the GPU benchmarks.

Every benchmark compares against a ceiling measured in the same run; this is that ceiling's one definition.
"""

from __future__ import annotations

from typing import Callable

import torch


def gpu_ms(fn: Callable[[], object], warmup: int = 10, rep: int = 60) -> float:
    """Median milliseconds of fn() (triton's do_bench: L2 flushed between repetitions)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bytes_per_s(device: torch.device | str = "cuda", timer: Callable[[Callable[[], object]], float] = gpu_ms,
                     nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second) of an `nbytes` buffer; `timer` returns
    milliseconds per call (a wall-clock timer lets CPU smoke runs use this too)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    ms = timer(lambda: b.copy_(a))
    return 2 * nbytes / (ms * 1e-3)


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Median microseconds per call from CUDA-graph replays of `calls` (zero-argument callables) back to back.

    Callers pass calls over distinct buffers totalling several times the L2, so data comes from HBM as in a real
    decode step (no per-call L2 flush inside a graph).
    """
    calls[0]()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in calls:  # warm up on the capture stream (compiles, allocator pools)
            c()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
    torch.cuda.synchronize()
    return gpu_ms(graph.replay, warmup=10, rep=100) * 1e3 / len(calls)
