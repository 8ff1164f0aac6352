"""Where an eager (non-graph) pass's wall time goes: device work, launches, host syncs and host Python.

Prefill passes are not CUDA graphs, so a small one (a chat's new user message after a restored system prompt, a
short prompt mixed beside a long one) costs what the host takes to launch the whole model's kernels. This measures
that floor at the 48B shape (dummy weights): a sequence with `--context` tokens already computed gets one pass of n
new tokens, for several n, launched op by op and (up to 256 tokens) replayed from the prefill graphs
(shard_svc/engine/prefill_graphs.py); beside them a decode step at batch 1, eager and replayed. For each: the median
wall time, the GPU's busy time and launches (bench/kernel_profile.py), the host syncs the pass makes (torch's sync
debug mode) and the host functions that take the most time (cProfile; time spent waiting inside a sync shows up
under that call). The graph passes' logits are compared with the eager passes' from the same state.

    python -m bench.pass_overhead --out DIR [--layers 8] [--context 3712] [--new 16,64,256,1024]

Prints a table and writes DIR/pass_overhead.json. `--device cpu --layers 2` is a smoke run anywhere.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import pstats
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from bench.configs import KIMI_LINEAR_48B, with_layers
from shard_svc.config import ModelConfig
from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

log = logging.getLogger("bench.pass_overhead")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def dummy_48b(device: torch.device, layers: int | None) -> tuple[ModelConfig, torch.nn.Module]:
    """The 48B shape (or its first `layers` layers) with dummy weights: bf16 on a GPU, fp32 on the CPU."""
    from shard_svc.checkpoint.dummy import dummy_model

    cfg = ModelConfig.from_dict(with_layers(KIMI_LINEAR_48B, layers))
    return cfg, dummy_model(cfg, device, torch.bfloat16 if device.type == "cuda" else torch.float32)


def wall_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def host_syncs(fn: Callable[[], None], device: torch.device) -> int:
    """How many times one call makes the host wait for the device (torch warns once per synchronizing op)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def host_profile(fn: Callable[[], None], device: torch.device, top: int = 20) -> list[dict]:
    """The functions with the most host time of their own in one call (ms), with their call counts."""
    _sync(device)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    _sync(device)
    prof.disable()
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in pstats.Stats(prof).stats.items():
        where = f"{Path(file).name}:{line}" if line else file
        rows.append({"function": f"{where}({name})", "calls": calls, "own_ms": own * 1e3,
                     "cumulative_ms": cumulative * 1e3})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def measure(fn: Callable[[], None], device: torch.device, reps: int) -> dict:
    row = {"wall_ms": wall_ms(fn, device, reps), "host_syncs": host_syncs(fn, device),
           "host_top": host_profile(fn, device)}
    if device.type == "cuda":
        from bench.kernel_profile import kernel_profile

        prof = kernel_profile(fn, steps=2, top=8)
        row.update(gpu_busy_ms=prof["timeline_per_step"]["busy_us"] / 1e3, launches=prof["launches_per_step"],
                   top_kernels=prof["top"])
    return row


def continuation(engine: Engine, context: int, new: int, tag: str) -> Callable[[], list[torch.Tensor]]:
    """A pass of `new` tokens for a sequence with `context` tokens computed; rerunnable (the sequence is put back
    to `context` after each: its state is then a later one's, which does not change the work)."""
    prompt = [1 + (7919 * t) % min(150000, engine.cfg.vocab_size - 1) for t in range(context + new)]
    seq = engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    engine.scheduler.schedule()  # admits: a slot and the prompt's KV blocks
    if context:
        engine.runner.forward([(seq, context)], is_decode=False)

    def run() -> list[torch.Tensor]:
        seq.num_computed = context
        return engine.runner.forward([(seq, new)], is_decode=False)

    return run


def decode_step(engine: Engine, context: int, tag: str) -> Callable[[], list[torch.Tensor]]:
    prompt = [1 + (104729 * t) % min(150000, engine.cfg.vocab_size - 1) for t in range(context)]
    seq = engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    engine.scheduler.schedule()
    engine.runner.forward([(seq, context)], is_decode=False)
    seq.output = [7]
    engine.runner.kv_cache.reserve(tag, context + 64)

    def run() -> list[torch.Tensor]:
        seq.num_computed = context
        return engine.runner.forward([(seq, 1)], is_decode=True)

    return run


