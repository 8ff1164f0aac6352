"""The served stack on one GPU against the in-process engine fed the same closed-loop arrivals.

Kimi-Linear-48B shape with dummy bf16 weights (config.json alone; the tiny tokenizer detokenizes, ids past it add
no text). Starts tokenizer + shard + router as `kimiserve up` does, records startup time and the first request's
TTFT against a warm one, runs `kimiserve bench` at each concurrency level, stops the stack, then runs the same
levels in-process: an Engine with CUDA graphs, `c` requests kept in flight, a new one added as each finishes.
Writes served.json (updated after every phase) and prints a table.

    python -m bench.served --out DIR [--levels 1,16,64,256] [--input-len 1024] [--output-len 128] [--multi-turn]

--multi-turn adds the prefix-cache replay (2k-token start, 8 turns of 300 new and 200 generated tokens) with the
cache on and off: TTFT per turn, cached tokens, and the memory the entries hold. --shared-prefix adds the shared
boundaries check (bench/shared_prefix.py: one long system message under 12 chats, a document start shared by two
prompts; TTFT, cached tokens and greedy equality against the cache off).

--long-context adds the fair-prefill comparison (issue 24): for each prefill policy setting in --long-variants, a
stack of its own runs `kimiserve bench --long-prompt-len` (one --long-len-token prompt solo, 16 short clients of
--input-len / --output-len alone, then both at once) and the c=256 closed-loop throughput at the same lengths.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from bench import shared_prefix
from bench.configs import KIMI_LINEAR_48B
from kimiserve.ports import free_port
from kimiserve.up import start_stack, stop_stack
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from shard_svc.make_tiny import BOS, IM_END, PAD, kimi_linear_config

log = logging.getLogger("bench.served")
BLOCK = 64


def model_dir(root: Path, config: dict = KIMI_LINEAR_48B) -> Path:
    """The config beside the tiny tokenizer, its special ids moved to the tiny tokenizer's own (the 48B ids are
    past its 768: the shard's grammar set-up would refuse the vocabulary)."""
    from tokenizer_svc.tiny import write_tiny_tokenizer

    out = root / "dummy-model"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dict(config, bos_token_id=BOS, eos_token_id=IM_END,
                                                     pad_token_id=PAD)))
    write_tiny_tokenizer(out)
    return out


def capacity(levels: list[int], input_len: int, output_len: int) -> tuple[int, int]:
    slots = max(levels)
    blocks = slots * -(-(input_len + output_len) // BLOCK) + 16
    return slots, blocks


def first_token_s(stub, input_len: int, seed: int) -> float:
    ids = [(seed * 7919 + i * 104729) % 400 + 1 for i in range(input_len)]
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=ids),
                                     sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0,
                                                                        ignore_eos=True))
    start = time.perf_counter()
    for chunk in stub.Generate(req, timeout=600):
        if chunk.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token came back")


