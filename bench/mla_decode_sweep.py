"""Absorbed MLA decode at the Kimi-Linear-48B shape: layouts of the Triton kernel against the KV bytes it must read.

    python -m bench.mla_decode_sweep --out DIR       # prints a table, writes mla_decode_sweep.json

32 heads, latent 512 + rope 64, bf16 cache in 64-token pages (shuffled), 4,096 tokens of context, batch 1..256.
Each layout (token tile, pipeline stages, split waves) is checked against the default layout's output, and the
default against the eager reference where the eager path is affordable (batch <= 16); the copy ceiling is measured
in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from bench.measure import copy_bytes_per_s, gpu_ms
from shard_svc.ops.mla import eager
from shard_svc.ops.triton.mla_decode import mla_decode

NH, NOPE, ROPE, V, LORA, PAGE, CTX = 32, 128, 64, 128, 512, 64, 4096
LAYOUTS = [dict(block_n=bn, num_stages=st, waves=wv) for bn, st, wv in itertools.product((32, 64), (2, 3), (2, 4, 8))]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def batch_inputs(b: int, gen: torch.Generator) -> tuple:
    per = CTX // PAGE
    cache = torch.randn(b * per, PAGE, LORA + ROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    tables = torch.randperm(b * per, device="cuda", generator=gen).view(b, per).int()
    q = torch.randn(b, NH, NOPE + ROPE, device="cuda", dtype=torch.bfloat16, generator=gen)
    w_kv_b = torch.randn(NH * (NOPE + V), LORA, device="cuda", dtype=torch.bfloat16, generator=gen) * LORA**-0.5
    return (q[..., :NOPE], q[..., NOPE:], cache, w_kv_b, tables, torch.full((b,), CTX - 1, device="cuda"),
            torch.arange(b + 1, device="cuda"), (NOPE + ROPE) ** -0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--batches", default="1,16,64,256")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    copy_tbps = copy_bytes_per_s("cuda") / 1e12
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "copy_TBps": copy_tbps,
              "rows": []}
    lines = [f"{result['device']}  copy {copy_tbps:.2f} TB/s  MLA decode, 32 heads, 4k context"]
    for batch in (int(x) for x in args.batches.split(",")):
        inputs = batch_inputs(batch, gen)
        kv_bytes = inputs[2].numel() * 2
        default = mla_decode(*inputs)
        err_eager = rel(default, eager.mla_attention(*inputs)) if batch <= 16 else None
        for layout in [{}] + LAYOUTS:
            row = {"batch": batch, "layout": layout or "default"}
            try:
                row["err_vs_default"] = rel(mla_decode(*inputs, **layout), default)
                row["us"] = 1e3 * gpu_ms(lambda: mla_decode(*inputs, **layout), warmup=5, rep=50)
                row["kv_TBps"] = kv_bytes / (row["us"] * 1e-6) / 1e12
                row["of_copy"] = row["kv_TBps"] / copy_tbps
            except Exception as e:  # noqa: BLE001 - a layout that does not compile is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            if not layout:
                row["err_vs_eager"] = err_eager
            result["rows"].append(row)
            if "us" in row:
                lines.append(f"B={batch:<4} {json.dumps(layout or 'default'):<48} {row['us']:8.1f} us  "
                             f"{row['kv_TBps']:5.2f} TB/s ({100 * row['of_copy']:4.1f}% of copy)  "
                             f"err {row['err_vs_default']:.1e}")
            else:
                lines.append(f"B={batch:<4} {json.dumps(layout)}  {row['error']}")
        del inputs
        torch.cuda.empty_cache()
        (args.out / "mla_decode_sweep.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
