"""Where a step's GPU time goes: per-kernel device time from the PyTorch profiler (CUPTI), graph replays included,
and the device's idle time between kernels (the launch gaps a host-bound step leaves).

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
    kernels = [(ev.time_range.start, ev.time_range.end) for ev in prof.events()
               if ev.device_type == torch.autograd.DeviceType.CUDA and ev.time_range.end > ev.time_range.start]
    return {"gpu_us_per_step": total, "kernels": len(rows),
            "launches_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:top],
            "timeline_per_step": {k: v / steps for k, v in timeline(kernels).items()} if kernels else None}


def timeline(intervals: list[tuple[float, float]]) -> dict[str, float]:
    """Device intervals (start, end) of kernels -> span from the first start to the last end, busy time (their
    union: concurrent kernels count once), idle time inside the span, and the idle time in gaps over 5 us (launch
    gaps rather than the scheduling between back-to-back kernels)."""
    spans = sorted(intervals)
    busy = idle = long_idle = 0.0
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            idle += start - cur_end
            long_idle += start - cur_end if start - cur_end > 5.0 else 0.0
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return {"span_us": cur_end - spans[0][0], "busy_us": busy, "idle_us": idle, "idle_in_gaps_over_5us": long_idle}


def format_profile(title: str, prof: dict) -> list[str]:
    lines = [f"{title}: {prof['gpu_us_per_step']:.0f} us of kernels per step, "
             f"{prof['launches_per_step']:.0f} launches, {prof['kernels']} distinct kernels"]
    if prof.get("timeline_per_step"):
        t = prof["timeline_per_step"]
        lines.append(f"  device busy {t['busy_us']:.0f} of {t['span_us']:.0f} us per step; idle {t['idle_us']:.0f} us "
                     f"({t['idle_in_gaps_over_5us']:.0f} in gaps over 5 us)")
    for r in prof["top"]:
        lines.append(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:<6.0f} {r['kernel']}")
    return lines
