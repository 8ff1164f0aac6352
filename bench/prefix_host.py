"""The prefix cache's host tier: what copying a cached prefix to host memory and back costs, against prefilling it.

For a prefix of --tokens tokens (2,048) with the tiny kimi_linear checkpoint (or --model DIR): the prefill pass of
the whole prefix, the copy of its cache entry (KDA state slot, KV blocks, logits row) to the host (what an eviction
costs) and back into a fresh slot and blocks (what a host hit costs), and end to end a request of the prefix + 16
new tokens answered with its prefix restored from the host against the same request without a cache. Each figure is
the median of --repeats runs. Writes JSON to --out and prints it.

    python -m bench.prefix_host --out bench/results/prefix_host_copy_cpu_DATE.json [--device cpu] [--tokens 2048]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops

BLOCK = 16
NEW = 16  # tokens past the cached prefix in the end-to-end request
ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _engine(cfg, model, device: torch.device, tokens: int, cache: bool) -> Engine:
    blocks = 4 * -(-(tokens + NEW + 1) // BLOCK)  # room for the prefix, its entry and a second request
    return Engine(cfg, model, select_ops(device), device, EngineConfig(
        num_state_slots=2, num_kv_blocks=blocks, kv_block_size=BLOCK, prefill_token_budget=tokens + NEW,
        prefix_cache_entries=1 if cache else 0, prefix_host_entries=1 if cache else 0))


def measure(model_dir: Path, device: torch.device, tokens: int, repeats: int) -> dict:
    cfg, model = load_model(model_dir, device)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(1, min(cfg.vocab_size, 500), (tokens,), generator=gen).tolist()
    other = torch.randint(1, min(cfg.vocab_size, 500), (32,), generator=gen).tolist()
    request = prefix + torch.randint(1, min(cfg.vocab_size, 500), (NEW,), generator=gen).tolist()
    cached, plain = _engine(cfg, model, device, tokens, True), _engine(cfg, model, device, tokens, False)
    plain.generate(request, ONE, "warm-up")

    prefill, save, load, with_host, without = [], [], [], [], []
    for i in range(repeats):
        prefill.append(_timed(lambda: plain.generate(prefix, ONE, f"prefill-{i}"), device))
        cache = cached.prefix_cache
        cache.clear()
        cached.generate(prefix, ONE, f"prefix-{i}")  # its entry on the device
        entry = cache.lookup(prefix)
        saved = []
        save.append(_timed(lambda: saved.append(cache.host.save(entry.tokens, entry.slot,
                                                                 cache.blocks.table(entry.owner), entry.logits)),
                           device))
        slot = cache.slots.allocate("bench-load")
        load.append(_timed(lambda: cache.host.load(saved[0], "bench-load", slot), device))
        cache.blocks.release("bench-load")
        cache.slots.free(slot)
        cache.host.dropped(saved[0])
        cached.generate(other, ONE, f"other-{i}")  # the prefix's entry is evicted to the host
        assert cache.host_entries == 1 and cache.lookup(prefix) is not None
        seq = []
        with_host.append(_timed(lambda: seq.append(cached.generate(request, ONE, f"hit-{i}")), device))
        assert seq[0].cached_tokens == tokens, f"expected a host hit of {tokens} tokens, got {seq[0].cached_tokens}"
        without.append(_timed(lambda: plain.generate(request, ONE, f"miss-{i}"), device))
    host_bytes = saved[0].nbytes
    ms = lambda xs: round(1e3 * statistics.median(xs), 2)  # noqa: E731
    return {"model": str(model_dir), "device": str(device), "prefix_tokens": tokens, "repeats": repeats,
            "entry_host_bytes": host_bytes, "kda_state_bytes": cached.runner.kda_pool.bytes_per_slot,
            "prefill_prefix_ms": ms(prefill), "copy_to_host_ms": ms(save), "copy_from_host_ms": ms(load),
            f"request_prefix_plus_{NEW}_host_hit_ms": ms(with_host),
            f"request_prefix_plus_{NEW}_no_cache_ms": ms(without),
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_host")
    p.add_argument("--model", type=Path, default=None, help="a checkpoint directory (default: a new tiny kimi_linear)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the shard's --cpu-threads default)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from shard_svc.make_tiny import make_tiny

            model = make_tiny("kimi_linear", Path(tmp) / "tiny", seed=0)
        result = measure(model, torch.device(args.device), args.tokens, args.repeats)
    if args.model is None:
        result["model"] = "tiny kimi_linear (kimiserve make-tiny, seed 0)"
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
