"""Decode-sized linears of Kimi-Linear-48B on one GPU: the Triton skinny GEMM (`linear` op of the Triton backend,
shard_svc/ops/triton/linear.py) against F.linear (cuBLAS), next to the copy bandwidth measured in the same run.

    PYTHONPATH=$PWD python -m bench.linear_micro --out DIR [--m 1,4,16] [--sweep] [--no-graph]

Shapes and counts come from the model itself (`decode_linears`: built on the meta device from bench/configs.py),
as a decode step runs them: each group of weights the runner packs (q/k/v, ...) as its one product, MLA's kv_b_proj left
out (the attention op reads that weight), lm_head once. For every (N, K) and M: microseconds per call
(triton.testing.do_bench, median; L2 is flushed between calls, as a decode step finds it: each weight is read once
per step), achieved GB/s of weight bytes (x and y are a rounding error next to them), % of the copy bandwidth, and
the largest |ours - cuBLAS| over the largest |cuBLAS|. Per M, one decode step's linears:
  - sum: each shape's time x its calls per step (the two columns of the table added up);
  - graph: every call of a step over its own weights (3.2 GB, far past L2), captured as one CUDA graph and replayed,
    which adds the gaps between kernels as serving sees them;
  - floor: the step's weight bytes at the copy bandwidth.
--sweep also times other tiles (block_n x splits) per shape and M and reports the fastest, to retune skinny_config.
Writes linear_micro.json to --out (default $OUT, else bench_out) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench.configs import KIMI_LINEAR_48B
from bench.measure import copy_bytes_per_s, gpu_ms
from shard_svc.config import ModelConfig
from shard_svc.model import KimiForCausalLM
from shard_svc.model.layers import Linear, PackedWeights

log = logging.getLogger(__name__)

ABSORBED = ("kv_b_proj",)  # MLA reads kv_b_proj's weight inside its attention op, never as a linear
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_SPLITS = (1, 2, 4, 8)

Timer = Callable[[Callable[[], object]], float]  # fn -> milliseconds per call


@dataclass(frozen=True)
class LinearUse:
    role: str  # e.g. "kda.q_proj+k_proj+v_proj (packed)", "block_sparse_moe.shared_experts.down_proj", "lm_head"
    n: int
    k: int
    count: int  # calls per decode step


def decode_linears(cfg: ModelConfig) -> list[LinearUse]:
    """Every linear call of one decode step, grouped by role and shape, from the model built on the meta device.
    A group that `pack_weights` packs (`PackedWeights.packed_groups`) is one call over its members' rows."""
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16)
    names = {id(module): name for name, module in model.named_modules()}
    grouped: dict[int, tuple[Linear, ...]] = {}  # first member -> its group; other members are skipped
    for module in model.modules():
        if isinstance(module, PackedWeights):
            for group in module.packed_groups():
                if all(isinstance(m, Linear) for m in group):
                    grouped.update({id(m): () for m in group[1:]})
                    grouped[id(group[0])] = group
    counts: Counter[tuple[str, int, int]] = Counter()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name.endswith(ABSORBED) or grouped.get(id(module), None) == ():
            continue
        group = grouped.get(id(module), (module,))
        n, k = sum(m.weight.shape[0] for m in group), module.weight.shape[1]
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            counts[(name, n, k)] += 1
            continue
        kind, rest = cfg.layer_kinds[int(parts[2])], parts[3:]
        if rest[0] == "self_attn":
            rest = [kind, *rest[1:]]
        if len(group) > 1:
            rest = [*rest[:-1], "+".join(names[id(m)].rsplit(".", 1)[-1] for m in group) + " (packed)"]
        counts[(".".join(rest), n, k)] += 1
    if cfg.tie_word_embeddings:  # logits against the embedding: one more linear
        counts[("lm_head (tied embedding)", cfg.vocab_size, cfg.hidden_size)] += 1
    return [LinearUse(role, n, k, c) for (role, n, k), c in counts.items()]


def gpu_timer(fn: Callable[[], object]) -> float:
    return gpu_ms(fn, warmup=10, rep=50)


