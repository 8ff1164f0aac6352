"""Where a split prefill first rounds differently from one pass: the op (or the code between two ops) to blame.

A prompt prefilled as `--context` tokens and then a short tail gives other bf16 logits than one pass over it
(README, "Split invariance"), and a prefix-cache restore is such a split. This runs both op by op with every op of
the backend (ops/__init__.py `Ops`: the linears, norms, KDA, MLA, MoE) recorded, and compares the tail's rows call by
call: the first call whose inputs are bit for bit the one pass's but whose output is not names an op that rounds by
the pass's size; a first call whose inputs already differ puts the cause in the model code between it and the call
before (torch ops outside the seam: products in the MLA absorption, the gates, ...).

    python -m bench.split_divergence --out DIR [--layers 16] [--context 3712] [--tails 40,200] [--batch-invariant]
        [--pad-linear-rows N] [--expert-block-m N]

`--pad-linear-rows N` runs every linear on at least N rows (zero rows appended, the result cut back): both passes'
products then have one shape, so a library that picks its kernel by M rounds them alike, and the next op to blame
shows; `--expert-block-m N` fixes the routed experts' M-block (the Triton kernels otherwise pick it by the pass's
size) and composes the shared expert from linear and glu.

Writes DIR/split_divergence.json and prints one line per tail. `--device cpu --layers 2 --context 256` runs anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from bench.pass_overhead import continuation, dummy_48b, eager
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import select_ops
from shard_svc.ops.batch_invariant import batch_invariant

log = logging.getLogger("bench.split_divergence")


@dataclass
class Call:
    """One op call of a pass: its row-wise tensors (first dim = the pass's tokens), the last `tail` rows kept."""

    op: str
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


def _rows(values, tokens: int, tail: int) -> list[torch.Tensor]:
    flat = []
    for v in values:
        flat.extend(v if isinstance(v, (tuple, list)) else [v])
    return [v[-tail:].detach().clone() for v in flat
            if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == tokens]


def recorded(engine: Engine, tokens: int, tail: int, fn: Callable[[], object]) -> list[Call]:
    """fn() (one pass of `tokens` tokens) with every op call recorded."""
    ops, calls = engine.runner.ops, []

    def wrap(name: str, op: Callable) -> Callable:
        def run(*args, **kwargs):
            out = op(*args, **kwargs)
            calls.append(Call(name, _rows([*args, *kwargs.values()], tokens, tail), _rows([out], tokens, tail)))
            return out
        return run

    engine.runner.ops = dataclasses.replace(ops, **{
        f.name: wrap(f.name, getattr(ops, f.name)) for f in dataclasses.fields(ops)
        if f.name != "backends" and getattr(ops, f.name) is not None})
    try:
        fn()
    finally:
        engine.runner.ops = ops
    return calls


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b) if x.shape == y.shape),
               default=float("nan"))


def first_divergence(one_pass: list[Call], split: list[Call]) -> dict:
    """The first call where the split's tail rows leave the one pass's: {"call", "op", "cause": "op" (inputs equal,
    output differs) | "before" (inputs already differ) | "none", "max_abs_diff", "previous_op"}; per op, how many of
    its calls differ in output. Raises ValueError when the two passes call other ops in another order."""
    names = [c.op for c in one_pass], [c.op for c in split]
    if names[0] != names[1]:
        at = next((i for i, (a, b) in enumerate(zip(*names)) if a != b), min(map(len, names)))
        raise ValueError(f"the passes call different ops from call {at} on ({len(names[0])} and {len(names[1])} "
                         f"calls)")
    first = {"call": None, "op": None, "cause": "none", "max_abs_diff": 0.0, "previous_op": None}
    differing: dict[str, int] = {}
    for i, (a, b) in enumerate(zip(one_pass, split)):
        if not _same(a.outputs, b.outputs):
            differing[a.op] = differing.get(a.op, 0) + 1
        if first["call"] is not None:
            continue
        if not _same(a.inputs, b.inputs):
            first.update(call=i, op=a.op, cause="before", max_abs_diff=_max_diff(a.inputs, b.inputs),
                         previous_op=one_pass[i - 1].op if i else None)
        elif not _same(a.outputs, b.outputs):
            first.update(call=i, op=a.op, cause="op", max_abs_diff=_max_diff(a.outputs, b.outputs),
                         previous_op=one_pass[i - 1].op if i else None)
    return {**first, "calls": len(one_pass), "differing_outputs_by_op": differing}


