"""`kimiserve bench`: a serving load generator against a running router (gRPC).

Sends synthetic prompts (random token ids of a given length, or multi-turn conversations whose every turn resends
the history) at fixed concurrency levels or at a Poisson request rate, streams every reply, and reports per level:
TTFT, TPOT, inter-token latency (ITL) and end-to-end percentiles, output and request throughput, goodput under an
SLO, the longest stall of any stream, and failures by status code. Prints a table, writes JSON (and a PNG with
--plot). Replies are greedy with EOS ignored, so every request generates exactly --output-len tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from kimiserve.v1 import router_pb2, router_pb2_grpc
from launcher.bench_load import PERCENTILES, BenchArgs, Load, RequestRecord, percentiles
from launcher.bench_long import long_prompt_report
from launcher.bench_long import table as long_table

log = logging.getLogger(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", default="127.0.0.1:50051", help="router address host:port")
    p.add_argument("--concurrency", default="1,16,64",
                   help="comma-separated levels: requests (or conversations) in flight at once")
    p.add_argument("--request-rate", type=float, default=None,
                   help="instead of fixed concurrency: Poisson arrivals at this many requests/s (one level)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level; 0: 4x the level's concurrency, at least 8")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--input-spread", type=float, default=0.0,
                   help="prompt lengths uniform in input-len x [1 - s, 1 + s]; 0: all equal")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument("--turns", type=int, default=1,
                   help="multi-turn replay: each conversation sends this many requests in order, each with the whole "
                        "history (previous prompt + reply) plus --turn-len new tokens")
    p.add_argument("--turn-len", type=int, default=300, help="new user tokens per later turn")
    p.add_argument("--warmup", type=int, default=2, help="requests sent and discarded before the first level")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: a request meets the SLO when TTFT <= it")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: ... and TPOT <= it")
    p.add_argument("--long-prompt-len", type=int, default=0,
                   help="instead of the levels: the long-prompt interference test (launcher/bench_long.py): one "
                        "prompt of this many tokens alone, the first --concurrency level's short clients alone, "
                        "then both at once; TTFT and ITL of each, compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="write bench.json (and bench.png with --plot) here")
    p.add_argument("--plot", action="store_true", help="also write a PNG (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true")


async def run_level(load: Load, concurrency: int | None, rate: float | None, n: int, progress) -> dict:
    records: list[RequestRecord] = []
    conversations = max(1, n // load.args.turns)
    start = time.perf_counter()
    if rate is None:
        queue: asyncio.Queue = asyncio.Queue()
        for _ in range(conversations):
            queue.put_nowait(None)

        async def worker():
            while not queue.empty():
                queue.get_nowait()
                await load.conversation(records, progress)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        tasks = []
        for _ in range(conversations):
            tasks.append(asyncio.create_task(load.conversation(records, progress)))
            await asyncio.sleep(load.rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return summarize(records, time.perf_counter() - start, load.args, concurrency, rate)


def summarize(records: list[RequestRecord], seconds: float, args: BenchArgs, concurrency, rate) -> dict:
    ok = [r for r in records if r.ok]
    failures: dict[str, int] = {}
    for r in records:
        if not r.ok:
            failures[r.status] = failures.get(r.status, 0) + 1
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [gap for r in ok for gap in r.itls]
    good = [r for r in ok if (args.slo_ttft_s is None or r.ttft <= args.slo_ttft_s)
            and (args.slo_tpot_s is None or (r.tpot or 0.0) <= args.slo_tpot_s)]
    return {
        "concurrency": concurrency, "request_rate": rate, "requests": len(records), "ok": len(ok),
        "failures": failures, "seconds": seconds,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": sum(r.output_tokens for r in ok),
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / seconds,
        "requests_per_s": len(ok) / seconds, "goodput_requests_per_s": len(good) / seconds,
        "ttft_ms": percentiles([r.ttft for r in ok]), "tpot_ms": percentiles(tpots), "itl_ms": percentiles(itls),
        "e2e_ms": percentiles([r.done - r.sent for r in ok]), "max_stall_ms": max(itls, default=0.0) * 1e3,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "by_turn": [{"turn": t, "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rs),
                     "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in rs),
                     "ttft_ms": percentiles([r.ttft for r in rs])}
                    for t in range(args.turns) if (rs := [r for r in ok if r.turn == t])] if args.turns > 1 else [],
    }


def table(levels: list[dict]) -> str:
    head = (f"{'level':>10} {'ok':>6} {'fail':>5} {'out tok/s':>10} {'req/s':>7} {'goodput':>8} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} {'E2E p50':>9} "
            f"{'stall':>8}")
    lines = [head, "-" * len(head)]
    for s in levels:
        level = f"c={s['concurrency']}" if s["concurrency"] is not None else f"r={s['request_rate']}/s"
        g = lambda key, p: s[key].get(p, float("nan"))  # noqa: E731 - a lookup, read in one line below
        lines.append(f"{level:>10} {s['ok']:>6} {s['requests'] - s['ok']:>5} {s['output_tokens_per_s']:>10.1f} "
                     f"{s['requests_per_s']:>7.2f} {s['goodput_requests_per_s']:>8.2f} {g('ttft_ms', 'p50'):>9.1f} "
                     f"{g('ttft_ms', 'p99'):>9.1f} {g('tpot_ms', 'p50'):>9.2f} {g('tpot_ms', 'p99'):>9.2f} "
                     f"{g('itl_ms', 'p99'):>8.2f} {g('e2e_ms', 'p50'):>9.1f} {s['max_stall_ms']:>8.1f}")
    for s in levels:
        for t in s["by_turn"]:
            lines.append(f"  turn {t['turn'] + 1}: prompt {t['prompt_tokens_mean']:.0f} tokens, cached "
                         f"{t['cached_tokens_mean']:.0f}, TTFT p50 {t['ttft_ms'].get('p50', float('nan')):.1f} ms "
                         f"p90 {t['ttft_ms'].get('p90', float('nan')):.1f} ms")
    return "\n".join(lines) + "\n(times in ms; goodput in requests/s meeting the SLO)\n"


def plot(levels: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s["concurrency"] or s["request_rate"] for s in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(xs, [s["output_tokens_per_s"] for s in levels], marker="o")
    axes[0].set(title="output tokens/s", xlabel="concurrency")
    for p in PERCENTILES:
        axes[1].plot(xs, [s["ttft_ms"].get(f"p{p}") for s in levels], marker="o", label=f"p{p}")
        axes[2].plot(xs, [s["tpot_ms"].get(f"p{p}") for s in levels], marker="o", label=f"p{p}")
    axes[1].set(title="TTFT (ms)", xlabel="concurrency")
    axes[2].set(title="TPOT (ms)", xlabel="concurrency")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def bench(ns: argparse.Namespace) -> dict:
    args = BenchArgs(ns.router, ns.input_len, ns.input_spread, ns.output_len, ns.num_prompts, ns.seed, ns.turns,
                     ns.turn_len, ns.slo_ttft_ms / 1e3 if ns.slo_ttft_ms else None,
                     ns.slo_tpot_ms / 1e3 if ns.slo_tpot_ms else None)
    from tqdm import tqdm

    async with grpc.aio.insecure_channel(args.router) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        model = (await stub.ListModels(router_pb2.ListModelsRequest(), timeout=30)).models[0]
        load = Load(stub, args, model.vocab_size)
        for _ in range(ns.warmup):
            await load.one(load.first_prompt())
        levels = ([None] if ns.request_rate is not None
                  else [int(c) for c in str(ns.concurrency).split(",") if c.strip()])
        if ns.long_prompt_len:
            report = await long_prompt_report(load, levels[0] or 1, ns.long_prompt_len)
            return {"model": model.name, "max_context_tokens": model.max_context_tokens, "args": asdict(args),
                    "long_prompt": report}
        results = []
        for c in levels:
            n = ns.num_prompts or max(8, 4 * (c or 1))
            with tqdm(total=n, desc=f"c={c}" if c else f"rate={ns.request_rate}/s", file=sys.stderr,
                      disable=ns.no_progress) as progress:
                results.append(await run_level(load, c, ns.request_rate, n, progress))
    return {"model": model.name, "max_context_tokens": model.max_context_tokens, "args": asdict(args),
            "levels": results}


def run(ns: argparse.Namespace) -> int:
    if ns.turns < 1 or ns.input_len < 1 or ns.output_len < 1:
        sys.stderr.write("kimiserve bench: --turns, --input-len and --output-len must be >= 1\n")
        return 2
    if ns.long_prompt_len < 0 or (ns.long_prompt_len and ns.request_rate is not None):
        sys.stderr.write("kimiserve bench: --long-prompt-len must be >= 0 and runs at a --concurrency level, not "
                         "with --request-rate\n")
        return 2
    try:
        report = asyncio.run(bench(ns))
    except grpc.aio.AioRpcError as e:
        sys.stderr.write(f"kimiserve bench: router {ns.router}: {e.code().name}: {e.details()}\n")
        return 1
    sys.stdout.write(long_table(report["long_prompt"]) if "long_prompt" in report else table(report["levels"]))
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        (ns.out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        if ns.plot and "levels" in report:
            plot(report["levels"], ns.out / "bench.png")
        log.info("bench written", extra={"dir": str(ns.out)})
    return 0
