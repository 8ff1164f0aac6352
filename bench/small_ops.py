"""Small ops that showed up in the prefill / decode profiles, ours (Triton) beside the eager references (one GPU).

    python -m bench.small_ops [--out DIR] [--sweep] [--profile] [--skip conv,route,norm,glu]

short_conv prefill (Kimi-Linear-48B: C = q|k|v = 12288 channels, W = 4, bf16): T = 4096 and 32768 tokens packed as
B = 1 or 8 equal sequences. Reports ms per call for ours and the eager op, the bytes the op must move (x read, out
written, weights, old state read and new state written) over our time, and that as a fraction of a device-to-device
copy measured in the same run. Agreement: relative L2 error of the output and exact equality of the new state.

moe_route (E = 256 experts, top_k = 8, D = 2304, bf16): T = 1, 16, 64, 256, 4096. Per call: do_bench of one call
(includes the host launch path, which dominates at small T) and CUDA-graph replays of calls over distinct gate
weights totalling several times the L2 (the device time a captured decode step sees). Agreement: the fraction of
tokens whose chosen experts are identical (in order) to the eager router's, and the relative error of the weights.

add_rms_norm (D = 2304, bf16; the residual add and the next block's input norm, 54 of each per 48B decode step):
T = 1, 16, 64, 256, 8192 rows. CUDA-graph replays of 54 calls over distinct buffers: ours fused (one kernel),
unfused (torch's add, then our rms_norm: what the model ran before) and eager (add, then the eager norm).
Agreement: the sum bitwise equal to torch's add, the normed output's relative error vs eager.

glu (SwiGLU of the shared experts and the dense MLP, I = 1024 / 9216, bf16; 27 per decode step): T = 1, 16, 64,
256, 8192 rows of gate and up as the column halves of one product. Graph replays of ours (one kernel) and eager
(silu, then the product). Agreement: the share of elements bitwise equal to eager and the relative error.

--sweep also times short_conv tilings at B=8 x 4096 (T=32768), and moe_route splits of D and tokens per top-k
program at T <= 256; --profile adds
per-kernel device time (PyTorch profiler). Prints a table and writes small_ops.json to --out (default $OUT, else
bench_out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.measure import copy_bytes_per_s, gpu_ms, graph_us  # noqa: E402

C, W = 12288, 4
CONV_SHAPES = [(1, 4096), (8, 4096), (1, 32768), (8, 32768)]  # (B, total tokens)
CONV_DETAIL = (8, 32768)  # the shape --sweep and --profile look at (the profiled 8 x 4096 prefill)
E, TOP_K, D = 256, 8, 2304
ROUTE_T = [1, 16, 64, 256, 4096]
NORM_T = [1, 16, 64, 256, 8192]
NORMS_PER_STEP = 54  # 48B: two residual adds per layer, each followed by a norm
GLU_WIDTHS = (1024, 9216)  # the shared experts' intermediate (26 per step), the dense MLP's (1)
GLUS_PER_STEP = 27
L2_BYTES = 60 << 20  # H100/H200 L2 is 50-60 MB; graph replays cycle through >= 3x this


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float("inf") if not a.isfinite().all() else ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def conv_rows(dev, copy: float, sweep: bool, profile: bool) -> list[dict]:
    import torch

    from bench.kernel_profile import format_profile, kernel_profile
    from shard_svc.ops import conv
    from shard_svc.ops.triton.short_conv import short_conv

    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    weight = (torch.randn(C, W, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    for b, t in CONV_SHAPES:
        x = torch.randn(t, C, device=dev, generator=g).to(torch.bfloat16)
        cu = torch.arange(b + 1, device=dev, dtype=torch.int64) * (t // b)
        slots = torch.arange(b, device=dev) * 2 + 1  # a pool with unused slots between the used ones
        pool0 = torch.randn(2 * b + 1, C, W - 1, device=dev, generator=g).to(torch.bfloat16)
        row = {"B": b, "T": t}
        ours_pool, ref_pool = pool0.clone(), pool0.clone()
        out = short_conv(x, weight, ours_pool, slots, cu)
        ref = conv.short_conv(x, weight, ref_pool, slots, cu)
        row["err_out_vs_eager"] = rel(out, ref)
        row["state_equal"] = bool(torch.equal(ours_pool, ref_pool))
        del ref, ref_pool
        pool = pool0.clone()  # the timed calls keep rewriting it; only the time matters from here on
        row["ours_ms"] = gpu_ms(lambda: short_conv(x, weight, pool, slots, cu))
        row["eager_ms"] = gpu_ms(lambda: conv.short_conv(x, weight, pool, slots, cu), warmup=2, rep=10)
        moved = 2 * t * C * 2 + C * W * 2 + 2 * b * C * (W - 1) * 2  # x, out, weights, old + new state (bf16)
        row["bytes"] = moved
        row["ours_TBps"] = moved / (row["ours_ms"] * 1e-3) / 1e12
        row["ours_frac_copy"] = row["ours_TBps"] / copy
        row["speedup_vs_eager"] = row["eager_ms"] / row["ours_ms"]
        if sweep and (b, t) == CONV_DETAIL:
            row["sweep_ms"] = {}
            for bt in (4, 8, 16):
                for nb in (1, 2, 4, 8, 16):
                    for warps in (1, 2, 4, 8):
                        key = f"bt{bt}_x{nb}_w{warps}"
                        try:
                            row["sweep_ms"][key] = gpu_ms(lambda: short_conv(
                                x, weight, pool, slots, cu, block_t=bt, tiles_per_program=nb, num_warps=warps))
                        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported
                            row["sweep_ms"][key] = f"{type(e).__name__}: {str(e)[:120]}"
            ok = {k: v for k, v in row["sweep_ms"].items() if isinstance(v, float)}
            row["sweep_best"] = min(ok, key=ok.get) if ok else None
        if profile and (b, t) == CONV_DETAIL:
            row["ours_profile"] = kernel_profile(lambda: short_conv(x, weight, pool, slots, cu), top=6)
            print("\n".join(format_profile(f"short_conv B={b} T={t}", row["ours_profile"])), flush=True)
        print("short_conv", json.dumps({k: v for k, v in row.items() if k not in ("sweep_ms", "ours_profile")}),
              flush=True)
        rows.append(row)
        del x, out, pool, ours_pool
        torch.cuda.empty_cache()
    return rows


def route_rows(dev, copy: float, sweep: bool, profile: bool) -> list[dict]:
    import torch

    from bench.kernel_profile import format_profile, kernel_profile
    from shard_svc.ops.moe import eager
    from shard_svc.ops.triton.moe_route import moe_route

    rows = []
    g = torch.Generator(device=dev).manual_seed(1)
    gate_bytes = E * D * 2
    reps = max(8, -(-3 * L2_BYTES // gate_bytes))
    gates = [(torch.randn(E, D, device=dev, generator=g) * D**-0.5).to(torch.bfloat16) for _ in range(reps)]
    bias = torch.randn(E, device=dev, generator=g) * 0.5
    args = (TOP_K, True, 2.446)
    for t in ROUTE_T:
        x = torch.randn(t, D, device=dev, generator=g).to(torch.bfloat16)
        gate = gates[0]
        row = {"T": t}
        w, ids = moe_route(x, gate, bias, *args)
        ref_w, ref_ids = eager.moe_route(x, gate, bias, *args)
        same = (ids == ref_ids).all(dim=1)
        row["ids_equal_frac"] = same.float().mean().item()
        row["err_weights_vs_eager"] = rel(w[same], ref_w[same]) if same.any() else float("nan")
        row["ours_us"] = gpu_ms(lambda: moe_route(x, gate, bias, *args)) * 1e3
        row["eager_us"] = gpu_ms(lambda: eager.moe_route(x, gate, bias, *args)) * 1e3
        n_calls = reps if t <= 256 else 8  # at large T one call already streams far more than L2
        row["ours_graph_us"] = graph_us([lambda gw=gw: moe_route(x, gw, bias, *args) for gw in gates[:n_calls]])
        row["eager_graph_us"] = graph_us([lambda gw=gw: eager.moe_route(x, gw, bias, *args)
                                          for gw in gates[:n_calls]])
        row["graph_speedup_vs_eager"] = row["eager_graph_us"] / row["ours_graph_us"]
        moved = gate_bytes + t * D * 2 + t * TOP_K * 12  # gate weight, x, weights (fp32) + ids (int64)
        row["ours_graph_frac_copy"] = moved / (row["ours_graph_us"] * 1e-6) / 1e12 / copy
        if sweep and t <= 256:
            row["sweep_graph_us"] = {}
            for split in (1, 2, 3, 6, 9, 18):
                row["sweep_graph_us"][f"split{split}"] = graph_us(
                    [lambda gw=gw, s=split: moe_route(x, gw, bias, *args, split_k=s) for gw in gates[:n_calls]])
            for per in (1, 2, 4, 16, 64):  # tokens per top-k program: one program for 16 serialises its arg-maxes
                if per <= max(t, 1) * 4:
                    row["sweep_graph_us"][f"topk_rows{per}"] = graph_us(
                        [lambda gw=gw, r=per: moe_route(x, gw, bias, *args, topk_rows=r) for gw in gates[:n_calls]])
        if profile and t in (1, 4096):
            row["ours_profile"] = kernel_profile(lambda: moe_route(x, gate, bias, *args), top=6)
            print("\n".join(format_profile(f"moe_route T={t}", row["ours_profile"])), flush=True)
        print("moe_route", json.dumps({k: v for k, v in row.items() if k not in ("sweep_graph_us", "ours_profile")}),
              flush=True)
        rows.append(row)
    return rows


def add_norm_rows(dev, copy: float) -> list[dict]:
    import torch

    from shard_svc.ops import norm
    from shard_svc.ops.triton.norm import add_rms_norm, rms_norm

    def unfused(x, r, w, eps):
        h = r + x
        return rms_norm(h, w, eps), h

    rows = []
    g = torch.Generator(device=dev).manual_seed(2)
    weight = (1 + 0.1 * torch.randn(D, device=dev, generator=g)).to(torch.bfloat16)
    for t in NORM_T:
        calls = NORMS_PER_STEP if t <= 256 else 4
        pairs = [(torch.randn(t, D, device=dev, generator=g).to(torch.bfloat16),
                  torch.randn(t, D, device=dev, generator=g).to(torch.bfloat16)) for _ in range(calls)]
        x, r = pairs[0]
        normed, h = add_rms_norm(x, r, weight, 1e-5)
        ref_normed, ref_h = norm.add_rms_norm(x, r, weight, 1e-5)
        row = {"T": t, "sum_equal": bool(torch.equal(h, ref_h)), "err_normed_vs_eager": rel(normed, ref_normed)}
        for name, fn in (("fused", add_rms_norm), ("unfused", unfused), ("eager", norm.add_rms_norm)):
            row[f"{name}_graph_us"] = graph_us([lambda x=x, r=r, fn=fn: fn(x, r, weight, 1e-5) for x, r in pairs])
        row["speedup_vs_unfused"] = row["unfused_graph_us"] / row["fused_graph_us"]
        row["fused_frac_copy"] = 4 * t * D * 2 / (row["fused_graph_us"] * 1e-6) / 1e12 / copy
        print("add_rms_norm", json.dumps(row), flush=True)
        rows.append(row)
        del pairs
    return rows


def glu_rows(dev, copy: float) -> list[dict]:
    import torch

    from shard_svc.ops import activations
    from shard_svc.ops.triton.glu import glu

    rows = []
    g = torch.Generator(device=dev).manual_seed(3)
    for inter in GLU_WIDTHS:
        for t in NORM_T:
            calls = GLUS_PER_STEP if t <= 256 else 4
            halves = [(3 * torch.randn(t, 2 * inter, device=dev, generator=g)).to(torch.bfloat16).split(inter, -1)
                      for _ in range(calls)]
            gate, up = halves[0]
            out, ref = glu(gate, up, "silu", (1.0, 1.0)), activations.glu(gate, up, "silu", (1.0, 1.0))
            row = {"I": inter, "T": t, "equal_frac": (out == ref).float().mean().item(), "err_vs_eager": rel(out, ref)}
            for name, fn in (("ours", glu), ("eager", activations.glu)):
                row[f"{name}_graph_us"] = graph_us([lambda a=a, b=b, fn=fn: fn(a, b, "silu", (1.0, 1.0))
                                                    for a, b in halves])
            row["speedup_vs_eager"] = row["eager_graph_us"] / row["ours_graph_us"]
            row["ours_frac_copy"] = 3 * t * inter * 2 / (row["ours_graph_us"] * 1e-6) / 1e12 / copy
            print("glu", json.dumps(row), flush=True)
            rows.append(row)
            del halves
    return rows


def table(res: dict) -> str:
    lines = [f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  copy {res['copy_TBps']:.2f} TB/s", ""]
    if res["short_conv"]:
        lines.append(f"short_conv prefill C={C} W={W} bf16")
        lines.append(f"  {'shape':<14}{'ours ms':>9}{'eager ms':>10}{'speedup':>9}{'TB/s':>7}{'of copy':>9}"
                     f"{'err out':>9}  state ==")
        for r in res["short_conv"]:
            lines.append(f"  {'B=%d T=%d' % (r['B'], r['T']):<14}{r['ours_ms']:9.3f}{r['eager_ms']:10.3f}"
                         f"{r['speedup_vs_eager']:8.1f}x{r['ours_TBps']:7.2f}{r['ours_frac_copy']:9.1%}"
                         f"{r['err_out_vs_eager']:9.1e}  {r['state_equal']}")
            if r.get("sweep_best"):
                best = r["sweep_best"]
                lines.append(f"    sweep best {best}: {r['sweep_ms'][best]:.3f} ms")
    if res["moe_route"]:
        lines += ["", f"moe_route E={E} k={TOP_K} D={D} bf16 (us per call)",
                  f"  {'':<8}{'do_bench: ours':>15}{'eager':>8} | {'graph: ours':>11}{'eager':>8}{'speedup':>9}"
                  f"{'of copy':>9} | {'ids equal':>9}{'err w':>9}"]
        for r in res["moe_route"]:
            lines.append(f"  {'T=%d' % r['T']:<8}{r['ours_us']:15.1f}{r['eager_us']:8.1f} | {r['ours_graph_us']:11.1f}"
                         f"{r['eager_graph_us']:8.1f}{r['graph_speedup_vs_eager']:8.1f}x"
                         f"{r['ours_graph_frac_copy']:9.1%} | {r['ids_equal_frac']:9.2%}"
                         f"{r['err_weights_vs_eager']:9.1e}")
            if r.get("sweep_graph_us"):
                settings = "  ".join(f"{k} {v:.1f}" for k, v in r["sweep_graph_us"].items())
                lines.append(f"    graph us by setting: {settings}")
    if res["add_rms_norm"]:
        lines += ["", f"add_rms_norm D={D} bf16 (graph us per call, {NORMS_PER_STEP} calls replayed)",
                  f"  {'':<8}{'fused':>8}{'unfused':>9}{'eager':>8}{'speedup':>9}{'of copy':>9}{'sum ==':>8}"
                  f"{'err':>9}"]
        for r in res["add_rms_norm"]:
            lines.append(f"  {'T=%d' % r['T']:<8}{r['fused_graph_us']:8.1f}{r['unfused_graph_us']:9.1f}"
                         f"{r['eager_graph_us']:8.1f}{r['speedup_vs_unfused']:8.2f}x{r['fused_frac_copy']:9.1%}"
                         f"{str(r['sum_equal']):>8}{r['err_normed_vs_eager']:9.1e}")
    if res["glu"]:
        lines += ["", f"glu silu bf16 (graph us per call, {GLUS_PER_STEP} calls replayed)",
                  f"  {'':<16}{'ours':>8}{'eager':>8}{'speedup':>9}{'of copy':>9}{'equal':>8}{'err':>9}"]
        for r in res["glu"]:
            lines.append(f"  {'I=%d T=%d' % (r['I'], r['T']):<16}{r['ours_graph_us']:8.1f}{r['eager_graph_us']:8.1f}"
                         f"{r['speedup_vs_eager']:8.2f}x{r['ours_frac_copy']:9.1%}{r['equal_frac']:8.1%}"
                         f"{r['err_vs_eager']:9.1e}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for small_ops.json")
    ap.add_argument("--sweep", action="store_true", help="also time short_conv tilings and moe_route splits")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of ours (PyTorch profiler)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: conv,route,norm,glu")
    a = ap.parse_args()

    import torch
    import triton

    if not torch.cuda.is_available():
        sys.exit("bench.small_ops needs a CUDA device")
    dev = torch.device("cuda")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "small_ops.json")
    skip = set(a.skip.split(","))
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "short_conv": [], "moe_route": [], "add_rms_norm": [], "glu": [],
           "copy_TBps": copy_bytes_per_s(dev, lambda fn: gpu_ms(fn, warmup=50, rep=200)) / 1e12}
    if "route" not in skip:
        res["moe_route"] = route_rows(dev, res["copy_TBps"], a.sweep, a.profile)
        json.dump(res, open(path, "w"), indent=1)
    if "norm" not in skip:
        res["add_rms_norm"] = add_norm_rows(dev, res["copy_TBps"])
        json.dump(res, open(path, "w"), indent=1)
    if "glu" not in skip:
        res["glu"] = glu_rows(dev, res["copy_TBps"])
        json.dump(res, open(path, "w"), indent=1)
    if "conv" not in skip:
        res["short_conv"] = conv_rows(dev, res["copy_TBps"], a.sweep, a.profile)
        json.dump(res, open(path, "w"), indent=1)
    print(table(res))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