def padded_linear(linear: Callable, rows: int) -> Callable:
    """`linear` on at least `rows` rows: x padded with zero rows, the product cut back to x's."""
    def run(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] >= rows:
            return linear(x, weight)
        padded = torch.zeros(rows, x.shape[1], dtype=x.dtype, device=x.device)
        padded[:x.shape[0]] = x
        return linear(padded, weight)[:x.shape[0]]
    return run


def divergence(engine: Engine, context: int, tail: int) -> dict:
    whole = continuation(engine, 0, context + tail, "div-whole")
    split = continuation(engine, context, tail, "div-split")  # runs the context pass now, unrecorded
    try:
        a = recorded(engine, context + tail, tail, eager(engine, whole))
        b = recorded(engine, tail, tail, eager(engine, split))
    finally:
        engine.cancel("div-whole")
        engine.cancel("div-split")
    return {"context": context, "tail": tail, **first_divergence(a, b)}


def summary(row: dict) -> str:
    head = f"context {row['context']} + tail {row['tail']}: "
    if row["cause"] == "none":
        return head + f"every one of {row['calls']} op calls bit for bit"
    where = (f"op {row['op']} (call {row['call']} of {row['calls']}) rounds differently on equal inputs"
             if row["cause"] == "op" else
             f"the inputs of {row['op']} (call {row['call']}) already differ: the code after {row['previous_op']}")
    return head + f"{where}, max |diff| {row['max_abs_diff']:.3g}; outputs differing by op " + str(
        row["differing_outputs_by_op"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the 48B shape's 27")
    p.add_argument("--context", type=int, default=3712)
    p.add_argument("--tails", default="40,200")
    p.add_argument("--pad-linear-rows", type=int, default=0, help="run every linear on at least this many rows")
    p.add_argument("--expert-block-m", type=int, default=0, help="the routed experts' M-block (Triton backend)")
    p.add_argument("--batch-invariant", action="store_true", help="the shard's --batch-invariant ops")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cfg, model = dummy_48b(device, args.layers)
    tails = [int(t) for t in args.tails.split(",") if t]
    engine_cfg = EngineConfig(num_state_slots=4, kv_block_size=64, prefill_token_budget=1 << 20,
                              num_kv_blocks=2 * (args.context + max(tails)) // 64 + 8)
    engine = Engine(cfg, model, select_ops(device), device, engine_cfg)
    ops = batch_invariant(engine.runner.ops) if args.batch_invariant else engine.runner.ops
    if args.pad_linear_rows:
        ops = dataclasses.replace(ops, linear=padded_linear(ops.linear, args.pad_linear_rows))
    if args.expert_block_m:
        ops = dataclasses.replace(ops, moe_experts=functools.partial(ops.moe_experts, block_m=args.expert_block_m),
                                  moe_experts_shared=None)
    engine.runner.ops = ops
    result = {"date": time.strftime("%Y-%m-%d"), "device": str(device), "layers": cfg.num_layers,
              "dtype": str(next(model.parameters()).dtype), "op_backends": dict(engine.runner.ops.backends),
              "batch_invariant": args.batch_invariant, "pad_linear_rows": args.pad_linear_rows,
              "expert_block_m": args.expert_block_m,
              "tails": [divergence(engine, args.context, t) for t in tails]}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    (args.out / "split_divergence.json").write_text(json.dumps(result, indent=1))
    for row in result["tails"]:
        log.info(summary(row))


if __name__ == "__main__":
    main()
