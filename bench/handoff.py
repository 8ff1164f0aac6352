"""What moving one sequence's state to another shard costs on this machine (shard_svc/engine/handoff.py), at the
Kimi-Linear-48B shape (bench/configs.py), for contexts of --tokens tokens: the copy of its KDA state slot and the KV
blocks of its tokens to host memory (HostCopier.save), packing them as the safetensors blob that travels, unpacking
it on the receiver, checking it against the pools, and the copy into a fresh slot and blocks there
(HostCopier.load); every figure the median of --repeats runs, and the restored state compared bit for bit. The
network between the shards is not measured: divide the bytes by its bandwidth (twice: through the router).

    python -m bench.handoff --out bench/results/handoff_h200_DATE.json [--device cuda] [--tokens 4096,32768,131072]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.configs import KIMI_LINEAR_48B
from shard_svc.config import ModelConfig
from shard_svc.engine.handoff import PackedState, SequenceState
from shard_svc.state.host_copy import HostCopier
from shard_svc.state.pools import KDAStatePool, MLAKVCache

log = logging.getLogger(__name__)
BLOCK = 16


def _timed(fn, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


def measure(cfg: ModelConfig, device: torch.device, tokens: int, repeats: int) -> dict:
    """One context length: the median seconds of each step and the bytes moved."""
    kda = KDAStatePool(cfg, 2, device, torch.bfloat16)
    kv = MLAKVCache(cfg, 2 * -(-tokens // BLOCK), BLOCK, device, torch.bfloat16)
    kda.recurrent.normal_()
    kda.conv.normal_()
    kv.reserve("source", tokens)
    source_blocks = kv.blocks.table("source")
    kv.kv[:, source_blocks] = torch.randn_like(kv.kv[:, source_blocks])  # indexing copies: assign, not normal_()
    copier = HostCopier(kda, kv)
    ids = list(range(tokens))
    times: dict[str, list[float]] = {"save": [], "pack": [], "unpack": [], "check": [], "load": []}
    for _ in range(repeats):
        host, t = _timed(lambda: copier.save(0, source_blocks, tokens), device)
        times["save"].append(t)
        packed, t = _timed(lambda: SequenceState(ids, host).pack(), device)
        times["pack"].append(t)
        arrived, t = _timed(lambda: PackedState(packed.tokens, packed.data).unpack("bench"), device)
        times["unpack"].append(t)
        _, t = _timed(lambda: copier.check(arrived.host, tokens, "bench"), device)
        times["check"].append(t)
        kv.blocks.release("dest")
        _, t = _timed(lambda: copier.load(arrived.host, "dest", 1, tokens), device)
        times["load"].append(t)
    dest_blocks = kv.blocks.table("dest")
    exact = (torch.equal(kda.recurrent[:, 0], kda.recurrent[:, 1]) and torch.equal(kda.conv[:, 0], kda.conv[:, 1])
             and torch.equal(kv.kv[:, source_blocks], kv.kv[:, dest_blocks]))
    median = {k: statistics.median(v) for k, v in times.items()}
    nbytes = packed.nbytes
    return {"tokens": tokens, "state_bytes": nbytes, "kda_bytes": host.recurrent.nbytes + host.conv.nbytes,
            "kv_bytes": host.kv.nbytes, "seconds": median, "exact": exact,
            "total_s": sum(median.values()), "gb_per_s": nbytes / sum(median.values()) / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="4096,32768,131072", help="context lengths, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig.from_dict(dict(KIMI_LINEAR_48B))
    rows = [measure(cfg, device, int(n), args.repeats) for n in args.tokens.split(",")]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "shape": "kimi-linear-48b", "repeats": args.repeats, "rows": rows}
    header = (f"{'tokens':>8} {'MiB':>8} {'save':>7} {'pack':>7} {'unpack':>7} {'check':>7} {'load':>7} "
              f"{'GB/s':>6} exact")
    lines = [header] + [f"{r['tokens']:>8} {r['state_bytes'] / 2**20:>8.1f} " + " ".join(
        f"{r['seconds'][k]:>7.3f}" for k in ("save", "pack", "unpack", "check", "load"))
        + f" {r['gb_per_s']:>6.2f} {r['exact']}" for r in rows]
    sys.stdout.write("\n".join(lines) + "\n")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
