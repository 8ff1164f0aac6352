"""Which kernel breaks whole-model parity? Runs tiny checkpoints on the GPU with the eager backend plus ONE Triton
op at a time, and reports each op's effect on the prompt logits against the all-eager run, in float32 (where a
correct kernel differs by rounding only) and in bfloat16 (next to the bf16-vs-fp32 noise of the eager path itself:
random deep MoE models amplify rounding and can flip near-tied experts). The `dense-routing` variants route every
token to every expert (top_k = num_experts), which removes that discontinuity, so whole-model greedy tokens can be
compared between kernels and eager.

    python -m bench.op_parity --out DIR [--families kimi_linear,kimi_k3] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.make_tiny import make_tiny
from shard_svc.ops import BACKENDS, select_ops

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 140)), [42] * 65]
DEVICE = torch.device("cuda")


def dense_routing(model_dir: Path) -> None:
    """Rewrites config.json so every token routes to every expert (no top-k discontinuity)."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    text = raw.get("text_config", raw)
    text["num_experts_per_token"] = text["num_experts"]
    path.write_text(json.dumps(raw))


def prompt_logits(cfg, model, ops) -> torch.Tensor:
    engine = Engine(cfg, model, ops, DEVICE, EngineConfig(num_state_slots=len(PROMPTS), num_kv_blocks=256))
    seqs = [engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=1), keep_prompt_logits=True)
            for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return torch.cat([torch.cat(s.prompt_logits) for s in seqs])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--families", default="kimi_linear,kimi_k3")
    p.add_argument("--device", default="cuda", help="cpu works with TRITON_INTERPRET=1 (slow)")
    args = p.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    eager = select_ops(DEVICE, "eager")
    kernels = BACKENDS["triton"]()
    report = {}
    variants = [(f, d) for f in args.families.split(",") for d in (False, True)]
    for family_name, dense in variants:
        family = family_name + ("/dense-routing" if dense else "")
        with tempfile.TemporaryDirectory() as tmp:
            make_tiny(family_name, Path(tmp) / "m", seed=0)
            if dense:
                dense_routing(Path(tmp) / "m")
            models = {dt: load_model(Path(tmp) / "m", device=DEVICE, dtype=getattr(torch, dt))
                      for dt in ("float32", "bfloat16")}
        refs = {dt: prompt_logits(cfg, model, eager) for dt, (cfg, model) in models.items()}
        report[f"{family}/eager bf16 vs eager fp32"] = rel(refs["bfloat16"], refs["float32"])
        all_kernels = {dt: prompt_logits(cfg, model, select_ops(DEVICE, "triton")) for dt, (cfg, model) in
                       models.items()}
        for dt in models:
            report[f"{family}/{dt}/all kernels"] = rel(all_kernels[dt], refs[dt])
        for dt, (cfg, model) in models.items():
            for name, impl in kernels.items():
                try:
                    got = prompt_logits(cfg, model, replace(eager, **{name: impl}))
                    report[f"{family}/{dt}/{name}"] = rel(got, refs[dt])
                except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
                    report[f"{family}/{dt}/{name}"] = f"failed: {type(e).__name__}: {e}"[:300]
    for key, err in report.items():
        print(f"{key:<48} {err if isinstance(err, str) else f'{err:.2e}'}")
    (args.out / "op_parity.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