def wall_timer(fn: Callable[[], object], reps: int = 2) -> float:
    """CPU smoke runs (the interpreter): wall-clock milliseconds, no cache flush."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(dtype)
    w = (torch.randn(n, k, generator=g, device=device) * k**-0.5).to(dtype)
    return x, w


def time_shape(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, timer: Timer,
               copy_GBps: float) -> dict:
    from shard_svc.ops.triton import linear as tl_linear
    from shard_svc.ops.triton.common import sm_count

    x, w = _inputs(m, n, k, dtype, device)
    ours, ref = tl_linear.linear(x, w), F.linear(x, w)
    err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    weight_bytes = n * k * w.element_size()
    row = {"n": n, "k": k, "m": m, "weight_MB": weight_bytes / 1e6, "max_rel_err": err,
           "config": asdict(tl_linear.skinny_config(n, k, w.element_size(), sm_count(x.device)))}
    for name, fn in (("ours", lambda: tl_linear.linear(x, w)), ("cublas", lambda: F.linear(x, w))):
        ms = timer(fn)
        gbps = weight_bytes / (ms * 1e-3) / 1e9
        row[name] = {"us": ms * 1e3, "GBps": gbps, "pct_copy": 100 * gbps / copy_GBps}
    return row


def sweep_shape(n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, timer: Timer) -> dict:
    """Every (block_n, splits) tile for one shape; the fastest first."""
    import triton

    from shard_svc.ops.triton import linear as tl_linear

    x, w = _inputs(m, n, k, dtype, device)
    elem = w.element_size()
    ref = F.linear(x, w).float()
    tried = []
    for block_n in SWEEP_BLOCK_N:
        for splits in SWEEP_SPLITS:
            cfg = tl_linear.tile_config(k, elem, block_n, splits)
            if splits > triton.cdiv(k, cfg.block_k):
                continue
            out = tl_linear.skinny_linear(x, w, cfg).float()
            err = float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
            tried.append({**asdict(cfg), "us": timer(lambda: tl_linear.skinny_linear(x, w, cfg)) * 1e3,
                          "max_rel_err": err})
    tried.sort(key=lambda r: r["us"])
    return {"n": n, "k": k, "m": m, "tried": tried}


def graph_step(uses: list[LinearUse], m: int, dtype: torch.dtype, device: torch.device, timer: Timer) -> dict:
    """One decode step's linears, each call on its own weight, captured as one CUDA graph per implementation (ours
    also captured with programmatic dependent launch off, `ours_no_pdl`)."""
    from shard_svc.ops.triton import common, linear as tl_linear

    weights = [(torch.randn(u.n, u.k, device=device) * u.k**-0.5).to(dtype) for u in uses for _ in range(u.count)]
    xs = {k: torch.randn(m, k, device=device).to(dtype) for k in {u.k for u in uses}}
    result = {"m": m, "calls": len(weights), "weight_GB": sum(w.numel() * w.element_size() for w in weights) / 1e9}
    for name, fn, pdl in (("ours", tl_linear.linear, True), ("ours_no_pdl", tl_linear.linear, False),
                          ("cublas", F.linear, True)):
        def step(fn=fn):
            for w in weights:
                fn(xs[w.shape[1]], w)

        common.USE_PDL = pdl
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
                step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
        finally:
            common.USE_PDL = True
        result[f"{name}_ms"] = timer(graph.replay)
        del graph
    return result


def run(cfg: ModelConfig, ms: list[int], dtype: torch.dtype, device: torch.device, timer: Timer,
        graph: bool, sweep: bool) -> dict:
    uses = decode_linears(cfg)
    copy_GBps = copy_bytes_per_s(device, timer, 1 << 30 if device.type == "cuda" else 1 << 20) / 1e9
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
                    "torch": torch.__version__, "dtype": str(dtype).removeprefix("torch."), "copy_GBps": copy_GBps,
                    "uses": [asdict(u) for u in uses], "shapes": [], "steps": [], "sweeps": []}
    shapes = sorted({(u.n, u.k) for u in uses})
    for m in ms:
        rows = {}
        for n, k in shapes:
            rows[(n, k)] = time_shape(n, k, m, dtype, device, timer, copy_GBps)
            result["shapes"].append(rows[(n, k)])
            if sweep:
                result["sweeps"].append(sweep_shape(n, k, m, dtype, device, timer))
        elem = torch.empty(0, dtype=dtype).element_size()
        step_bytes = sum(u.count * u.n * u.k * elem for u in uses)
        step = {"m": m, "calls": sum(u.count for u in uses), "weight_GB": step_bytes / 1e9,
                "floor_ms": step_bytes / (copy_GBps * 1e9) * 1e3,
                "sum_ours_ms": sum(u.count * rows[(u.n, u.k)]["ours"]["us"] for u in uses) / 1e3,
                "sum_cublas_ms": sum(u.count * rows[(u.n, u.k)]["cublas"]["us"] for u in uses) / 1e3}
        if graph:
            step["graph"] = graph_step(uses, m, dtype, device, timer)
        result["steps"].append(step)
        log.info("M=%d done", m)
    return result


def table(result: dict) -> str:
    roles: dict[tuple[int, int], list[str]] = {}
    for u in result["uses"]:
        roles.setdefault((u["n"], u["k"]), []).append(f"{u['role']} x{u['count']}")
    lines = [f"{result['device']}  torch {result['torch']}  {result['dtype']}  copy {result['copy_GBps']:.0f} GB/s",
             f"{'M':>3} {'N':>7} {'K':>5} {'ours us':>9} {'cuBLAS us':>10} {'speedup':>8} {'ours GB/s':>10} "
             f"{'%copy':>6} {'cuBLAS GB/s':>12} {'%copy':>6} {'rel err':>8}  tiles (block_n/block_k/splits)  uses"]
    for r in result["shapes"]:
        o, c, cfg = r["ours"], r["cublas"], r["config"]
        tiles = f"{cfg['block_n']}/{cfg['block_k']}/{cfg['splits']}"
        lines.append(f"{r['m']:>3} {r['n']:>7} {r['k']:>5} {o['us']:>9.1f} {c['us']:>10.1f} "
                     f"{c['us'] / o['us']:>7.2f}x {o['GBps']:>10.0f} {o['pct_copy']:>5.1f}% {c['GBps']:>12.0f} "
                     f"{c['pct_copy']:>5.1f}% {r['max_rel_err']:>8.1e}  {tiles:<31} "
                     f"{', '.join(roles[(r['n'], r['k'])])}")
    for s in result["steps"]:
        line = (f"decode step M={s['m']:<3} {s['calls']} linears, {s['weight_GB']:.2f} GB: floor {s['floor_ms']:.3f} ms"
                f" | sum ours {s['sum_ours_ms']:.3f} ms, cuBLAS {s['sum_cublas_ms']:.3f} ms")
        if "graph" in s:
            g = s["graph"]
            line += (f" | one CUDA graph ours {g['ours_ms']:.3f} ms ({100 * s['floor_ms'] / g['ours_ms']:.0f}% of "
                     f"floor; {g['ours_no_pdl_ms']:.3f} ms without PDL), cuBLAS {g['cublas_ms']:.3f} ms "
                     f"({100 * s['floor_ms'] / g['cublas_ms']:.0f}%)")
        lines.append(line)
    for sw in result["sweeps"]:
        best, chosen = sw["tried"][0], next(r for r in result["shapes"] if (r["n"], r["k"], r["m"]) ==
                                            (sw["n"], sw["k"], sw["m"]))
        lines.append(f"sweep M={sw['m']:<3} N={sw['n']:<7} K={sw['k']:<5} best {best['block_n']}/{best['block_k']}/"
                     f"{best['splits']} {best['us']:.1f} us vs chosen {chosen['ours']['us']:.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--m", default="1,4,16", help="token rows per call, comma-separated, each at most 16")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--sweep", action="store_true", help="also time other tiles per shape (several minutes)")
    p.add_argument("--no-graph", action="store_true", help="skip the whole-step CUDA graph (needs ~3.2 GB)")
    args = p.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    if not all(1 <= m <= 16 for m in ms):
        p.error(f"--m {args.m}: each M must be 1..16 (above 16 rows the `linear` op is F.linear itself)")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (tests/kernels/test_linear_bench_smoke.py runs the pieces on the CPU)")
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(ModelConfig.from_dict(KIMI_LINEAR_48B), ms, getattr(torch, args.dtype), torch.device("cuda"),
                 gpu_timer, graph=not args.no_graph, sweep=args.sweep)
    result["date"] = time.strftime("%Y-%m-%d")
    (args.out / "linear_micro.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (args.out / "linear_micro.txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