def _shard_args(args, slots: int, blocks: int, max_len: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("--load-format", "dummy", "--num-state-slots", str(slots), "--num-kv-blocks", str(blocks),
            "--kv-block-size", str(BLOCK), "--prefill-token-budget", str(args.prefill_budget),
            "--max-model-len", str(max_len), *extra)


def _bench(port: int, out: Path, timeout: float, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "kimiserve.cli", "bench", "--router", f"127.0.0.1:{port}", "--out", str(out),
           "--no-progress", *flags]
    subprocess.run(cmd, check=True, timeout=timeout)
    return json.loads((out / "bench.json").read_text())


def _scrape(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line and not line.startswith("#")}


def served(args, model: Path, result: dict, save) -> None:
    slots, blocks = capacity(args.levels, args.input_len, args.output_len)
    port = free_port()
    start = time.perf_counter()
    children = start_stack(model, 1, "cuda", "127.0.0.1", port, timeout=900,
                           shard_args=_shard_args(args, slots, blocks, args.input_len + args.output_len + BLOCK),
                           router_args=("--max-in-flight", "1024", "--max-queued", "4096"))
    try:
        result["startup_s"] = time.perf_counter() - start
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        result["first_request_ttft_s"] = first_token_s(stub, args.input_len, 1)
        result["warm_ttft_s"] = min(first_token_s(stub, args.input_len, s) for s in (2, 3, 4))
        save()
        flags = ["--concurrency", ",".join(map(str, args.levels)), "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len)]
        if args.num_prompts:
            flags += ["--num-prompts", str(args.num_prompts)]
        result["served"] = _bench(port, args.out / "bench", args.bench_timeout, *flags)["levels"]
        save()
    finally:
        stop_stack(children, grace_s=30)


def multi_turn(args, model: Path, result: dict, save) -> None:
    """The issue-15 replay: a 2k-token start, 8 turns of 300 new tokens and 200 generated, with the prefix cache on
    and off; TTFT per turn, the hit tokens, and the memory the entries hold."""
    from shard_svc.config import ModelConfig

    cfg = ModelConfig.from_dict(dict(KIMI_LINEAR_48B))
    turns, first, new, out_len, convs = 8, 2048, 300, 200, args.conversations
    longest = first + turns * (new + out_len)
    blocks = convs * 2 * -(-longest // BLOCK) + 64
    result["multi_turn"] = {}
    for mode, entries in (("cache", args.prefix_entries), ("no_cache", 0)):
        port = free_port()
        extra = ("--prefix-cache-entries", str(entries))
        children = start_stack(model, 1, "cuda", "127.0.0.1", port, timeout=900,
                               shard_args=_shard_args(args, convs + 2, blocks, longest + BLOCK, extra))
        try:
            report = _bench(port, args.out / f"multi_{mode}", args.bench_timeout, "--concurrency", str(convs),
                            "--num-prompts", str(convs * turns), "--turns", str(turns), "--input-len", str(first),
                            "--turn-len", str(new), "--output-len", str(out_len), "--warmup", "1")
            level = report["levels"][0]
            shard = _scrape(children[1].metrics_url)
            k = cfg.kda
            state_bytes = cfg.layer_map.num_kda * k.num_heads * (k.head_dim * k.head_dim * 4
                                                                  + 3 * k.head_dim * (k.conv_kernel - 1) * 2)
            block_bytes = cfg.layer_map.num_mla * BLOCK * cfg.mla.latent_dim * 2
            result["multi_turn"][mode] = {
                "by_turn": level["by_turn"], "ttft_ms": level["ttft_ms"],
                "cached_prompt_tokens": level["cached_prompt_tokens"], "prompt_tokens": level["prompt_tokens"],
                "entries": shard.get("kimiserve_shard_prefix_cache_entries", 0.0),
                "entry_state_bytes": state_bytes,
                "cache_only_kv_blocks": shard.get("kimiserve_shard_prefix_cache_kv_blocks", 0.0),
                "kv_block_bytes": block_bytes}
            save()
        finally:
            stop_stack(children, grace_s=30)


LONG_VARIANTS = {  # name -> shard flags; "fair" is the shard's defaults
    "fcfs": ("--prefill-policy", "fcfs"),
    "fair": (),
    "fair-2k": ("--long-prefill-floor", "256", "--mixed-prefill-cost", "2048"),
    "fair-4k": ("--long-prefill-floor", "512", "--mixed-prefill-cost", "4096"),
    "fair-8k": ("--long-prefill-floor", "1024", "--mixed-prefill-cost", "8192"),
}


def long_context(args, model: Path, result: dict, save) -> None:
    """The issue-24 comparison, one stack per variant: the long-prompt interference bench, then c=256 throughput."""
    slots, throughput_prompts = 256 + 8, args.throughput_prompts
    blocks = slots * -(-(args.input_len + args.output_len) // BLOCK) + -(-(args.long_len + 2) // BLOCK) + 64
    result["long_context"] = {}
    longs, c256s = args.long_variants.split(","), args.c256_variants.split(",")
    for name in dict.fromkeys(n for n in longs + c256s if n in LONG_VARIANTS):
        port = free_port()
        children = start_stack(model, 1, args.device, "127.0.0.1", port, timeout=900,
                               shard_args=_shard_args(args, slots, blocks, args.long_len + 2 * BLOCK,
                                                      ("--prefix-cache-entries", "0", *LONG_VARIANTS[name])),
                               router_args=("--max-in-flight", "1024", "--max-queued", "4096"))
        try:
            entry = result["long_context"][name] = {"shard_flags": list(LONG_VARIANTS[name])}
            if name in longs:
                entry["long_prompt"] = _bench(port, args.out / f"long_{name}", args.bench_timeout,
                                              "--long-prompt-len", str(args.long_len), "--concurrency", "16",
                                              "--input-len", str(args.input_len), "--output-len",
                                              str(args.long_output_len))["long_prompt"]
                save()
            if name in c256s:
                entry["c256"] = _bench(port, args.out / f"c256_{name}", args.bench_timeout, "--concurrency", "256",
                                       "--num-prompts", str(throughput_prompts), "--input-len", str(args.input_len),
                                       "--output-len", str(args.output_len))["levels"][0]
                save()
        finally:
            stop_stack(children, grace_s=30)


def in_process(args, result: dict, save) -> None:
    import torch

    from shard_svc.checkpoint.dummy import dummy_model
    from shard_svc.config import ModelConfig
    from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops

    cfg = ModelConfig.from_dict(dict(KIMI_LINEAR_48B))
    cuda = torch.device("cuda")
    slots, blocks = capacity(args.levels, args.input_len, args.output_len)
    engine_cfg = EngineConfig(num_state_slots=slots, num_kv_blocks=blocks, kv_block_size=BLOCK,
                              prefill_token_budget=args.prefill_budget)
    engine = Engine(cfg, dummy_model(cfg, "cuda", torch.bfloat16), select_ops(cuda), cuda,
                    graph_engine_config(engine_cfg, cuda, False))
    enable_cuda_graphs(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = lambda k: [(k * 7919 + i * 104729) % 400 + 1 for i in range(args.input_len)]  # noqa: E731
    for k in range(2):
        engine.generate(prompt(k), params, request_id=f"warm-{k}")
    result["in_process"] = []
    for c in args.levels:
        n = args.num_prompts or max(8, 4 * c)
        sent, live, tokens, ttft = 0, 0, 0, []
        arrival: dict[str, float] = {}
        start = time.perf_counter()
        while sent < n or live:
            while live < c and sent < n:
                rid = f"c{c}-{sent}"
                engine.add_request(rid, prompt(sent), params)
                arrival[rid] = time.perf_counter()
                sent, live = sent + 1, live + 1
            for event in engine.step().events:
                if event.token_id is not None:
                    tokens += 1
                    if event.index == 0:
                        ttft.append(time.perf_counter() - arrival[event.request_id])
                if event.finish_reason is not None:
                    live -= 1
        seconds = time.perf_counter() - start
        ttft.sort()
        result["in_process"].append({"concurrency": c, "requests": n, "seconds": seconds,
                                     "output_tokens_per_s": tokens / seconds,
                                     "ttft_ms_p50": ttft[len(ttft) // 2] * 1e3,
                                     "ttft_ms_p99": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))] * 1e3})
        save()


def shared_boundaries(args, model: Path, result: dict, save) -> None:
    """bench/shared_prefix.py at the 48B shape: the stacks with this benchmark's block size and prefill budget."""
    longest = max(args.doc_tokens, args.system_tokens + 256) + BLOCK
    blocks = 2 * -(-longest // BLOCK) + 64
    result["shared_prefix"] = shared_prefix.run(model, "cuda", _shard_args(args, 4, blocks, longest),
                                                args.system_tokens, args.requests, args.doc_tokens, args.doc_shared)
    save()


def table(result: dict) -> str:
    lines = [f"startup {result.get('startup_s', float('nan')):.1f} s; first request TTFT "
             f"{result.get('first_request_ttft_s', float('nan')) * 1e3:.0f} ms vs warm "
             f"{result.get('warm_ttft_s', float('nan')) * 1e3:.0f} ms",
             f"{'conc':>5} {'served tok/s':>13} {'engine tok/s':>13} {'ratio':>6} {'served TTFT p50/p99 ms':>23} "
             f"{'engine TTFT p50/p99 ms':>23} {'served TPOT p50 ms':>19}"]
    engine = {e["concurrency"]: e for e in result.get("in_process", [])}
    for s in result.get("served", []):
        e = engine.get(s["concurrency"], {})
        ratio = s["output_tokens_per_s"] / e["output_tokens_per_s"] if e else float("nan")
        lines.append(f"{s['concurrency']:>5} {s['output_tokens_per_s']:>13.0f} "
                     f"{e.get('output_tokens_per_s', float('nan')):>13.0f} {ratio:>6.2f} "
                     f"{s['ttft_ms']['p50']:>11.0f}/{s['ttft_ms']['p99']:<11.0f} "
                     f"{e.get('ttft_ms_p50', float('nan')):>11.0f}/{e.get('ttft_ms_p99', float('nan')):<11.0f} "
                     f"{s['tpot_ms']['p50']:>19.2f}")
    for name, v in result.get("long_context", {}).items():
        lp, c256 = v.get("long_prompt"), v.get("c256")
        if lp:
            a, d = lp["shorts_alone"], lp["shorts_during_long"]
            lines.append(f"long-context {name}: long TTFT solo {lp['long_ttft_solo_s']:.1f} s mixed "
                         f"{lp['long_ttft_mixed_s']:.1f} s ({lp['long_ttft_ratio']:.2f}x); 16 shorts TTFT p50/p99 ms "
                         f"alone {a['ttft_ms'].get('p50', float('nan')):.0f}/{a['ttft_ms'].get('p99', float('nan')):.0f}"
                         f" during {d['ttft_ms'].get('p50', float('nan')):.0f}/"
                         f"{d['ttft_ms'].get('p99', float('nan')):.0f}; ITL p99 ms alone "
                         f"{a['itl_ms'].get('p99', float('nan')):.0f} during {d['itl_ms'].get('p99', float('nan')):.0f}")
        if c256:
            lines.append(f"long-context {name}: c=256 {c256['output_tokens_per_s']:.0f} output tok/s")
    for mode, m in result.get("multi_turn", {}).items():
        turns = " ".join(f"{t['ttft_ms'].get('p50', float('nan')):.0f}" for t in m["by_turn"])
        lines.append(f"multi-turn {mode}: TTFT p50 by turn (ms) {turns}; cached {m['cached_prompt_tokens']} of "
                     f"{m['prompt_tokens']} prompt tokens; {m['entries']:.0f} entries x "
                     f"{m['entry_state_bytes'] / 2**20:.1f} MiB + {m['cache_only_kv_blocks']:.0f} blocks x "
                     f"{m['kv_block_bytes'] / 2**10:.0f} KiB")
    if "shared_prefix" in result:
        lines.append(shared_prefix.summary_text(result["shared_prefix"]).rstrip("\n"))
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    p.add_argument("--levels", default="1,16,64,256")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="per level (default: 4x the level, at least 8)")
    p.add_argument("--prefill-budget", type=int, default=8192)
    p.add_argument("--bench-timeout", type=float, default=420)
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--multi-turn", action="store_true", help="also the multi-turn replay with the prefix cache on/off")
    p.add_argument("--conversations", type=int, default=4, help="multi-turn: conversations at once")
    p.add_argument("--prefix-entries", type=int, default=16, help="multi-turn: --prefix-cache-entries when on")
    p.add_argument("--long-context", action="store_true",
                   help="also the fair-prefill comparison: long-prompt interference and c=256 per policy variant")
    p.add_argument("--long-len", type=int, default=262_000, help="long-context: the long prompt's tokens")
    p.add_argument("--long-variants", default="fcfs,fair", help=f"long-context: of {', '.join(LONG_VARIANTS)}")
    p.add_argument("--long-output-len", type=int, default=32,
                   help="long-context: the short clients' reply length (short enough that each client sends several "
                        "requests while the long prompt prefills)")
    p.add_argument("--c256-variants", default="fcfs,fair", help="long-context: the variants that also run c=256")
    p.add_argument("--throughput-prompts", type=int, default=512, help="long-context: requests of the c=256 run")
    p.add_argument("--device", default="cuda", help="cpu with --tiny: a dry run of the script on a CPU machine")
    p.add_argument("--tiny", action="store_true", help="the tiny kimi_linear shape instead of the 48B one")
    p.add_argument("--shared-prefix", action="store_true",
                   help="also the shared-boundaries check with the prefix cache on/off (bench/shared_prefix.py)")
    shared_prefix.add_args(p)
    args = p.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "input_len": args.input_len, "output_len": args.output_len,
                    "levels": args.levels, "prefill_budget": args.prefill_budget}

    def save() -> None:
        (args.out / "served.json").write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), kimi_linear_config(4) if args.tiny else KIMI_LINEAR_48B)
        if not args.skip_served:
            served(args, model, result, save)
        if args.multi_turn:
            multi_turn(args, model, result, save)
        if args.long_context:
            long_context(args, model, result, save)
        if args.shared_prefix:
            shared_boundaries(args, model, result, save)
    if not args.skip_in_process:
        in_process(args, result, save)
    sys.stdout.write(table(result))


if __name__ == "__main__":
    main()
