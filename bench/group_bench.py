"""Shard-group benchmark (issue 7, item 6): parity with one device, prefill tokens/s and decode TPOT per layout.

    python -m bench.group_bench --layouts 1x1,2x2 --out bench_out          # nvidia-h200-x2
    python -m bench.group_bench --layouts 1x1,2x2,4x4 --out bench_out      # nvidia-h200-x4
    python -m bench.group_bench --device cpu --config tiny --layouts 1x1,2x2 --out /tmp/b   # smoke test

Each layout TPxEP runs as max(tp, ep) processes; every rank runs the same calls (SPMD), the model's collectives keep
them in step, and rank 0 times. Weights are dummy (`--load-format dummy`, sliced per rank) at the Kimi-Linear-48B
shape (bench/configs.py); decode context state is random, as in bench/model_bench.py. Parity: tiny checkpoints of
both families, group vs one device in bf16 (greedy tokens and prompt-logit error). Writes group_bench.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

from shard_svc.engine.step_sync import Alone

log = logging.getLogger("group_bench")

SHAPES = {  # --config: (config.json, prefill (batch, length) list, decode batches, decode context)
    "48b": ("bench.configs:KIMI_LINEAR_48B", [(8, 4096), (1, 32768)], [1, 16, 64, 256], 4096),
    "tiny": ("shard_svc.make_tiny:kimi_linear_config", [(2, 64)], [1, 4], 64),
}


class _NoJournal(Alone):
    """The engine hook for SPMD benchmarking: every rank makes the same calls, so nothing is broadcast; this rank's
    pools hold its own KDA heads."""

    def __init__(self, kda_heads: int):
        self.kda_heads = kda_heads


def _config(name: str) -> dict:
    module, attr = SHAPES[name][0].split(":")
    value = getattr(__import__(module, fromlist=[attr]), attr)
    return dict(value(4)) if callable(value) else dict(value)


def _timed(fn, device: torch.device, reps: int = 3) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _speed(group, layout, args, model_dir: Path) -> dict:
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops
    from shard_svc.parallel.loading import load_dummy_sharded

    _, prefills, batches, context = SHAPES[args.config]
    dev = group.device
    cfg, model = load_dummy_sharded(model_dir, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32,
                                    group.model_comm(layout))
    slots = max(max(batches), max(b for b, _ in prefills))
    engine = Engine(cfg, model, select_ops(dev), dev,
                    EngineConfig(num_state_slots=slots, num_kv_blocks=slots * (context + 64) // 64 + 8,
                                 kv_block_size=64, prefill_token_budget=1 << 20),
                    sync=_NoJournal(layout.local_kda_heads(cfg)))
    out = {"prefill": [], "decode": []}
    for batch, length in prefills:
        def prefill():
            seqs = [engine.add_request(f"pf{i}", [1 + (i + t) % 500 for t in range(length)],
                                       SamplingParams(temperature=0.0, max_tokens=1,
                                                      ignore_eos=True)) for i in range(batch)]
            engine.scheduler.schedule()
            engine.runner.forward([(s, length) for s in seqs], is_decode=False)
            for s in seqs:
                engine.cancel(s.request_id)

        s = _timed(prefill, dev)
        out["prefill"].append({"batch": batch, "length": length, "seconds": s, "tokens_per_s": batch * length / s})
    for batch in batches:
        seqs = [engine.add_request(f"dc{i}", [1] * context, SamplingParams(temperature=0.0, max_tokens=64,
                                                                           ignore_eos=True))
                for i in range(batch)]
        engine.scheduler.schedule()
        for s in seqs:
            engine.runner.kv_cache.reserve(s.request_id, context + 64)
            s.num_computed, s.output = context, [7]

        def step():
            engine.runner.forward([(s, 1) for s in seqs], is_decode=True)
            for q in seqs:
                q.output.append(7)  # the next step's input token

        s = _timed(step, dev, reps=5)
        out["decode"].append({"batch": batch, "context": context, "tpot_ms": s * 1e3, "tokens_per_s": batch / s})
        for q in seqs:
            engine.cancel(q.request_id)
    return out


def _parity(group, layout, tiny: dict[str, str]) -> list[dict]:
    from shard_svc.checkpoint.loader import load_model
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops
    from shard_svc.parallel.loading import load_sharded_model
    from shard_svc.parallel.sync import StepSync
    from shard_svc.parallel.worker import follow

    dev, dtype, out = group.device, (torch.bfloat16 if group.device.type == "cuda" else torch.float32), []
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for family, path in tiny.items():
        cfg, model = load_sharded_model(path, dev, dtype, group.model_comm(layout))
        engine = Engine(cfg, model, select_ops(dev), dev, EngineConfig(), sync=StepSync(group, layout, cfg))
        if group.rank:
            follow(engine)
            continue
        seq = engine.generate(list(range(10, 140)), params, keep_prompt_logits=True)
        engine.sync.stop()
        cfg1, whole = load_model(path, dev, dtype)
        ref = Engine(cfg1, whole, select_ops(dev), dev).generate(list(range(10, 140)), params, keep_prompt_logits=True)
        a, b = torch.cat(seq.prompt_logits), torch.cat(ref.prompt_logits)
        out.append({"family": family, "prompt_logits_max_rel_err": float((a - b).abs().max() / b.abs().max()),
                    "greedy_tokens_equal": seq.output == ref.output})
    return out


def _rank_main(rank: int, world: int, port: int, tp: int, ep: int, args, model_dir: str, tiny: dict, queue) -> None:
    import torch.distributed as dist

    from shard_svc.parallel.group import ShardGroup
    from shard_svc.parallel.layout import ParallelLayout

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=600))
    group = ShardGroup.join(rank, world, store, device, timeout_s=600)
    layout = ParallelLayout(tp, ep, rank)
    result = {"tp": tp, "ep": ep, "world": world, **_speed(group, layout, args, Path(model_dir))}
    if not args.skip_parity and world > 1:
        result["parity"] = _parity(group, layout, tiny)
    group.close()
    if rank == 0:
        queue.put(result)


def _wait(queue, procs, spec: str) -> dict:
    """Rank 0's result; a rank that dies fails the run at once instead of leaving the others waiting."""
    import queue as queues

    while True:
        try:
            result = queue.get(timeout=1.0)
            break
        except queues.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"layout {spec}: ranks {dead} (rank, exit code) failed; see their tracebacks")
    for p in procs:
        p.join()
    return result


