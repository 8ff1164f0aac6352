"""GPU check of capacity from memory (issue 25): the 48B-shape engine built as a shard builds it with no capacity flag,
then loaded to its limits, with the device's memory watched against the budget it was sized for.

Records what the sizing chose (slots, blocks, entries, prefill budget, max_model_len), then fills every state slot
with a prompt of --input-len tokens generating --output-len, and runs each --long-prompts prompt; after each phase the
peak memory torch reserved and allocated and the device's least free memory. `within_budget` is true when the peak in
use stayed at or under --gpu-memory-utilization of the total; `needed_within_budget` when what the passes allocated
did (the difference is torch's cache of freed blocks, which it gives back before it would fail an allocation).
Writes capacity.json.

    python -m bench.capacity --out DIR [--gpu-memory-utilization 0.9] [--long-prompts 262144,1048000]
    python -m bench.capacity --out DIR --dry-run      # the same code on the CPU with the tiny checkpoint
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.served import model_dir
from shard_svc.build import EngineOptions, build_engine
from shard_svc.engine.capacity import CapacityRequest
from shard_svc.engine.sampling import SamplingParams

GiB = float(1 << 30)


def memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"total_gib": total / GiB, "in_use_gib": (total - free) / GiB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GiB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GiB}


def run_phase(engine, prompts: list[list[int]], params: SamplingParams, device: torch.device, name: str) -> dict:
    start = time.perf_counter()
    least_free = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, ids in enumerate(prompts):
        engine.add_request(f"{name}-{i}", ids, params)
    finished = 0
    while engine.has_work():
        finished += sum(e.finish_reason is not None for e in engine.step().events)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            least_free = free if least_free is None else min(least_free, free)
    out = {"requests": len(prompts), "finished": finished, "seconds": time.perf_counter() - start,
           **memory(device)}
    if least_free is not None:
        out["peak_in_use_gib"] = out["total_gib"] - least_free / GiB
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--long-prompts", default="262144,1048000",
                   help="comma-separated prompt lengths, each run alone after the full-slots phase")
    p.add_argument("--dry-run", action="store_true", help="the tiny checkpoint on the CPU, toy sizes")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        args.input_len, args.output_len, args.long_prompts = 32, 4, "2048,3000"
        torch.set_num_threads(1)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "device": str(device)}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), tiny=args.dry_run)
        request = CapacityRequest(gpu_memory_utilization=args.gpu_memory_utilization)
        opts = EngineOptions(model, str(device), load_format="safetensors" if args.dry_run else "dummy",
                             warm_up=True, capacity=request)
        start = time.perf_counter()
        engine = build_engine(opts).engine
    cfg = engine.advertised_cfg
    result["build_s"] = time.perf_counter() - start
    result["chosen"] = {"state_slots": cfg.num_state_slots, "kv_blocks": cfg.num_kv_blocks,
                        "kv_block_size": cfg.kv_block_size, "prefix_cache_entries": cfg.prefix_cache_entries,
                        "prefill_token_budget": cfg.prefill_token_budget, "max_model_len": engine.max_model_len}
    result["after_build"] = memory(device)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    full = [[(k * 7919 + i * 104729) % 400 + 1 for i in range(args.input_len)] for k in range(cfg.num_state_slots)]
    result["all_slots"] = run_phase(engine, full, params, device, "full")
    result["long_prompts"] = []
    for tokens in (int(n) for n in args.long_prompts.split(",") if n):
        if tokens + 1 <= engine.max_model_len:
            long = [[(i * 104729) % 400 + 1 for i in range(tokens)]]
            result["long_prompts"].append({"tokens": tokens, **run_phase(
                engine, long, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), device, "long")})
        else:
            result["long_prompts"].append({"tokens": tokens, "refused": f"over max_model_len {engine.max_model_len}"})
    phases = [result["all_slots"], *result["long_prompts"]]
    if device.type == "cuda":
        budget = args.gpu_memory_utilization * result["after_build"]["total_gib"]
        result["within_budget"] = max(r.get("peak_in_use_gib", 0.0) for r in phases) <= budget
        # What torch held but had freed (its cache) counts above; what the passes needed: the peak allocated, plus
        # what is in use outside torch's allocator (the CUDA context, other processes).
        outside = result["after_build"]["in_use_gib"] - result["after_build"]["reserved_gib"]
        result["needed_within_budget"] = max(r.get("peak_allocated_gib", 0.0) for r in phases) + outside <= budget
    (args.out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
