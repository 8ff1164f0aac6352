"""Whole-model benchmark on one GPU: Kimi-Linear-48B-A3B shape with dummy bf16 weights, against the card's own
ceilings measured in the same run; plus the kernels-vs-eager whole-model check on tiny checkpoints.

    python -m bench.model_bench --out bench_out            # prints a table, writes model_bench.json + PNGs

Prefill: 8 x 4,096 and 1 x 32,768 tokens. Decode: one step of batch 1, 16, 64, 256 at 4,096 tokens of context (the
context's state and cache are filled with random values rather than prefilled: a decode step's cost does not depend
on what the cache holds), each timed eager and as a replayed CUDA graph (shard_svc/engine/cuda_graphs.py; skipped
with --enforce-eager). Parity on tiny checkpoints: kernels vs eager, and decode graphs vs the same kernels eager.
At the 48B shape: the MoE and MLA-decode ops vs eager, and the MoE block with its shared expert fused into the grouped
kernels (`moe_experts_shared`) vs the same block composed of the separate ops, replayed over every layer's weights.
On Hopper the decode graphs are also captured and timed (batch 1 and 64) with programmatic dependent launch off.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.configs import KIMI_LINEAR_48B, with_layers
from bench.kernel_profile import format_profile, kernel_profile
from bench.measure import copy_bytes_per_s, gpu_ms, graph_us
from shard_svc.config import ModelConfig
from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

log = logging.getLogger("bench")


def timed(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median seconds of fn() on the GPU."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    copy = copy_bytes_per_s("cuda")
    m = 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    mm_ms = gpu_ms(lambda: x @ y, warmup=20, rep=100)
    return {"copy_TBps": copy / 1e12, "bf16_matmul_TFLOPs": 2 * m**3 / (mm_ms * 1e-3) / 1e12}


def kernel_parity(prompts: list[list[int]], graphs: bool = True) -> tuple[list[dict], list[dict]]:
    """On tiny checkpoints in bf16: kernels on vs eager (prompt logits within bf16 tolerance, greedy tokens equal),
    and decode graphs vs the same kernels run eagerly (step logits, greedy tokens)."""
    from shard_svc.checkpoint.loader import load_model
    from shard_svc.make_tiny import make_tiny

    cuda = torch.device("cuda")
    out, graph_out = [], []
    for family in ("kimi_linear", "kimi_k3"):
        with tempfile.TemporaryDirectory() as tmp:
            make_tiny(family, Path(tmp) / "m", seed=0)
            cfg, model = load_model(Path(tmp) / "m", device="cuda", dtype=torch.bfloat16)
        runs = {}
        for run in ("eager", "triton") + (("triton+graphs",) if graphs else ()):
            backend = run.split("+")[0]
            engine_cfg = EngineConfig(num_state_slots=len(prompts), num_kv_blocks=256)
            engine = Engine(cfg, model, select_ops(cuda, backend), cuda,
                            graph_engine_config(engine_cfg, cuda, enforce_eager=run != "triton+graphs"))
            if run == "triton+graphs" and enable_cuda_graphs(engine) is None:
                raise RuntimeError("decode graphs did not start for the Triton backend (the log says why)")
            seqs = [engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                       keep_prompt_logits=True) for i, p in enumerate(prompts)]
            while engine.has_work():
                engine.step()
            runs[run] = seqs
        for a, b in zip(runs["eager"], runs["triton"]):
            la, lb = torch.cat(a.prompt_logits), torch.cat(b.prompt_logits)
            rel = float((la - lb).abs().max() / la.abs().max())
            out.append({"family": family, "prompt_len": len(a.prompt), "prompt_logits_max_rel_err": rel,
                        "greedy_tokens_equal": a.output == b.output})
        for a, b in zip(runs["triton"], runs.get("triton+graphs", [])):
            la, lb = torch.cat(a.step_logits), torch.cat(b.step_logits)
            graph_out.append({"family": family, "prompt_len": len(a.prompt),
                              "step_logits_max_rel_err": float((la - lb).abs().max() / la.abs().max()),
                              "greedy_tokens_equal": a.output == b.output})
    return out, graph_out


@torch.inference_mode()
def op_checks_48b(cfg: ModelConfig, model, ops) -> list[dict]:
    """The Triton MoE and MLA-decode ops against their eager references at the 48B shape (one layer's dummy weights,
    random inputs; both align paths), with the kernel's time and the bytes it must read."""
    from shard_svc.ops import EAGER

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = next(layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    m, w = cfg.moe, moe.experts
    out = []
    for t in (1, 64, 256, 4096):
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        route = (x, moe.gate.weight, moe.gate.e_score_correction_bias, m.top_k, m.renormalize,
                 m.routed_scaling_factor)
        weights, ids = ops.moe_route(*route)
        ref_w, ref_ids = EAGER["moe_route"](*route)
        out.append({"op": "moe_route", "tokens": t, "ids_equal_fraction": float((ids == ref_ids).float().mean()),
                    "rel_err": rel(weights, ref_w),
                    "ms": gpu_ms(lambda: ops.moe_route(*route), warmup=5, rep=50)})
        args = (x, weights, ids, w.w1, w.w3, w.w2, "silu", (4.0, 25.0))
        ms = gpu_ms(lambda: ops.moe_experts(*args), warmup=5, rep=50)
        touched = int(torch.unique(ids).numel()) * 3 * w.w1[0].numel() * 2
        err = rel(ops.moe_experts(*args), EAGER["moe_experts"](*args))
        out.append({"op": "moe_experts", "tokens": t, "rel_err": err, "ms": ms,
                    "weight_TBps": touched / (ms * 1e-3) / 1e12})
    mla = next(layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "kv_b_proj"))
    bs, ctx = 64, 4095
    for b in (1, 16, 64, 256):
        per = -(-(ctx + 1) // bs)
        cache = torch.randn(b * per, bs, cfg.mla.latent_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        tables = torch.randperm(b * per, device="cuda", generator=gen).view(b, per).int()
        q = torch.randn(b, mla.nh, mla.nope + mla.rope, device="cuda", dtype=torch.bfloat16, generator=gen)
        args = (q[..., :mla.nope], q[..., mla.nope:], cache, mla.kv_b_proj.weight, tables,
                torch.full((b,), ctx, device="cuda"), torch.arange(b + 1, device="cuda"), mla.scale)
        ms = gpu_ms(lambda: ops.mla_decode(*args), warmup=5, rep=50)
        check = rel(ops.mla_decode(*args), EAGER["mla_decode"](*args)) if b <= 64 else None  # eager loops on the host
        out.append({"op": "mla_decode", "batch": b, "context": ctx + 1, "rel_err": check, "ms": ms,
                    "kv_TBps": cache.numel() * 2 / (ms * 1e-3) / 1e12})
        del cache
    for prefix, new in ((0, 4096), (1024, 3072)):  # a whole prompt, and a chunk after a cached prefix
        b, total = 2, prefix + new
        per = -(-total // bs)
        cache = torch.randn(b * per, bs, cfg.mla.latent_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        tables = torch.randperm(b * per, device="cuda", generator=gen).view(b, per).int()
        q = torch.randn(b * new, mla.nh, mla.nope + mla.rope, device="cuda", dtype=torch.bfloat16, generator=gen)
        args = (q[..., :mla.nope], q[..., mla.nope:], cache, mla.kv_b_proj.weight, tables,
                torch.full((b,), prefix, device="cuda"), torch.arange(b + 1, device="cuda") * new, mla.scale)
        ms = gpu_ms(lambda: ops.mla_prefill(*args), warmup=3, rep=20)
        pairs = b * mla.nh * sum(prefix + i + 1 for i in range(new))  # causal (query, key, head) triples
        out.append({"op": "mla_prefill", "batch": b, "context": total, "new": new, "ms": ms,
                    "rel_err": rel(ops.mla_prefill(*args), EAGER["mla_prefill"](*args)),
                    "TFLOPs": 2 * pairs * (mla.nope + mla.rope + mla.v_dim) / (ms * 1e-3) / 1e12})
        del cache
    return out


def shared_expert_checks(cfg: ModelConfig, model, ops) -> list[dict]:
    """The MoE block at decode sizes: the shared expert fused into the grouped kernels (`ops.moe_experts_shared`,
    forced past its FUSE_MAX_TOKENS at 64 and 256 tokens to show where the threshold belongs) vs the block composed of
    the separate ops (what the model runs without the fused op), as CUDA-graph replays over all 26 MoE layers'
    weights (a decode step's access pattern), and both against the eager composition."""
    from shard_svc.model.layers import stacked_weight
    from shard_svc.ops import EAGER
    from shard_svc.ops.moe.eager import with_shared_expert

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    composed = with_shared_expert(ops.moe_experts, ops.linear, ops.glu)
    fused = functools.partial(ops.moe_experts_shared, max_tokens=1 << 20)
    reference = with_shared_expert(EAGER["moe_experts"], EAGER["linear"], EAGER["glu"])
    gen = torch.Generator(device="cuda").manual_seed(1)
    m = cfg.moe
    blocks = [layer.block_sparse_moe for layer in model.model.layers if hasattr(layer, "block_sparse_moe")]
    rows = []
    for t in (1, 4, 16, 64, 256):
        x = torch.randn(t, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        calls = []
        for moe in blocks:
            weights, ids = ops.moe_route(x, moe.gate.weight, moe.gate.e_score_correction_bias, m.top_k,
                                         m.renormalize, m.routed_scaling_factor)
            s = moe.shared_experts
            calls.append((x, weights, ids, moe.experts.w1, moe.experts.w3, moe.experts.w2, cfg.activation,
                          (cfg.situ_beta, cfg.situ_linear_beta), stacked_weight((s.gate_proj, s.up_proj)),
                          s.down_proj.weight))
        ref = reference(*calls[0])
        row = {"tokens": t, "layers": len(calls), "rel_err_fused": rel(fused(*calls[0]), ref),
               "rel_err_composed": rel(composed(*calls[0]), ref)}
        for name, fn in (("fused", fused), ("composed", composed)):
            row[f"{name}_us_per_layer"] = graph_us([lambda a=a, fn=fn: fn(*a) for a in calls])
        row["speedup"] = row["composed_us_per_layer"] / row["fused_us_per_layer"]
        rows.append(row)
    return rows


def active_bytes(model, routed_share: float) -> float:
    """Weight bytes one decode step reads: everything but the embedding table and the experts nobody routed to.
    `routed_share` is the measured share of (layer, expert) pairs some token of the step routed to."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    return total - embed - experts + experts * routed_share


def routed_share(engine: Engine, step) -> float:
    """Runs one eager step with the router recorded: the share of experts routed to, averaged over MoE layers.
    The bandwidth floor needs the experts actually read, and dummy weights do not route uniformly."""
    original, counts = engine.runner.ops, []

    def recording(*args, **kwargs):
        weights, ids = original.moe_route(*args, **kwargs)
        counts.append(int(torch.unique(ids).numel()))
        return weights, ids

    engine.runner.ops, graphs, engine.runner.graphs = replace(original, moe_route=recording), engine.runner.graphs, None
    try:
        step()
    finally:
        engine.runner.ops, engine.runner.graphs = original, graphs
    return sum(counts) / (len(counts) * engine.cfg.moe.num_experts) if counts else 0.0


def linear_flops_per_token(cfg: ModelConfig, model) -> float:
    """2 x active linear parameters (experts at top_k / E, no embedding)."""
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    other = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n and "embed_tokens" not in n
                and p.dim() >= 2)
    return 2 * (other + expert * cfg.moe.top_k / cfg.moe.num_experts)


def prefill_bench(engine: Engine, batch: int, length: int, profile: bool = False) -> tuple[float, dict | None]:
    def run():
        seqs = [engine.add_request(f"pf{i}", [1 + (i + t) % 1000 for t in range(length)],
                                   SamplingParams(temperature=0.0, max_tokens=1,
                                                  ignore_eos=True)) for i in range(batch)]
        engine.scheduler.schedule()  # admits: slots and KV promises
        engine.runner.forward([(s, length) for s in seqs], is_decode=False)
        for s in seqs:
            engine.cancel(s.request_id)

    return timed(run, warmup=1, reps=3), kernel_profile(run, steps=1) if profile else None


def decode_bench(engine: Engine, batch: int, context: int, profile: bool = False) -> dict:
    seqs = [engine.add_request(f"dc{i}", [1] * context, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            for i in range(batch)]
    engine.scheduler.schedule()  # admits: slots and KV promises
    pool, cache = engine.runner.kda_pool, engine.runner.kv_cache
    for s in seqs:
        pool.recurrent[:, s.slot].normal_(0, 0.02)
        pool.conv[:, s.slot].normal_(0, 0.02)
        cache.reserve(s.request_id, context + 64)
        # Distinct tokens per sequence, so routing spreads over experts as real traffic does.
        s.num_computed, s.output = context, [1 + (7919 * int(s.request_id[2:])) % 150000]
    for block in range(cache.blocks.num_blocks - cache.blocks.num_free):
        cache.kv[:, block].normal_(0, 1)

    def step():
        engine.runner.forward([(s, 1) for s in seqs], is_decode=True)
        for s in seqs:
            s.output.append(1 + (s.output[-1] * 31 + 17) % 150000)

    share = routed_share(engine, step)
    graphs = engine.runner.graphs
    engine.runner.graphs = None
    seconds = {"eager": timed(step, warmup=2, reps=5), "routed_share": share}
    engine.runner.graphs = graphs
    if graphs is not None:
        seconds["graphs"] = timed(step, warmup=2, reps=5)
    if profile:
        seconds["profile"] = kernel_profile(step)
    for s in seqs:
        engine.cancel(s.request_id)
    return seconds


def decode_without_pdl(engine: Engine, graphs, batches: tuple[int, ...]) -> list[dict]:
    """The decode graphs captured again with programmatic dependent launch off (`ops/triton/common.py::USE_PDL`),
    timed at these batches in the same run, then captured with it on again."""
    from shard_svc.ops.triton import common

    common.USE_PDL = False
    try:
        graphs.capture()
        return [{"batch": b, "tpot_graphs_ms": decode_bench(engine, b, 4096)["graphs"] * 1e3} for b in batches]
    finally:
        common.USE_PDL = True
        graphs.capture()


def plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    dec = result["decode"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([d["batch"] for d in dec], [d["tpot_ms"] for d in dec], "o-", label="kimiserve TPOT")
    if all("tpot_graphs_ms" in d for d in dec):
        ax.plot([d["batch"] for d in dec], [d["tpot_graphs_ms"] for d in dec], "s-", label="kimiserve TPOT, graphs")
    ax.plot([d["batch"] for d in dec], [d["floor_ms"] for d in dec], "k--", label="bandwidth floor")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (4k context)")
    ax.set_ylabel("ms per step")
    ax.set_title("Kimi-Linear-48B shape, one H200")
    ax.legend()
    fig.savefig(out / "decode_vs_batch.png", dpi=120, bbox_inches="tight")
    files.append("decode_vs_batch.png")
    pf = result["prefill"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([f"{p['batch']}x{p['length']}" for p in pf], [p["tokens_per_s"] / 1e3 for p in pf], label="kimiserve")
    ax.axhline(result["prefill_ceiling_tokens_per_s"] / 1e3, color="k", ls="--", label="matmul ceiling")
    ax.axhline(29.0, color="r", ls=":", label="transformers 8x4k (docs/anchors.md)")
    ax.set_ylabel("k tokens/s")
    ax.legend()
    fig.savefig(out / "prefill.png", dpi=120, bbox_inches="tight")
    files.append("prefill.png")
    return files


def save(result: dict, out: Path) -> None:
    """Written after every section, so a failure later leaves what was measured."""
    (out / "model_bench.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (figures scale)")
    p.add_argument("--skip-parity", action="store_true")
    p.add_argument("--enforce-eager", action="store_true", help="time decode without CUDA graphs only")
    p.add_argument("--profile", action="store_true",
                   help="also record per-kernel GPU time of prefill 8 x 4k and of decode steps at batch 1 and 64")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__}
    result["ceilings"] = ceilings()
    if not args.skip_parity:
        result["kernel_parity"], result["graph_parity"] = kernel_parity(
            [[1, 2, 3, 4, 5, 6, 7], list(range(10, 140)), [42] * 65], graphs=not args.enforce_eager)
        save(result, args.out)
    cfg = ModelConfig.from_dict(with_layers(KIMI_LINEAR_48B, args.layers))
    from shard_svc.checkpoint.dummy import dummy_model

    model = dummy_model(cfg, "cuda", torch.bfloat16)
    ops = select_ops(torch.device("cuda"))
    result["op_backends"] = dict(ops.backends)
    engine_cfg = EngineConfig(num_state_slots=256, num_kv_blocks=256 * (4096 + 64) // 64 + 8, kv_block_size=64,
                              prefill_token_budget=1 << 20)
    engine = Engine(cfg, model, ops, torch.device("cuda"),
                    graph_engine_config(engine_cfg, torch.device("cuda"), args.enforce_eager))
    decode_batches = (1, 16, 64, 256)
    if not args.enforce_eager:
        start = time.perf_counter()
        graphs = enable_cuda_graphs(engine, buckets=decode_batches)
        result["graph_capture_s"] = time.perf_counter() - start if graphs is not None else None
    if not args.skip_parity:
        try:
            result["op_checks_48b"] = op_checks_48b(cfg, model, ops)
            result["shared_expert_48b"] = shared_expert_checks(cfg, model, ops)
        except Exception as e:  # noqa: BLE001 - recorded loudly; the timings below still run
            log.exception("48B op checks failed")
            result["op_checks_48b_error"] = repr(e)
        save(result, args.out)
    ceil = result["ceilings"]
    flops = linear_flops_per_token(cfg, model)
    result["prefill_ceiling_tokens_per_s"] = ceil["bf16_matmul_TFLOPs"] * 1e12 / flops
    result["prefill"] = []
    for batch, length in ((8, 4096), (1, 32768)):
        s, prof = prefill_bench(engine, batch, length, profile=args.profile and batch == 8)
        tps = batch * length / s
        result["prefill"].append({"batch": batch, "length": length, "seconds": s, "tokens_per_s": tps,
                                  "mfu": tps * flops / (ceil["bf16_matmul_TFLOPs"] * 1e12)})
        if prof is not None:
            result["prefill"][-1]["profile"] = prof
        save(result, args.out)
    result["decode"] = []
    for batch in decode_batches:
        timings = decode_bench(engine, batch, 4096, profile=args.profile and batch in (1, 64))
        s = timings["eager"]
        state = batch * cfg.layer_map.num_kda * engine.runner.kda_pool.recurrent[0, 0].numel() * 4 * 2
        kv = batch * 4096 * cfg.layer_map.num_mla * cfg.mla.latent_dim * 2
        moved = active_bytes(model, timings["routed_share"]) + state + kv
        floor = moved / (ceil["copy_TBps"] * 1e12)
        row = {"batch": batch, "tpot_ms": s * 1e3, "floor_ms": floor * 1e3, "bandwidth_utilisation": floor / s,
               "tokens_per_s": batch / s, "routed_expert_share": timings["routed_share"]}
        if "profile" in timings:
            row["profile"] = timings["profile"]
        if "graphs" in timings:
            g = timings["graphs"]
            row.update({"tpot_graphs_ms": g * 1e3, "bandwidth_utilisation_graphs": floor / g,
                        "tokens_per_s_graphs": batch / g})
        result["decode"].append(row)
        save(result, args.out)
    from shard_svc.ops.triton.common import pdl_args

    result["pdl"] = pdl_args(torch.device("cuda"))["PDL"]
    if engine.runner.graphs is not None and result["pdl"]:
        result["decode_without_pdl"] = decode_without_pdl(engine, engine.runner.graphs, (1, 64))
        save(result, args.out)
    result["plots"] = plots(result, args.out)
    save(result, args.out)
    lines = [f"{result['device']}  copy {ceil['copy_TBps']:.2f} TB/s  bf16 matmul {ceil['bf16_matmul_TFLOPs']:.0f} "
             f"TFLOP/s  ops {result['op_backends']}"]
    for r in result.get("kernel_parity", []):
        lines.append(f"parity {r['family']:<12} P={r['prompt_len']:<4} rel err {r['prompt_logits_max_rel_err']:.2e} "
                     f"greedy equal {r['greedy_tokens_equal']}")
    for r in result.get("op_checks_48b", []):
        size = f"T={r['tokens']}" if r["op"].startswith("moe") else f"B={r['batch']} x {r['context']}"
        err = "n/a" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
        rate = {"moe_route": f"chosen experts equal to eager: {100 * r.get('ids_equal_fraction', 0):.2f}%",
                "moe_experts": f"{r.get('weight_TBps', 0):.2f} TB/s of touched expert weights",
                "mla_decode": f"{r.get('kv_TBps', 0):.2f} TB/s of latent KV",
                "mla_prefill": f"{r.get('TFLOPs', 0):.0f} TFLOP/s (causal attention)"}[r["op"]]
        lines.append(f"48B {r['op']:<12} {size:<14} rel err vs eager {err}  {r['ms'] * 1e3:9.1f} us  {rate}")
    for r in result.get("shared_expert_48b", []):
        lines.append(f"48B MoE + shared expert T={r['tokens']:<3} fused {r['fused_us_per_layer']:6.1f} us/layer  "
                     f"composed {r['composed_us_per_layer']:6.1f}  ({r['speedup']:.2f}x)  rel err vs eager fused "
                     f"{r['rel_err_fused']:.2e} composed {r['rel_err_composed']:.2e}")
    for r in result.get("graph_parity", []):
        lines.append(f"graphs vs eager {r['family']:<12} P={r['prompt_len']:<4} step logits rel err "
                     f"{r['step_logits_max_rel_err']:.2e} greedy equal {r['greedy_tokens_equal']}")
    for r in result["prefill"]:
        lines.append(f"prefill {r['batch']} x {r['length']:<6} {r['tokens_per_s'] / 1e3:8.1f} k tok/s  "
                     f"MFU {100 * r['mfu']:.1f}%")
    for r in result["decode"]:
        graphed = (f"  graphs TPOT {r['tpot_graphs_ms']:8.2f} ms  bandwidth "
                   f"{100 * r['bandwidth_utilisation_graphs']:.1f}%") if "tpot_graphs_ms" in r else ""
        lines.append(f"decode batch {r['batch']:<4} TPOT {r['tpot_ms']:8.2f} ms  floor {r['floor_ms']:.2f} ms  "
                     f"bandwidth {100 * r['bandwidth_utilisation']:.1f}%{graphed}")
    with_pdl = {r["batch"]: r.get("tpot_graphs_ms") for r in result["decode"]}
    for r in result.get("decode_without_pdl", []):
        lines.append(f"decode batch {r['batch']:<4} graphs without PDL {r['tpot_graphs_ms']:8.2f} ms  (with PDL "
                     f"{with_pdl[r['batch']]:.2f} ms)")
    for r in result["prefill"] + result["decode"]:
        if "profile" in r:
            kind = f"prefill {r['batch']} x {r['length']}" if "length" in r else f"decode batch {r['batch']}"
            lines += format_profile(kind + (" (graphs)" if "tpot_graphs_ms" in r else ""), r["profile"])
    log.info("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