def eager(engine: Engine, fn: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
    """fn with the runner's graphs detached for the call."""
    def run() -> list[torch.Tensor]:
        runner = engine.runner
        saved = runner.graphs, runner.prefill_graphs
        runner.graphs = runner.prefill_graphs = None
        try:
            return fn()
        finally:
            runner.graphs, runner.prefill_graphs = saved
    return run


def graph_vs_eager(engine: Engine, context: int, new: int, decode: bool) -> dict:
    """The last row's logits of the same pass from the same state (two sequences with the same prompt), replayed
    and launched op by op."""
    if decode:
        by_graph, by_ops = decode_step(engine, context, "cmp-g"), decode_step(engine, context, "cmp-e")
    else:
        by_graph, by_ops = continuation(engine, context, new, "cmp-g"), continuation(engine, context, new, "cmp-e")
    a, b = by_graph()[0][-1].float(), eager(engine, by_ops)()[0][-1].float()
    engine.cancel("cmp-g")
    engine.cancel("cmp-e")
    return {"logits_max_abs_diff": float((a - b).abs().max()), "bitwise_equal": bool(torch.equal(a, b)),
            "argmax_equal": bool(a.argmax() == b.argmax())}


def split_invariance(engine: Engine, context: int, tail: int) -> dict:
    """A prompt's last logits three ways: one pass of context + tail; context, then the tail op by op; context, then
    the tail replayed from the prefill graphs. What a restored prefix's tail pass gives against a stack without the
    cache, with the graphs' padding (tail up to its bucket) and without."""
    whole = continuation(engine, 0, context + tail, "inv-whole")
    then_ops = continuation(engine, context, tail, "inv-ops")
    then_graphs = continuation(engine, context, tail, "inv-graphs")
    last = {"one_pass": eager(engine, whole)()[0][-1].float(),
            "tail_op_by_op": eager(engine, then_ops)()[0][-1].float()}
    if engine.runner.prefill_graphs is not None and engine.runner.prefill_graphs.fits([(None, tail)]):
        last["tail_graphs"] = then_graphs()[0][-1].float()
    for tag in ("inv-whole", "inv-ops", "inv-graphs"):
        engine.cancel(tag)
    ref = last["one_pass"]
    return {"context": context, "tail": tail, **{
        name: {"bitwise_equal": bool(torch.equal(x, ref)), "max_abs_diff": float((x - ref).abs().max()),
               "argmax_equal": bool(x.argmax() == ref.argmax())} for name, x in last.items() if name != "one_pass"}}


# Variants of the backend under which to repeat the split invariance: each eager reference alone among the Triton
# ops (the tails' rows then take the reference's rounding in that op, the same in both splits if it is invariant),
# the routed experts' M-block fixed (their tiles otherwise follow the pass size) and cuBLAS's bf16 reductions in fp32.
EAGER_SWAPS = ("kda_prefill", "short_conv", "gated_rms_norm", "rms_norm", "add_rms_norm", "glu", "moe_route",
               "moe_experts", "mla_cache_write", "mla_prefill")
INVARIANCE_VARIANTS = tuple(f"eager {op}" for op in EAGER_SWAPS) + ("experts' M-block 64", "fp32 GEMM reductions")


def applies(engine: Engine, name: str) -> bool:
    """Whether a variant changes anything on this engine (an eager backend has nothing to swap)."""
    backends = dict(engine.runner.ops.backends)
    if name.startswith("eager "):
        return not backends[name.removeprefix("eager ")].startswith("eager")
    if name == "experts' M-block 64":
        return backends["moe_experts"].startswith("triton")
    return engine.device.type == "cuda"


def under_variant(engine: Engine, name: str, fn: Callable[[], list]) -> list:
    """fn() with the engine's ops (or torch's GEMM setting) changed as INVARIANCE_VARIANTS' `name` says."""
    import dataclasses
    import functools

    from shard_svc.ops import EAGER

    ops, matmul = engine.runner.ops, torch.backends.cuda.matmul
    reduced = matmul.allow_bf16_reduced_precision_reduction
    if name.startswith("eager "):
        op = name.removeprefix("eager ")
        # the fused shared-expert op would keep the Triton experts: without it the model composes moe_experts
        extra = {"moe_experts_shared": None} if op == "moe_experts" else {}
        engine.runner.ops = dataclasses.replace(ops, **{op: EAGER[op]}, **extra)
    elif name == "experts' M-block 64":
        engine.runner.ops = dataclasses.replace(ops, moe_experts=functools.partial(ops.moe_experts, block_m=64),
                                                moe_experts_shared=None)
    elif name == "fp32 GEMM reductions":
        matmul.allow_bf16_reduced_precision_reduction = False
    else:
        raise ValueError(f"unknown invariance variant {name!r}")
    try:
        return fn()
    finally:
        engine.runner.ops = ops
        matmul.allow_bf16_reduced_precision_reduction = reduced


def invariance_text(row: dict) -> str:
    return f"context {row['context']} + tail {row['tail']} against one pass: " + "; ".join(
        f"{name} " + ("bitwise equal" if v["bitwise_equal"] else f"max |diff| {v['max_abs_diff']:.3g}, argmax "
                      + ("equal" if v["argmax_equal"] else "differs"))
        for name, v in row.items() if isinstance(v, dict))


def format_table(result: dict) -> str:
    lines = [f"{'pass':>26} {'wall ms':>9} {'GPU busy ms':>12} {'launches':>9} {'syncs':>6}  vs eager"]
    for row in result["passes"]:
        busy = f"{row['gpu_busy_ms']:.2f}" if "gpu_busy_ms" in row else "-"
        launches = f"{row['launches']:.0f}" if "launches" in row else "-"
        same = "" if "bitwise_equal" not in row else (
            "bitwise equal" if row["bitwise_equal"] else f"max |diff| {row['logits_max_abs_diff']:.3g}, argmax "
            + ("equal" if row["argmax_equal"] else "differs"))
        lines.append(f"{row['pass']:>26} {row['wall_ms']:9.2f} {busy:>12} {launches:>9} {row['host_syncs']:6d}  {same}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the 48B shape's 27")
    p.add_argument("--context", type=int, default=3712, help="tokens already computed before the timed pass")
    p.add_argument("--new", default="16,64,256,1024", help="new tokens of the timed passes, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tails", default="40,64,200",
                   help="split invariance: tails after --context, one pass against context then tail")
    p.add_argument("--invariance-sweep", action="store_true",
                   help="split invariance again (op by op) under each variant of INVARIANCE_VARIANTS: one op at a "
                        "time swapped for its eager reference, the experts' M-block fixed, bf16 GEMM reductions in "
                        "fp32; the variant under which a tail gives one pass's logits names the op that moves")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cfg, model = dummy_48b(device, args.layers)
    news = [int(n) for n in args.new.split(",")]
    engine_cfg = EngineConfig(num_state_slots=len(news) + 8, kv_block_size=64, prefill_token_budget=1 << 20,
                              num_kv_blocks=(len(news) + 7) * (args.context + max(news) + 3072) // 64 + 8)
    engine = Engine(cfg, model, select_ops(device), device, graph_engine_config(engine_cfg, device, False))
    graphs = enable_cuda_graphs(engine, buckets=(1,))
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "layers": cfg.num_layers,
              "context": args.context, "op_backends": dict(engine.runner.ops.backends), "passes": []}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    prefill_graphs = engine.runner.prefill_graphs
    runs = []
    for n in news:
        fn = continuation(engine, args.context, n, f"pf{n}")
        runs.append((f"prefill +{n} after {args.context}", eager(engine, fn), None))
        if prefill_graphs is not None and prefill_graphs.fits([(None, n)]):
            runs.append((f"prefill +{n}, graphs", fn, (n, False)))
    decode = decode_step(engine, args.context, "dc")
    runs.append(("decode, batch 1", eager(engine, decode), None))
    if graphs is not None:
        runs.append(("decode, batch 1, graphs", decode, (1, True)))
    for name, fn, compare in runs:
        row = {"pass": name, **measure(fn, device, args.reps)}
        if compare is not None:
            row.update(graph_vs_eager(engine, args.context, *compare))
        result["passes"].append(row)
        log.info("%s: %.2f ms wall, %d host syncs", name, row["wall_ms"], row["host_syncs"])
        (args.out / "pass_overhead.json").write_text(json.dumps(result, indent=1))
    tails = [int(t) for t in args.tails.split(",") if t]
    result["split_invariance"] = [split_invariance(engine, args.context, t) for t in tails]
    if args.invariance_sweep:
        engine.runner.prefill_graphs = None  # captured with the backend's own ops
        result["invariance_sweep"] = [{"variant": name, "rows": under_variant(engine, name, lambda: [
            split_invariance(engine, args.context, t) for t in tails])} for name in INVARIANCE_VARIANTS
            if applies(engine, name)]
        engine.runner.prefill_graphs = prefill_graphs
    (args.out / "pass_overhead.json").write_text(json.dumps(result, indent=1))
    print(format_table(result), flush=True)
    for label, rows in [("", result["split_invariance"])] + [
            (f"{v['variant']}: ", v["rows"]) for v in result.get("invariance_sweep", [])]:
        for row in rows:
            print(f"{label}{invariance_text(row)}", flush=True)
    for row in result["passes"]:
        print(f"\n{row['pass']}: host functions by own time", flush=True)
        for r in row["host_top"][:12]:
            print(f"  {r['own_ms']:8.2f} ms  x{r['calls']:<6d} {r['function'][:100]}", flush=True)


if __name__ == "__main__":
    main()
