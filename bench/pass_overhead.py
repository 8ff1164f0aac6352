"""Where an eager (non-graph) pass's wall time goes: device work, launches, host syncs and host Python.

Prefill passes are not CUDA graphs, so a small one (a chat's new user message after a restored system prompt, a
short prompt mixed beside a long one) costs what the host takes to launch the whole model's kernels. This measures
that floor at the 48B shape (dummy weights): a sequence with `--context` tokens already computed gets one pass of n
new tokens, for several n; beside it one eager decode step at batch 1. For each: the median wall time, the GPU's
busy time and launches (bench/kernel_profile.py), the host syncs the pass makes (torch's sync debug mode) and the
host functions that take the most time (cProfile; time spent waiting inside a sync shows up under that call).

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

from bench.configs import KIMI_LINEAR_48B
from shard_svc.config import ModelConfig
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

log = logging.getLogger("bench.pass_overhead")


def trimmed_config(layers: int | None) -> ModelConfig:
    """The 48B shape, optionally with fewer layers (an MLA layer every fourth, and the last); per-layer host cost
    is what this measures, so figures scale with the layer count."""
    raw = dict(KIMI_LINEAR_48B)
    if layers:
        full = sorted(set(range(4, layers + 1, 4)) | {layers})
        raw["num_hidden_layers"] = layers
        raw["linear_attn_config"] = dict(raw["linear_attn_config"], full_attn_layers=full,
                                         kda_layers=[i for i in range(1, layers + 1) if i not in full])
    return ModelConfig.from_dict(raw)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


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


def continuation(engine: Engine, context: int, new: int, tag: str) -> Callable[[], None]:
    """A pass of `new` tokens for a sequence with `context` tokens computed; rerunnable (the sequence is put back
    to `context` after each: its state is then a later one's, which does not change the work)."""
    prompt = [1 + (7919 * t) % 150000 for t in range(context + new)]
    seq = engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    engine.scheduler.schedule()  # admits: a slot and the prompt's KV blocks
    engine.runner.forward([(seq, context)], is_decode=False)

    def run() -> None:
        seq.num_computed = context
        engine.runner.forward([(seq, new)], is_decode=False)

    return run


def decode_step(engine: Engine, context: int, tag: str) -> Callable[[], None]:
    prompt = [1 + (104729 * t) % 150000 for t in range(context)]
    seq = engine.add_request(tag, prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    engine.scheduler.schedule()
    engine.runner.forward([(seq, context)], is_decode=False)
    seq.output = [7]
    engine.runner.kv_cache.reserve(tag, context + 64)

    def run() -> None:
        seq.num_computed = context
        engine.runner.forward([(seq, 1)], is_decode=True)

    return run


def format_table(result: dict) -> str:
    lines = [f"{'pass':>24} {'wall ms':>9} {'GPU busy ms':>12} {'launches':>9} {'syncs':>6}"]
    for row in result["passes"]:
        busy = f"{row['gpu_busy_ms']:.2f}" if "gpu_busy_ms" in row else "-"
        launches = f"{row['launches']:.0f}" if "launches" in row else "-"
        lines.append(f"{row['pass']:>24} {row['wall_ms']:9.2f} {busy:>12} {launches:>9} {row['host_syncs']:6d}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the 48B shape's 27")
    p.add_argument("--context", type=int, default=3712, help="tokens already computed before the timed pass")
    p.add_argument("--new", default="16,64,256,1024", help="new tokens of the timed passes, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cfg = trimmed_config(args.layers)
    from shard_svc.checkpoint.dummy import dummy_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = dummy_model(cfg, device, dtype)
    news = [int(n) for n in args.new.split(",")]
    engine_cfg = EngineConfig(num_state_slots=len(news) + 2, kv_block_size=64, prefill_token_budget=1 << 20,
                              num_kv_blocks=(len(news) + 1) * (args.context + max(news) + 64) // 64 + 8)
    engine = Engine(cfg, model, select_ops(device), device, engine_cfg)
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "layers": cfg.num_layers,
              "context": args.context, "op_backends": dict(engine.runner.ops.backends), "passes": []}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    runs = [(f"prefill +{n} after {args.context}", continuation(engine, args.context, n, f"pf{n}")) for n in news]
    runs.append(("eager decode, batch 1", decode_step(engine, args.context, "dc")))
    for name, fn in runs:
        row = {"pass": name, **measure(fn, device, args.reps)}
        result["passes"].append(row)
        log.info("%s: %.2f ms wall, %d host syncs", name, row["wall_ms"], row["host_syncs"])
        (args.out / "pass_overhead.json").write_text(json.dumps(result, indent=1))
    print(format_table(result), flush=True)
    for row in result["passes"]:
        print(f"\n{row['pass']}: host functions by own time", flush=True)
        for r in row["host_top"][:12]:
            print(f"  {r['own_ms']:8.2f} ms  x{r['calls']:<6d} {r['function'][:100]}", flush=True)


if __name__ == "__main__":
    main()