def add_speedups(layouts: list[dict]) -> None:
    """Each prefill and decode row gains `speedup_vs_<TP>x<EP>`: its tokens/s over the first layout's row of the same
    shape (the first layout's rows get 1.0)."""
    base = layouts[0]
    for lay in layouts:
        for kind in ("prefill", "decode"):
            for mine, ref in zip(lay[kind], base[kind], strict=True):
                mine[f"speedup_vs_{base['tp']}x{base['ep']}"] = mine["tokens_per_s"] / ref["tokens_per_s"]


def main() -> None:
    from kimiserve.ports import free_port
    from shard_svc.make_tiny import make_tiny

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", default="1x1,2x2", help="comma-separated TPxEP")
    p.add_argument("--config", choices=sorted(SHAPES), default="48b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--skip-parity", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "config": args.config,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "layouts": []}
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "shape"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(_config(args.config)))
        tiny = {} if args.skip_parity else {f: str(make_tiny(f, Path(tmp) / f, seed=0))
                                            for f in ("kimi_linear", "kimi_k3")}
        for spec in args.layouts.split(","):
            tp, ep = (int(x) for x in spec.split("x"))
            world, queue = max(tp, ep), ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_rank_main, args=(r, world, port, tp, ep, args, str(model_dir), tiny, queue))
                     for r in range(world)]
            [proc.start() for proc in procs]
            result["layouts"].append(_wait(queue, procs, spec))
    add_speedups(result["layouts"])
    (args.out / "group_bench.json").write_text(json.dumps(result, indent=1))
    for lay in result["layouts"]:
        lines = [f"tp={lay['tp']} ep={lay['ep']}"]
        lines += [f"  prefill {r['batch']}x{r['length']}: {r['tokens_per_s']:.0f} tok/s" for r in lay["prefill"]]
        lines += [f"  decode batch {r['batch']}: TPOT {r['tpot_ms']:.2f} ms" for r in lay["decode"]]
        lines += [f"  parity {r['family']}: rel err {r['prompt_logits_max_rel_err']:.2e} greedy equal "
                  f"{r['greedy_tokens_equal']}" for r in lay.get("parity", [])]
        log.info("\n".join(lines))


if __name__ == "__main__":
    main()
