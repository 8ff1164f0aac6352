"""LateKernels: Triton's kernel cache misses after the warm-up are counted on the shard's registry and logged by
kernel, the warm-up's own are not, a hook set before is still called, and the compile is never skipped."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from prometheus_client import generate_latest

from shard_svc.engine.late_kernels import LateKernels
from shard_svc.server.metrics import ShardMetrics


def test_misses_after_the_warm_up_are_counted_and_logged_by_kernel(caplog):
    from triton import knobs

    metrics, earlier = ShardMetrics("shard-0"), []
    assert 'kimiserve_shard_kernels_after_warmup_total{rank="0",shard="shard-0"} 0.0' in generate_latest(
        metrics.registry).decode(), "a shard that never met one shows 0"
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **kwargs: earlier.append(kwargs["fn"].name)  # another library's hook
    try:
        late = LateKernels(metrics.kernel_after_warmup)
        assert late.install()
        assert knobs.runtime.jit_cache_hook == late.hook

        def miss(name: str):  # the keywords Triton passes
            return knobs.runtime.jit_cache_hook(key=(), repr=f"{name}[num_warps=4](n: i32)", fn=SimpleNamespace(
                name=name), compile={}, is_manual_warmup=False, already_compiled=False)

        assert miss("_moe_gate_up_kernel") is None  # during the warm-up: not counted
        late.watch()
        with caplog.at_level(logging.WARNING, logger="shard_svc.engine.late_kernels"):
            results = [miss("_moe_gate_up_kernel"), miss("_conv_fwd_kernel"), miss("_conv_fwd_kernel")]
    finally:
        knobs.runtime.jit_cache_hook = saved
    assert results == [None, None, None], "a true answer would make Triton skip the compile"
    assert earlier == ["_moe_gate_up_kernel", "_moe_gate_up_kernel", "_conv_fwd_kernel", "_conv_fwd_kernel"]
    assert 'kimiserve_shard_kernels_after_warmup_total{rank="0",shard="shard-0"} 3.0' in generate_latest(
        metrics.registry).decode()
    logged = [r for r in caplog.records if r.name == "shard_svc.engine.late_kernels"]
    assert [r.kernel for r in logged] == ["_moe_gate_up_kernel", "_conv_fwd_kernel", "_conv_fwd_kernel"]
    assert logged[1].specialization == "_conv_fwd_kernel[num_warps=4](n: i32)"
