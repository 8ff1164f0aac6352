"""Why a trained model's bf16 replies leave its fp32 ones: how close its top-k routing choices come to ties, and how
far a small perturbation of every layer's output travels, with the routing free and with every choice pinned to the
unperturbed run's. Eager engine, held-out windows teacher-forced (bench/trained_parity.py's), on the CPU by default.

Rows: `margin`: the share of routing choices (token x MoE layer) whose k-th and (k+1)-th biased scores are closer
than 1e-5 / 1e-4 / 1e-3 / 1e-2; then per perturbation (every decoder layer's output times 1 + eps * N(0, 1), or the
whole model in bf16), with routing free and pinned: the share of next-token argmaxes equal to the fp32 run's and the
largest logit difference relative to the largest logit.

    python -m bench.routing_sensitivity --out DIR [--models models/kimi-k3-austen ...] [--windows 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch

from bench.trained_parity import REPO, held_out_windows, run
from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.ops import select_ops
from shard_svc.ops.moe.eager import chosen_weights, moe_route, router_scores
from shard_svc.ops.precision import upcast

log = logging.getLogger("bench.routing_sensitivity")

MARGINS = (1e-5, 1e-4, 1e-3, 1e-2)
NOISE = (1e-6, 1e-5, 1e-4, 1e-3)


class Routing:
    """moe_route that records each call's choices and margins, or replays recorded choices (weights recomputed from
    this run's scores, as the model would with those experts chosen)."""

    def __init__(self):
        self.recorded: list[torch.Tensor] = []
        self.margins: list[torch.Tensor] = []
        self.pinned, self.calls = False, 0

    def __call__(self, x, gate_weight, bias, top_k, renormalize, scaling):
        if self.pinned:
            ids = self.recorded[self.calls]
            self.calls += 1
            return chosen_weights(router_scores(x, gate_weight), ids, renormalize, scaling), ids
        weights, ids = moe_route(x, gate_weight, bias, top_k, renormalize, scaling)
        top = (router_scores(x, gate_weight) + upcast(bias)).topk(top_k + 1, -1).values
        self.recorded.append(ids)
        self.margins.append((top[:, top_k - 1] - top[:, top_k]).flatten())
        return weights, ids


def perturbed(forward, eps: float, generator: torch.Generator):
    """A decoder layer's forward whose output (the hidden state; the first of a (h, pending) pair) is scaled by
    1 + eps * noise."""
    def noisy(*args, **kwargs):
        out = forward(*args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        h = h * (1 + eps * torch.randn(h.shape, generator=generator, dtype=h.dtype, device=h.device))
        return (h, *out[1:]) if isinstance(out, tuple) else h
    return noisy


def prompt_logits(path: Path, windows: list[list[int]], routing: Routing, dtype: torch.dtype,
                  eps: float) -> torch.Tensor:
    cfg, model = load_model(path, dtype=dtype)
    if eps:
        generator = torch.Generator().manual_seed(0)
        name = "forward_attn_res" if cfg.attn_res_block_size else "forward"
        for layer in model.model.layers:
            setattr(layer, name, perturbed(getattr(layer, name), eps, generator))
    routing.calls = 0
    ops = dataclasses.replace(select_ops(torch.device("cpu"), "eager"), moe_route=routing)
    engine = Engine(cfg, model, ops, torch.device("cpu"),
                    EngineConfig(num_state_slots=len(windows), num_kv_blocks=len(windows) * 20 + 8,
                                 prefill_token_budget=sum(map(len, windows))))
    seqs = run(engine, windows, 1, keep_prompt_logits=True)
    return torch.stack([torch.cat(s.prompt_logits).float() for s in seqs])[:, :-1]


def measure(path: Path, windows: int) -> dict:
    ids = held_out_windows(path)[:windows]
    routing = Routing()
    ref = prompt_logits(path, ids, routing, torch.float32, 0.0)
    margins = torch.cat(routing.margins)
    report = {"routing_calls": len(routing.recorded), "choices": margins.numel(),
              "margin_below": {f"{m:g}": float((margins < m).float().mean()) for m in MARGINS}, "runs": []}
    for pinned in (False, True):
        for label, dtype, eps in [*((f"noise {e:g}", torch.float32, e) for e in NOISE), ("bf16", torch.bfloat16, 0.0)]:
            frozen = Routing()
            frozen.recorded, frozen.pinned = routing.recorded, pinned
            got = prompt_logits(path, ids, frozen, dtype, eps)
            report["runs"].append({
                "perturbation": label, "routing": "pinned" if pinned else "free",
                "top1_agreement": float((got.argmax(-1) == ref.argmax(-1)).float().mean()),
                "max_rel_logit_diff": float((got - ref).abs().max() / ref.abs().max())})
            log.info("run done", extra={"model": path.name, **report["runs"][-1]})
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.routing_sensitivity", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", nargs="+", type=Path, default=[REPO / "models" / "kimi-k3-austen"])
    p.add_argument("--windows", type=int, default=4, help="held-out windows of 256 tokens")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    torch.set_num_threads(1)
    result = {"windows": args.windows, "models": {m.name: measure(m, args.windows) for m in args.models}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing_sensitivity.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = []
    for name, r in result["models"].items():
        below = ", ".join(f"<{k}: {v:.4f}" for k, v in r["margin_below"].items())
        lines.append(f"{name}: {r['choices']} routing choices in {r['routing_calls']} calls; margins {below}")
        lines.append(f"  {'perturbation':<14} {'routing':<8} {'top-1 agree':>11} {'max rel diff':>13}")
        lines += [f"  {x['perturbation']:<14} {x['routing']:<8} {x['top1_agreement']:>11.4f} "
                  f"{x['max_rel_logit_diff']:>13.2e}" for x in r["runs"]]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
