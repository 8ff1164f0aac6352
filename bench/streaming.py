"""Weight-streaming benchmark on one GPU: a slice of Kimi-K3 at full width, its layers streamed from pinned host memory.

    python -m bench.streaming --out bench_out       # prints a table, writes streaming.json

Everything is measured in the same run, on the same buffers and device:
1. the pinned-copy peak: host-to-device copies of a page-locked buffer (registered the way the streamed layers are);
2. the ring alone: every layer of the slice through the native engine's slots with no compute (achieved bandwidth);
3. prefill of a large batch with the layers streamed (MXFP4 experts prefetched, W4A16 eager experts): tokens/s,
   achieved bandwidth, and the share of copy time hidden under compute (1 - stall / copy, from CUDA events), in
   steady state (the first layers fetched ahead by the previous pass) and from a cold ring (that prefetch dropped):
   the difference of their stalls is what cross-pass prefetch hides, about one layer's copy;
4. decode steps of the same batch, routed experts copied on demand.

The slice: K3 widths (hidden 7168, 96 heads, 896 MXFP4 experts per layer, latent MoE 3584, intermediate 3072), as many
MoE layers as `--pinned-fraction` of the host's available memory holds (MLA every fourth layer and the last, as in
K3); dummy weights (random, scaled; MXFP4 scale bytes 119..123), generated on the GPU and copied into pinned arenas.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
import traceback
from pathlib import Path

import torch

log = logging.getLogger("bench.streaming")
GB = 1e9
GiB = float(1 << 30)


def k3_slice_config(layers: int, full_width: bool = True) -> dict:
    """K3's text model at full width (docs/models.md#kimi-k3), `layers` MoE layers, no dense layer 0. full_width False:
    the tiny widths of make-tiny (for the CPU smoke test of this script)."""
    from shard_svc.make_tiny import kimi_k3_config, mla_layers

    raw = kimi_k3_config(layers)
    text = raw["text_config"]
    if not full_width:
        text["first_k_dense_replace"] = 0
        return raw
    text.update(vocab_size=163840, hidden_size=7168, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, num_experts=896, num_experts_per_token=16,
                moe_intermediate_size=3072, routed_expert_hidden_size=3584, num_shared_experts=2,
                intermediate_size=33792, first_k_dense_replace=0, bos_token_id=163584, eos_token_id=163586,
                pad_token_id=163839)
    mla = mla_layers(layers)
    text["linear_attn_config"] = {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                  "use_full_rank_gate": True, "gate_lower_bound": -5.0, "full_attn_layers": mla,
                                  "kda_layers": [i for i in range(1, layers + 1) if i not in mla]}
    return raw


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def pinned_copy_peak(sizes=(256 << 20, 1 << 30, 4 << 30), reps: int = 8) -> dict:
    """Median host-to-device GB/s per size from one page-locked buffer (cudaHostRegister, as the arenas)."""
    from shard_svc.host_memory import alloc_host

    biggest = max(sizes)
    host, registered = alloc_host(biggest, pinned=True)
    host.fill_(1)
    dev = torch.empty(biggest, dtype=torch.uint8, device="cuda")
    out = {}
    for n in sizes:
        times = []
        for _ in range(reps + 2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dev[:n].copy_(host[:n], non_blocking=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        out[f"{n >> 20}MiB"] = n / _median(times[2:]) / GB
    if registered:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    del dev
    torch.cuda.empty_cache()
    return {"GBps_by_size": out, "peak_GBps": max(out.values())}


def layer_bytes(layers: int) -> list[int]:
    from shard_svc.config import ModelConfig
    from shard_svc.model import KimiForCausalLM
    from shard_svc.weight_streaming.plan import plan_layers

    cfg = ModelConfig.from_dict(k3_slice_config(layers))
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16)
    return [p.nbytes for _, p in sorted(plan_layers(cfg, model).items())]


def choose_layers(requested: int | None, pinned_fraction: float, depth: int) -> tuple[int, dict]:
    from shard_svc.host_memory import host_available_bytes

    available = host_available_bytes() or 0
    budget = int(pinned_fraction * available)
    sizes = layer_bytes(16)
    n, total = 0, 0
    while n < len(sizes) and total + sizes[n] <= budget:
        total += sizes[n]
        n += 1
    layers = min(requested, n) if requested else n
    info = {"host_available_GiB": available / GiB, "pinned_budget_GiB": budget / GiB, "layers_that_fit": n,
            "layer_GiB": [s / GiB for s in sizes[:max(layers, 1)]]}
    if layers < 1:
        raise SystemExit(f"not even one K3 layer ({sizes[0] / GiB:.1f} GiB) fits in the pinned budget "
                         f"({budget / GiB:.1f} GiB = {pinned_fraction} x {available / GiB:.1f} GiB available)")
    return layers, info


def build(layers: int, depth: int, budget_bytes: int | None, dev: torch.device, full_width: bool = True):
    """(cfg, model, host weights, streamer) with dummy weights: resident tensors on the GPU, layers in pinned arenas."""
    from shard_svc.config import ModelConfig
    from shard_svc.model import KimiForCausalLM
    from shard_svc.weight_streaming import StreamOptions, WeightStreamer
    from shard_svc.weight_streaming.host import HostWeights
    from shard_svc.weight_streaming.plan import plan_layers, split_layer_param

    cfg = ModelConfig.from_dict(k3_slice_config(layers, full_width))
    with torch.device("meta"):
        model = KimiForCausalLM(cfg, torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(0)
    resident = {}
    for name, p in model.named_parameters():
        if split_layer_param(name) is None:
            resident[name] = _dummy(name, tuple(p.shape), p.dtype, dev, gen)
    model.load_state_dict(resident, strict=False, assign=True)
    model.requires_grad_(False)
    plans = plan_layers(cfg, model)
    start = time.perf_counter()
    host = HostWeights(plans, pinned=dev.type == "cuda", budget_bytes=budget_bytes)
    register_s = time.perf_counter() - start
    start = time.perf_counter()
    for layer, plan in plans.items():
        _fill_layer(host, layer, plan, dev, gen)
    fill_s = time.perf_counter() - start
    host.check_filled()
    streamer = WeightStreamer(cfg, model, host, dev, StreamOptions(prefetch_depth=depth))
    return cfg, model.eval(), host, streamer, {"register_s": register_s, "fill_s": fill_s}


def _dummy(name: str, shape, dtype, dev, gen) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.log(torch.empty(shape, device=dev).uniform_(1, 16, generator=gen)).to(dtype)
    if leaf in ("dt_bias", "e_score_correction_bias"):
        return (torch.randn(shape, device=dev, generator=gen) * 0.1).to(dtype)
    if len(shape) == 1:
        return torch.ones(shape, device=dev, dtype=dtype)
    fan_in = math.prod(shape[1:])
    return (torch.randn(shape, device=dev, generator=gen) * fan_in**-0.5).to(dtype)


def _fill_layer(host, layer: int, plan, dev, gen) -> None:
    """Dense members: scaled random values; experts: random packed bytes (every E2M1 code is valid), sane scales."""
    arena = host.arenas[layer]
    for m in plan.dense:
        host.view(layer, m).copy_(_dummy(m.name, m.shape, m.dtype, dev, gen))
    e = plan.experts
    chunk = 1 << 30
    for off in range(e.base, e.base + e.num * e.stride, chunk):
        n = min(chunk, e.base + e.num * e.stride - off)
        arena.narrow(0, off, n).copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev, generator=gen))
    for part, shape, dtype, offset in e.parts:
        if part.endswith("weight_scale"):
            view = torch.as_strided(arena, (e.num, *shape), (e.stride, shape[1], 1), e.base + offset)
            view.copy_(torch.randint(119, 124, (e.num, *shape), dtype=torch.uint8, device=dev, generator=gen))
    host.mark_written(layer)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def ring_only(streamer, reps: int = 3) -> dict:
    """Every layer through the ring with no compute: acquire, prefetch the next, release at once."""
    engine, order, depth, dev = streamer.engine, streamer.order, streamer.depth, streamer.device
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    streamer.discard_prefetch()  # from an empty ring: no layer fetched ahead by an earlier forward pass
    runs = []
    for _ in range(reps):
        engine.reset_stats()
        _sync(dev)
        start = time.perf_counter()
        for layer in order[:depth]:
            engine.fetch(layer)
        for i, layer in enumerate(order):
            engine.acquire(layer, stream)
            if i + depth < len(order):
                engine.fetch(order[i + depth])
            engine.release(layer, stream)
        engine.drain()
        _sync(dev)
        wall = time.perf_counter() - start
        s = engine.stats()
        runs.append({"bytes": s["bytes"], "copies": s["copies"], "copy_s": s["copy_s"], "wall_s": wall,
                     "GBps_events": s["bytes"] / max(s["copy_s"], 1e-9) / GB, "GBps_wall": s["bytes"] / wall / GB})
    best = max(runs, key=lambda r: r["GBps_events"])
    return {"runs": runs, "GBps_events": best["GBps_events"], "GBps_wall": max(r["GBps_wall"] for r in runs)}


def prefill_and_decode(cfg, model, streamer, batch: int, length: int, decode_steps: int, op_backend: str) -> dict:
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops

    dev = streamer.device
    ops = select_ops(dev, op_backend)
    block = 64
    engine = Engine(cfg, model, ops, dev, EngineConfig(num_state_slots=batch, num_kv_blocks=batch * (
        (length + decode_steps + block) // block) + 8, kv_block_size=block, prefill_token_budget=1 << 24))
    streamer.attach(engine.runner)
    result = {"op_backends": dict(ops.backends), "batch": batch, "length": length, "prefill": [], "decode": []}
    # 0 compiles the Triton kernels; 1 and 2 start with their first layers fetched by the pass before (steady state);
    # 2 is followed by the decode steps; 3 starts from a cold ring, for comparison.
    for rep in range(4):
        prompts = [[1 + (i * 7919 + t) % (cfg.vocab_size - 1) for t in range(length)] for i in range(batch)]
        seqs = [engine.add_request(f"pf{rep}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=decode_steps + 1,
                                                                          ignore_eos=True))
                for i, prompt in enumerate(prompts)]
        engine.scheduler.schedule()  # admits: slots and KV promises
        if rep == 2 and decode_steps:
            streamer.expect_next_pass(batch)  # what the engine says before a prefill its decode follows
        if rep == 3:
            streamer.discard_prefetch()
        _sync(dev)
        start = time.perf_counter()
        engine.runner.forward([(s, length) for s in seqs], is_decode=False)
        _sync(dev)
        wall = time.perf_counter() - start
        result["prefill"].append(_pass_row(streamer.last_pass, wall, batch * length, warmup=rep == 0) | {
            "cold": rep == 3})
        if rep == 2:
            for _ in range(decode_steps):
                for s in seqs:
                    s.output.append(7)
                _sync(dev)
                start = time.perf_counter()
                engine.runner.forward([(s, 1) for s in seqs], is_decode=True)
                _sync(dev)
                result["decode"].append(_pass_row(streamer.last_pass, time.perf_counter() - start, batch))
        for s in seqs:
            engine.cancel(s.request_id)
    return result


def _pass_row(p, wall: float, tokens: int, warmup: bool = False) -> dict:
    return {"warmup": warmup, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "bytes": p.bytes,
            "copy_s": p.copy_s, "compute_s": p.compute_s, "stall_s": p.stall_s, "routed_experts": p.routed,
            "ready_layers": p.ready, "fetched_ahead": p.ahead,
            "GBps_copy": p.bytes / p.copy_s / GB if p.copy_s else 0.0,
            "hidden_share": 1.0 - p.stall_s / p.copy_s if p.copy_s else 0.0}


def table(r: dict) -> str:
    lines = [f"{r['device']}  torch {r['torch']}  slice {r['layers']} K3 layers ({r['slice_GiB']:.1f} GiB pinned), "
             f"{r['slots']} slots x {r['slot_GiB']:.1f} GiB, prefetch depth {r['depth']}"]
    peak = r["pinned_copy"]["peak_GBps"]
    sizes = ", ".join(f"{k} {v:.1f}" for k, v in r["pinned_copy"]["GBps_by_size"].items())
    lines.append(f"pinned-copy peak      {peak:8.1f} GB/s   ({sizes})")
    if "ring" in r:
        g = r["ring"]["GBps_events"]
        lines.append(f"ring, no compute      {g:8.1f} GB/s   {100 * g / peak:5.1f}% of peak (target >= 85%); "
                     f"wall {r['ring']['GBps_wall']:.1f} GB/s")
    rows = [row for row in r.get("prefill", {}).get("prefill", []) if not row["warmup"]]
    for row in rows:
        lines.append(f"prefill {r['prefill']['batch']} x {r['prefill']['length']} {'cold' if row['cold'] else 'warm'} "
                     f"{row['tokens_per_s']:10.0f} tok/s "
                     f"(slice)  {row['tokens_per_s'] * r['layers'] / 93:8.0f} tok/s (x93 layers)  copy "
                     f"{row['GBps_copy']:.1f} GB/s ({100 * row['GBps_copy'] / peak:.0f}% of peak), copy "
                     f"{row['copy_s']:.2f} s compute {row['compute_s']:.2f} s stall {row['stall_s']:.2f} s, hidden "
                     f"{100 * row['hidden_share']:.0f}%, {row['ready_layers']} layers ready at start")
    steady, cold = [row for row in rows if not row["cold"]], [row for row in rows if row["cold"]]
    if steady and cold:
        stall = sum(row["stall_s"] for row in steady) / len(steady)
        lines.append(f"cross-pass prefetch   prefill stall {cold[0]['stall_s']:.2f} s from a cold ring, {stall:.2f} s "
                     f"with the first {steady[0]['ready_layers']} layers fetched by the previous pass")
    for row in r.get("prefill", {}).get("decode", []):
        lines.append(f"decode batch {row['tokens']:<4}       {1e3 * row['wall_s']:8.1f} ms/step  "
                     f"{row['bytes'] / GB:.2f} GB streamed (routed experts: {row['routed_experts']}), stall "
                     f"{1e3 * row['stall_s']:.1f} ms")
    for key in ("prefill_error", "ring_error"):
        if key in r:
            lines.append(f"{key}: {r[key].splitlines()[-1]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--layers", type=int, default=None, help="K3 layers in the slice (default: as many as fit)")
    p.add_argument("--pinned-fraction", type=float, default=0.6, help="share of available host memory to pin")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="prefill sequences")
    p.add_argument("--length", type=int, default=4096, help="tokens per prefill sequence")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--op-backend", default="auto", help="auto | eager | triton (attention, norms; experts are W4A16)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.streaming needs a CUDA device")
    args.out.mkdir(parents=True, exist_ok=True)
    torch.cuda.set_device(0)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "cuda": torch.version.cuda, "depth": args.prefetch_depth}
    out_file = args.out / "streaming.json"

    def save() -> None:
        out_file.write_text(json.dumps(result, indent=1, default=str))

    from shard_svc.weight_streaming.native import load_native

    result["pinned_copy"] = pinned_copy_peak()
    log.info("pinned-copy peak %.1f GB/s", result["pinned_copy"]["peak_GBps"])
    save()
    start = time.perf_counter()
    try:
        native = load_native("cuda")
    except Exception:  # noqa: BLE001 - the peak is already saved; say why nothing else came
        result["native_error"] = traceback.format_exc()
        save()
        raise
    result["native_build"] = {"seconds": time.perf_counter() - start, "with": getattr(native, "BUILT_WITH", "?"),
                              "dir": getattr(native, "BUILD_DIR", "?")}
    layers, result["host"] = choose_layers(args.layers, args.pinned_fraction, args.prefetch_depth)
    budget = int(result["host"]["pinned_budget_GiB"] * GiB)
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg, model, host, streamer, result["setup"] = build(layers, args.prefetch_depth, budget, dev)
    result.update(layers=layers, slice_GiB=host.total_bytes / GiB, slots=streamer.engine.num_slots,
                  slot_GiB=streamer.engine.slot_bytes / GiB)
    log.info("slice ready: %d layers, %.1f GiB pinned (%s)", layers, host.total_bytes / GiB, result["setup"])
    save()
    try:
        result["ring"] = ring_only(streamer)
    except Exception:  # noqa: BLE001 - recorded, the other figures still come
        result["ring_error"] = traceback.format_exc()
        log.error("ring measurement failed:\n%s", result["ring_error"])
    save()
    try:
        result["prefill"] = prefill_and_decode(cfg, model, streamer, args.batch, args.length, args.decode_steps,
                                               args.op_backend)
    except Exception:  # noqa: BLE001 - recorded with the traceback; no silent fallback to another backend
        result["prefill_error"] = traceback.format_exc()
        log.error("prefill measurement failed:\n%s", result["prefill_error"])
    save()
    text = table(result)
    (args.out / "streaming.txt").write_text(text + "\n")
    log.info("\n%s\nwrote %s", text, out_file)


if __name__ == "__main__":
    main()
