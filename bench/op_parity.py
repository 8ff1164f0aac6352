"""Which kernel breaks whole-model parity? Runs tiny checkpoints on the GPU with the eager backend plus ONE Triton
op at a time, and reports each op's effect on the prompt logits against the all-eager run, in float32 (where a
correct kernel differs by rounding only) and in bfloat16 (next to the bf16-vs-fp32 noise of the eager path itself:
random deep MoE models amplify rounding and can flip near-tied experts).

    python -m bench.op_parity --out DIR
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


def prompt_logits(cfg, model, ops) -> torch.Tensor:
    engine = Engine(cfg, model, ops, torch.device("cuda"), EngineConfig(num_state_slots=len(PROMPTS),
                                                                         num_kv_blocks=256))
    seqs = [engine.add_request(f"p{i}", p, SamplingParams(max_tokens=1), keep_prompt_logits=True)
            for i, p in enumerate(PROMPTS)]
    while engine.has_work():
        engine.step()
    return torch.cat([torch.cat(s.prompt_logits) for s in seqs])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    eager = select_ops(torch.device("cuda"), "eager")
    kernels = BACKENDS["triton"]()
    report = {}
    for family in ("kimi_linear", "kimi_k3"):
        with tempfile.TemporaryDirectory() as tmp:
            make_tiny(family, Path(tmp) / "m", seed=0)
            models = {dt: load_model(Path(tmp) / "m", device="cuda", dtype=getattr(torch, dt))
                      for dt in ("float32", "bfloat16")}
        refs = {dt: prompt_logits(cfg, model, eager) for dt, (cfg, model) in models.items()}
        report[f"{family}/eager bf16 vs eager fp32"] = rel(refs["bfloat16"], refs["float32"])
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
