"""What batch-invariant mode costs in the linears of a prefill pass: the invariant GEMM
(shard_svc/ops/triton/invariant_linear.py, one tiling for every M) against F.linear (cuBLAS) on Kimi-Linear-48B's
linears, at several pass sizes, in the same run, and whether each keeps a row's bits when the pass is shorter.

    PYTHONPATH=$PWD python -m bench.invariant_linear --out DIR [--m 40,256,1024,3712,8192]

Shapes and counts per pass come from the model (bench/linear_micro.py `decode_linears`: one call per use, lm_head
left out, since a prefill pass computes logits for its last rows only). For each M: the pass's linears summed (each
shape's median time x its calls), both ways, and their ratio; per shape, TFLOP/s. Invariance: the last 40 rows of
an M-row product against the same 40 rows computed alone, bit for bit, per shape and per side (cuBLAS is expected
to fail it at some shapes; the invariant GEMM must not). Writes invariant_linear.json and prints a table. Its
pieces run in the interpreter on a tiny model in tests/kernels/test_invariant_linear.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.configs import KIMI_LINEAR_48B
from bench.linear_micro import Timer, _inputs, decode_linears, gpu_timer
from shard_svc.config import ModelConfig

log = logging.getLogger("bench.invariant_linear")
TAIL = 40  # rows of the invariance check: a chat's new message after a restored system prompt


def pass_linears(cfg: ModelConfig) -> list[tuple[int, int, int]]:
    """(N, K, calls per pass) of a prefill pass's linears."""
    return [(u.n, u.k, u.count) for u in decode_linears(cfg) if not u.role.startswith("lm_head")]


def time_pass(shapes: list[tuple[int, int, int]], m: int, dtype: torch.dtype, device: torch.device,
              timer: Timer) -> dict:
    from shard_svc.ops.triton.invariant_linear import invariant_linear

    rows, totals = [], {"cublas_ms": 0.0, "invariant_ms": 0.0}
    for n, k, calls in shapes:
        x, w = _inputs(m, n, k, dtype, device)
        row = {"n": n, "k": k, "calls": calls}
        for name, fn in (("cublas", F.linear), ("invariant", invariant_linear)):
            ms = timer(lambda fn=fn: fn(x, w))
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
            row[f"{name}_tail_bitwise"] = bool(torch.equal(fn(x[-TAIL:], w), fn(x, w)[-TAIL:])) if m > TAIL else None
            totals[f"{name}_ms"] += ms * calls
        rows.append(row)
    return {"m": m, **totals, "invariant_over_cublas": totals["invariant_ms"] / totals["cublas_ms"], "shapes": rows}


def table(result: dict) -> str:
    lines = [f"{'M':>6} {'cuBLAS ms':>10} {'invariant ms':>13} {'ratio':>6}  tail rows bit for bit "
             f"(cuBLAS / invariant, of {len(result['passes'][0]['shapes'])} shapes)"]
    for p in result["passes"]:
        same = [sum(bool(s[f"{side}_tail_bitwise"]) for s in p["shapes"]) for side in ("cublas", "invariant")]
        checked = "" if p["m"] <= TAIL else f"{same[0]} / {same[1]}"
        lines.append(f"{p['m']:>6} {p['cublas_ms']:>10.3f} {p['invariant_ms']:>13.3f} "
                     f"{p['invariant_over_cublas']:>6.2f}  {checked}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--m", default="40,256,1024,3712,8192", help="rows of the pass (tokens), comma-separated")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    shapes = pass_linears(ModelConfig.from_dict(KIMI_LINEAR_48B))
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "dtype": str(dtype),
              "gpu": torch.cuda.get_device_name(),
              "passes": [time_pass(shapes, int(m), dtype, device, gpu_timer) for m in args.m.split(",")]}
    (args.out / "invariant_linear.json").write_text(json.dumps(result, indent=1))
    log.info("\n%s", table(result))


if __name__ == "__main__":
    main()
