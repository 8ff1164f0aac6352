"""Where a step's GPU time goes: per-kernel device time from the PyTorch profiler (CUPTI), graph replays included.

Used by the benchmarks to say what dominates a measured step (the README's "where the time goes" notes).
"""

from __future__ import annotations

from typing import Callable

import torch


def kernel_profile(step: Callable[[], None], steps: int = 3, top: int = 25) -> dict:
    """Runs `step` `steps` times under the profiler; returns per-step GPU time by kernel, largest first."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        device_us = getattr(ev, "self_device_time_total", None)
        if device_us is None:
            device_us = ev.self_cuda_time_total
        if device_us > 0:
            rows.append({"kernel": ev.key[:120], "us_per_step": device_us / steps, "calls_per_step": ev.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    return {"gpu_us_per_step": total, "kernels": len(rows),
            "launches_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top]}


def format_profile(title: str, prof: dict) -> list[str]:
    lines = [f"{title}: {prof['gpu_us_per_step']:.0f} us of kernels per step, "
             f"{prof['launches_per_step']:.0f} launches, {prof['kernels']} distinct kernels"]
    for r in prof["top"]:
        lines.append(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:<6.0f} {r['kernel']}")
    return lines
