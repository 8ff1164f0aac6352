"""Long-context MLA prefill at the Kimi-Linear-48B shape: the served op against the Triton kernel alone and against
cuDNN attention on already-expanded keys and values, in one run.

    python -m bench.mla_prefill_long --out DIR    # prints tables, writes mla_prefill_long.json

One prefill pass: a chunk of M queries at context C (the queries see the C cached keys and, causally, the chunk).
32 heads, nope 128 + rope 64, v 128, latent 512, bf16, the cache in shuffled 64-token pages. Useful work: 2 x (192 +
128) FLOPs per visible (query, key, head); the bf16 8192^3 matmul rate is measured in the same run.

- `served`: the op as the shard runs it (`ops.mla_prefill` on CUDA: the Triton kernel, long sequences on cuDNN, at
  most 32,768 keys expanded at once): gather, expansion, attention, merge.
- `triton`: the same op with every sequence in the Triton kernel (`long_attend=None`), same workspace.
- `cudnn_attention`: cuDNN alone on pre-expanded K/V, chunk vs context unmasked plus chunk vs itself causal, merge
  not timed: the peer, a lower bound of any pass built on it.
Per row: ms, TFLOP/s, its share of the matmul rate, the peak memory allocated during the call above its inputs, and
the error against the eager op (where eager's fp32 expansion fits: C <= 65,536) and served vs triton.

The library's first call at a shape it has not seen (cuDNN builds and caches an execution plan per shape, and a
serving pass's chunk and context remainder vary) against the same call warm, with its error against the fp32
reference at the smaller shapes: `new_shape`; and the same in a fresh process with PyTorch's
TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (one plan for every sequence length): `new_shape_avoid_recompile`.

The Triton kernel's tiles and pipeline depth at one context where it serves (65,536), against its default layout:
`layouts`.

Then where the library starts paying (`LONG_PAIRS`, new queries x cached keys): chunks of 256 .. 8,192 queries at
contexts 32,768 and 131,072, the library for the sequence against the kernel. And the attention of a whole
1,048,576-token prompt (7 MLA layers, 128 passes of 8,192), from a line fitted through each column's pass times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.measure import gpu_ms
from shard_svc.ops.mla import eager
from shard_svc.ops.mla.long_context import Attend, expand, gather_latents, math_attend

PROMPT, MLA_LAYERS = 1_048_576, 7
LAYOUTS = [dict(block_m=m, block_n=n, num_stages=s) for m in (64, 128) for n in (32, 64, 128) for s in (2, 3)]
SWEEP_LAYOUTS = [dict(block_m=128, block_n=64, num_stages=3), dict(block_m=128, block_n=128, num_stages=2),
                 dict(block_m=64, block_n=64, num_stages=2)]
NEW_SHAPES = ((8191, 8191, True), (5003, 21011, False), (777, 32768, False), (3001, 3001, True), (1500, 2500, False))


@dataclass(frozen=True)
class Shape:
    heads: int = 32
    nope: int = 128
    rope: int = 64
    v: int = 128
    kv_lora: int = 512
    page: int = 64

    def flops(self, context: int, chunk: int) -> float:
        return 2 * (self.nope + self.rope + self.v) * self.heads * (chunk * context + chunk * (chunk + 1) / 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def pass_inputs(shape: Shape, context: int, chunk: int, device: str, gen: torch.Generator) -> tuple:
    """One sequence's op inputs: the cache holding C + M latents in shuffled pages, M queries at position C."""
    total = context + chunk
    pages = -(-total // shape.page)
    bf = dict(device=device, dtype=torch.bfloat16)
    cache = torch.randn(pages, shape.page, shape.kv_lora + shape.rope, generator=gen, device=device).to(bf["dtype"])
    tables = torch.randperm(pages, generator=gen, device=device)[None].int()
    w_kv_b = (torch.randn(shape.heads * (shape.nope + shape.v), shape.kv_lora, generator=gen, device=device)
              * shape.kv_lora ** -0.5).to(bf["dtype"])
    q = torch.randn(chunk, shape.heads, shape.nope + shape.rope, generator=gen, device=device).to(bf["dtype"])
    return (q[..., :shape.nope], q[..., shape.nope:], cache, w_kv_b, tables,
            torch.tensor([context], device=device), torch.tensor([0, chunk], device=device),
            (shape.nope + shape.rope) ** -0.5)


def peak_bytes(fn: Callable[[], object], device: str) -> int:
    """Memory allocated during fn() above what was allocated before it (0 off CUDA)."""
    if device != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def pass_row(shape: Shape, context: int, chunk: int, prefill: Callable, attend: Attend, timer: Callable,
             device: str, gen: torch.Generator, eager_up_to: int) -> dict:
    """The three columns at one (C, M). prefill: the op (served form); attend: the library the peer column calls."""
    args = pass_inputs(shape, context, chunk, device, gen)
    flops = shape.flops(context, chunk)
    row = {"context": context, "chunk": chunk, "gflop": flops / 1e9}
    served = prefill(*args)
    kernel_only = functools.partial(prefill, long_attend=None)
    row["served_vs_triton"] = rel(served, kernel_only(*args))
    if context <= eager_up_to:
        row["served_vs_eager"] = rel(served, eager.mla_attention(*args))
    for name, fn in (("served", lambda: prefill(*args)), ("triton", lambda: kernel_only(*args))):
        row[f"{name}_ms"] = timer(fn)
        row[f"{name}_tflops"] = flops / (row[f"{name}_ms"] * 1e-3) / 1e12
        row[f"{name}_peak_gib"] = peak_bytes(fn, device) / 2**30
    # the peer: attention alone on keys and values expanded beforehand
    q = torch.cat([args[0], args[1]], -1)
    k_self, v_self = expand(gather_latents(args[2], args[4][0], context, context + chunk), args[3], shape.heads,
                            shape.nope)
    k_ctx, v_ctx = (expand(gather_latents(args[2], args[4][0], 0, context), args[3], shape.heads, shape.nope)
                    if context else (None, None))

    def peer():
        attend(q, k_self, v_self, True, args[7])
        if context:
            attend(q, k_ctx, v_ctx, False, args[7])

    row["cudnn_attention_ms"] = timer(peer)
    row["cudnn_attention_tflops"] = flops / (row["cudnn_attention_ms"] * 1e-3) / 1e12
    return row


def crossover_row(shape: Shape, context: int, chunk: int, prefill: Callable, timer: Callable, device: str,
                  gen: torch.Generator) -> dict:
    """One sequence of `chunk` queries at `context`: the library for it (long_pairs 0) against the kernel."""
    args = pass_inputs(shape, context, chunk, device, gen)
    library = functools.partial(prefill, long_pairs=0)
    kernel_only = functools.partial(prefill, long_attend=None)
    row = {"context": context, "chunk": chunk, "pairs": chunk * context,
           "library_vs_kernel": rel(library(*args), kernel_only(*args)),
           "library_ms": timer(lambda: library(*args)), "kernel_ms": timer(lambda: kernel_only(*args))}
    row["library_speedup"] = row["kernel_ms"] / row["library_ms"]
    return row


def new_shape_row(shape: Shape, queries: int, keys: int, causal: bool, attend: Attend, timer: Callable,
                  device: str, gen: torch.Generator) -> dict:
    """Wall milliseconds of the library's first call at (queries, keys), then the warm call's time."""
    q = torch.randn(queries, shape.heads, shape.nope + shape.rope, generator=gen, device=device).bfloat16()
    k = torch.randn(keys, shape.heads, shape.nope + shape.rope, generator=gen, device=device).bfloat16()
    v = torch.randn(keys, shape.heads, shape.v, generator=gen, device=device).bfloat16()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    o, _ = attend(q, k, v, causal, 0.1)
    sync()
    first = (time.perf_counter() - start) * 1e3
    row = {"queries": queries, "keys": keys, "causal": causal, "first_ms": first,
           "warm_ms": timer(lambda: attend(q, k, v, causal, 0.1))}
    if queries * keys <= 1 << 24:  # the fp32 scores fit
        row["err_vs_math"] = rel(o, math_attend(q, k, v, causal, 0.1)[0])
    return row


def layout_rows(shape: Shape, context: int, chunk: int, prefill: Callable, layouts: list[dict], timer: Callable,
                device: str, gen: torch.Generator) -> list[dict]:
    """The kernel alone (long_attend=None) at each layout: ms and its error against the default layout."""
    args = pass_inputs(shape, context, chunk, device, gen)
    kernel_only = functools.partial(prefill, long_attend=None)
    default = kernel_only(*args)
    rows = []
    for layout in [{}] + layouts:
        row = {"context": context, "chunk": chunk, "layout": layout or "default"}
        try:
            row["err_vs_default"] = rel(kernel_only(*args, **layout), default)
            row["ms"] = timer(lambda: kernel_only(*args, **layout))
            row["tflops"] = shape.flops(context, chunk) / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a layout that does not compile (shared memory) is reported
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
    return rows


def whole_prompt_s(rows: list[dict], column: str, chunk: int, prompt: int = PROMPT) -> float:
    """Attention seconds of one `prompt`-token prompt in passes of `chunk`, from the line through (C, ms)."""
    xs = [r["context"] for r in rows]
    ys = [r[column] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    passes = range(0, prompt, chunk)
    return MLA_LAYERS * sum(my + slope * (c - mx) for c in passes) / 1e3


def matmul_tflops(timer: Callable, device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device).bfloat16()
    b = torch.randn(n, n, device=device).bfloat16()
    return 2 * n ** 3 / (timer(lambda: a @ b) * 1e-3) / 1e12


def run(shape: Shape, contexts: list[int], chunk: int, crossover_chunks: list[int], crossover_contexts: list[int],
        prefill: Callable, attend: Attend, timer: Callable, device: str, eager_up_to: int = 65536,
        new_shapes: tuple[tuple[int, int, bool], ...] = NEW_SHAPES, layouts: list[dict] | None = None,
        layout_context: int = 65536) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "shape": asdict(shape), "chunk": chunk,
              "device": torch.cuda.get_device_name() if device == "cuda" else device,
              "matmul_tflops": matmul_tflops(timer, device, 8192 if device == "cuda" else 64), "rows": [],
              "crossover": [], "new_shape": []}
    for context in contexts:
        result["rows"].append(pass_row(shape, context, chunk, prefill, attend, timer, device, gen, eager_up_to))
        if device == "cuda":
            torch.cuda.empty_cache()
    result["layouts"] = layout_rows(shape, layout_context, chunk, prefill, LAYOUTS if layouts is None else layouts,
                                    timer, device, gen)
    for queries, keys, causal in new_shapes:
        result["new_shape"].append(new_shape_row(shape, queries, keys, causal, attend, timer, device, gen))
    for context in crossover_contexts:
        for m in crossover_chunks:
            result["crossover"].append(crossover_row(shape, context, m, prefill, timer, device, gen))
    result["prompt_attention_s"] = {
        col: whole_prompt_s(result["rows"], f"{col}_ms", chunk) for col in ("served", "triton", "cudnn_attention")}
    result["prompt_attention_s"]["matmul_ceiling"] = (
        MLA_LAYERS * shape.flops(0, PROMPT) / (result["matmul_tflops"] * 1e12))
    return result


def table(result: dict) -> str:
    mm = result["matmul_tflops"]
    lines = [f"{result['device']}  bf16 matmul {mm:.0f} TFLOP/s  MLA prefill, chunk {result['chunk']}",
             f"{'context':>9} | {'served':>22} | {'triton':>22} | {'cudnn attention':>16} | served peak | err",
             ]
    for r in result["rows"]:
        err = r.get("served_vs_eager", r["served_vs_triton"])
        lines.append(f"{r['context']:>9,} | {r['served_ms']:8.2f} ms {r['served_tflops']:5.0f} TF/s | "
                     f"{r['triton_ms']:8.2f} ms {r['triton_tflops']:5.0f} TF/s | "
                     f"{r['cudnn_attention_tflops']:9.0f} TF/s | {r['served_peak_gib']:8.2f} GiB | {err:.1e}")
    lines.append(f"kernel layouts at context {result['layouts'][0]['context']:,}:")
    for r in result["layouts"]:
        what = (f"{r['ms']:8.2f} ms {r['tflops']:5.0f} TF/s  err {r['err_vs_default']:.1e}" if "ms" in r
                else r["error"])
        lines.append(f"  {json.dumps(r['layout']):<48} {what}")
    for key, title in (("new_shape", ""), ("new_shape_avoid_recompile", ", TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1")):
        rows = result.get(key)
        if rows is None:
            continue
        lines.append(f"library at a new shape{title}, first call / warm:")
        if isinstance(rows, str):  # the fresh process failed: its error
            lines.append(f"  {rows}")
            continue
        for r in rows:
            err = f"  err {r['err_vs_math']:.1e}" if "err_vs_math" in r else ""
            lines.append(f"  {r['queries']:>6} x {r['keys']:>6} {'causal' if r['causal'] else 'unmasked':>8}  "
                         f"{r['first_ms']:8.1f} / {r['warm_ms']:7.2f} ms{err}")
    lines.append("library (long_pairs 0) vs kernel, one sequence:")
    for r in result["crossover"]:
        lines.append(f"  C {r['context']:>7,}  M {r['chunk']:>5}  pairs {r['pairs']:>12,}  library "
                     f"{r['library_ms']:8.3f} ms  kernel {r['kernel_ms']:8.3f} ms  x{r['library_speedup']:.2f}")
    lines.append("1,048,576-token prompt, attention of 7 MLA layers (s): " + ", ".join(
        f"{k} {v:.0f}" for k, v in result["prompt_attention_s"].items()))
    return "\n".join(lines)


def new_shapes_in_fresh_process(out: Path, env: dict[str, str]) -> list[dict] | str:
    """This script's `new_shape` rows run by a fresh process under `env` (read once by PyTorch): rows, or its error."""
    proc = subprocess.run([sys.executable, "-m", "bench.mla_prefill_long", "--new-shapes-only", "--out", str(out)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        return f"exit {proc.returncode}: {proc.stderr[-400:]}"
    return json.loads((out / "new_shapes.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--contexts", default="0,65536,253952,1040384")
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--crossover-chunks", default="256,1024,2048,4096,8192")
    p.add_argument("--crossover-contexts", default="32768,131072")
    p.add_argument("--new-shapes-only", action="store_true", help="only the library's new-shape rows")
    p.add_argument("--layouts-at", default="", help="only the kernel's layouts (the default, 3 stages, 128-key "
                   "tiles, 64-query blocks) at these CONTEXT:CHUNK points, e.g. 0:2048,32768:8192 (layouts.json)")
    args = p.parse_args()
    from shard_svc.ops import select_ops
    from shard_svc.ops.mla.cudnn import cudnn_attend

    args.out.mkdir(parents=True, exist_ok=True)
    timer = functools.partial(gpu_ms, warmup=3, rep=20)
    if args.new_shapes_only:
        gen = torch.Generator(device="cuda").manual_seed(0)
        rows = [new_shape_row(Shape(), m, n, c, cudnn_attend, timer, "cuda", gen) for m, n, c in NEW_SHAPES]
        (args.out / "new_shapes.json").write_text(json.dumps(rows, indent=1))
        return
    if args.layouts_at:
        gen = torch.Generator(device="cuda").manual_seed(0)
        prefill = select_ops(torch.device("cuda"), "triton").mla_prefill
        rows = [row for point in args.layouts_at.split(",") for row in layout_rows(
            Shape(), *map(int, point.split(":")), prefill, SWEEP_LAYOUTS, timer, "cuda", gen)]
        (args.out / "layouts.json").write_text(json.dumps(rows, indent=1))
        for r in rows:
            print(f"C {r['context']:>7,} M {r['chunk']:>5} {json.dumps(r['layout']):<48} "
                  + (f"{r['ms']:8.3f} ms  err {r['err_vs_default']:.1e}" if "ms" in r else r["error"]))
        return
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    result = run(Shape(), ints(args.contexts), args.chunk, ints(args.crossover_chunks), ints(args.crossover_contexts),
                 select_ops(torch.device("cuda"), "triton").mla_prefill, cudnn_attend, timer, "cuda")
    result["new_shape_avoid_recompile"] = new_shapes_in_fresh_process(
        args.out / "avoid_recompile", {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"})
    (args.out / "mla_prefill_long.json").write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
