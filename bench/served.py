"""The served stack on one GPU against the in-process engine fed the same closed-loop arrivals.

Kimi-Linear-48B shape with dummy bf16 weights (config.json alone, its special ids those of the tiny tokenizer written
beside it, which detokenizes; ids past it add no text). Starts tokenizer + shard + router as `kimiserve up` does,
records startup time and each path's first request TTFT against a warm one (gRPC Generate, gRPC Chat, HTTP chat),
runs `kimiserve bench` at each concurrency level, stops the stack, then runs the same levels in-process: an Engine
with CUDA graphs, `c` requests kept in flight, a new one added as each finishes. Writes served.json (updated after
every phase) and prints a table.

    python -m bench.served --out DIR [--levels 1,16,64,256] [--input-len 1024] [--output-len 128] [--multi-turn]
                           [--auto-capacity] [--long-prompt 262144]

--auto-capacity also runs the levels against a stack started with no capacity flag at all (the shard sizes itself
from GPU memory, issue 25), records what it chose, and with --long-prompt sends one prompt of that many tokens to it
(admitted, or refused up front naming the limit). --multi-turn adds the prefix-cache replay (2k-token start, 8 turns
of 300 new and 200 generated tokens) with the cache on and off: TTFT per turn, cached tokens, and the memory the
entries hold. --dry-run runs the same code on the CPU with the tiny kimi_linear checkpoint at toy sizes (minutes).

--shared-prefix adds the shared boundaries check (bench/shared_prefix.py: one long system message under 12 chats, a
document start shared by two prompts; TTFT, cached tokens and greedy equality against the cache off).

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
from bench.configs import KIMI_LINEAR_48B, with_layers
from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_stack, stop_stack

log = logging.getLogger("bench.served")
BLOCK = 64


def model_dir(root: Path, tiny: bool, layers: int | None = None) -> Path:
    """The 48B config with dummy weights (tiny: a real tiny checkpoint; layers: only that many, bench/configs.py
    with_layers), the tiny tokenizer beside it. The config's
    special ids are the tokenizer's (the tiny tokenizer holds Kimi's reserved ids at the same offsets from 512 as the
    real ones from 163584), so end-of-turn, chat rendering and structured output agree between the two."""
    from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
    from shard_svc.make_tiny import BOS, IM_END, PAD, make_tiny

    if tiny:
        return make_tiny("kimi_linear", root / "kimi-linear-tiny", seed=0)
    out = root / "kimi-linear-48b-dummy"
    out.mkdir(parents=True, exist_ok=True)
    config = {**with_layers(KIMI_LINEAR_48B, layers), "bos_token_id": BOS, "eos_token_id": IM_END, "pad_token_id": PAD}
    (out / "config.json").write_text(json.dumps(config))
    write_tiny_tokenizer(out)
    return out


def capacity(levels: list[int], input_len: int, output_len: int) -> tuple[int, int]:
    slots = max(levels)
    blocks = slots * -(-(input_len + output_len) // BLOCK) + 16
    return slots, blocks


def _ids(input_len: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 400 + 1 for i in range(input_len)]


def first_token_s(stub, input_len: int, seed: int) -> float:
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=_ids(input_len, seed)),
                                     sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.0,
                                                                        ignore_eos=True))
    start = time.perf_counter()
    for chunk in stub.Generate(req, timeout=600):
        if chunk.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token came back")


def chat_first_token_s(stub, seed: int) -> float:
    """A sampled chat (temperature 0.7, top-p 0.9): the tokenizer's chat rendering and the sampled path."""
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=f"Hello number {seed}")],
                                 sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9,
                                                                    seed=seed, ignore_eos=True))
    start = time.perf_counter()
    for chunk in stub.Chat(req, timeout=600):
        if chunk.token_ids:
            return time.perf_counter() - start
    raise RuntimeError("no token came back")


def http_first_token_s(http_port: int, seed: int) -> float:
    """A streamed chat over the OpenAI-compatible HTTP API, to its first content delta."""
    body = json.dumps({"model": "", "messages": [{"role": "user", "content": f"Hi there {seed}"}],
                       "max_tokens": 2, "stream": True, "temperature": 0.0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as response:
        for line in response:
            if line.startswith(b"data:") and b'"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no content delta came back")


def first_vs_warm(result: dict, stub, http_port: int, input_len: int) -> None:
    """Each path's first request after SERVING against the best of three warm ones; the gRPC Generate is the
    stack's very first request. first_over_warm: the issue-25 target is at most 2."""
    paths = {"grpc_generate": lambda s: first_token_s(stub, input_len, s),
             "grpc_chat": lambda s: chat_first_token_s(stub, s),
             "http_chat": lambda s: http_first_token_s(http_port, s)}
    out = {}
    for name, call in paths.items():
        first = call(1)
        warm = min(call(s) for s in (2, 3, 4))
        out[name] = {"first_ms": first * 1e3, "warm_ms": warm * 1e3, "first_over_warm": first / warm}
    result["first_request"] = out
    result["first_request_ttft_s"] = out["grpc_generate"]["first_ms"] / 1e3
    result["warm_ttft_s"] = out["grpc_generate"]["warm_ms"] / 1e3


def _load_args(args) -> tuple[str, ...]:
    """The shards' weights (dummy at the 48B shape) and, with --batch-invariant, their ops."""
    invariant = ("--batch-invariant",) if args.batch_invariant else ()
    return (*(() if args.tiny else ("--load-format", "dummy")), *invariant)


def _shard_args(args, slots: int, blocks: int, max_len: int, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return (*_load_args(args), "--num-state-slots", str(slots), "--num-kv-blocks", str(blocks),
            "--kv-block-size", str(BLOCK), "--prefill-token-budget", str(args.prefill_budget),
            "--max-model-len", str(max_len), *extra)


def _bench(port: int, out: Path, timeout: float, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "launcher.cli", "bench", "--router", f"127.0.0.1:{port}", "--out", str(out),
           "--no-progress", *flags]
    subprocess.run(cmd, check=True, timeout=timeout)
    return json.loads((out / "bench.json").read_text())


def _scrape(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in body.splitlines() if line and not line.startswith("#")}


def served(args, model: Path, result: dict, save) -> None:
    slots, blocks = capacity(args.levels, args.input_len, args.output_len)
    port, http_port = free_port(), free_port()
    start = time.perf_counter()
    children = start_stack(model, 1, args.device, "127.0.0.1", port, timeout=900,
                           shard_args=_shard_args(args, slots, blocks, args.input_len + args.output_len + BLOCK),
                           router_args=_router_args(args, http_port, "served"))
    try:
        result["startup_s"] = time.perf_counter() - start
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)  # the client's own connection is not the stack's
        stub = router_pb2_grpc.RouterStub(channel)
        first_vs_warm(result, stub, http_port, args.input_len)
        save()
        result["served"] = _bench(port, args.out / "bench", args.bench_timeout, *_level_flags(args))["levels"]
        save()
    finally:
        stop_stack(children, grace_s=30)


def served_auto(args, model: Path, result: dict, save) -> None:
    """The same levels against a shard given no capacity flag (issue 25: `kimiserve up --model DIR`), what it
    chose (its Info), and one --long-prompt prompt."""
    from kimiserve.v1 import shard_pb2, shard_pb2_grpc

    port, http_port = free_port(), free_port()
    start = time.perf_counter()
    children = start_stack(model, 1, args.device, "127.0.0.1", port, timeout=900, shard_args=_load_args(args),
                           router_args=_router_args(args, http_port, "auto"))
    try:
        auto: dict = {"startup_s": time.perf_counter() - start}
        info = shard_pb2_grpc.ShardStub(grpc.insecure_channel(children[1].address)).Info(
            shard_pb2.ShardInfoRequest(), timeout=30)
        auto["capacity"] = {"state_slots": info.capacity.state_slots, "kv_blocks": info.capacity.kv_blocks,
                            "kv_block_size": info.capacity.kv_block_size,
                            "max_context_tokens": info.capacity.max_context_tokens,
                            "max_step_tokens": info.capacity.max_step_tokens}
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=30).read())
        auto["v1_models_max_model_len"] = models["data"][0].get("max_model_len")
        result["served_auto"] = auto
        save()
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        if args.long_prompt:
            auto["long_prompt"] = _long_prompt(stub, args.long_prompt)
            save()
        auto["levels"] = _bench(port, args.out / "bench_auto", args.bench_timeout, *_level_flags(args))["levels"]
        save()
    finally:
        stop_stack(children, grace_s=30)


def _long_prompt(stub, tokens: int) -> dict:
    start = time.perf_counter()
    try:
        first_s = first_token_s(stub, tokens, 9)
    except grpc.RpcError as e:  # refused up front: the message must name the limit
        return {"tokens": tokens, "admitted": False, "code": e.code().name, "message": e.details(),
                "seconds": time.perf_counter() - start}
    return {"tokens": tokens, "admitted": True, "ttft_s": first_s}


def _level_flags(args) -> list[str]:
    flags = ["--concurrency", ",".join(map(str, args.levels)), "--input-len", str(args.input_len),
             "--output-len", str(args.output_len)]
    return flags + (["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])


def _router_args(args, http_port: int, name: str) -> tuple[str, ...]:
    return ("--max-in-flight", "1024", "--max-queued", "4096", "--http-port", str(http_port),
            "--batch-db", str(args.out / f"batches-{name}.sqlite3"))


def multi_turn(args, model: Path, result: dict, save) -> None:
    """The issue-15 replay: a 2k-token start, 8 turns of 300 new tokens and 200 generated, with the prefix cache on
    and off; TTFT per turn, the hit tokens, and the memory the entries hold."""
    from shard_svc.config import ModelConfig
    from shard_svc.engine.capacity import UnitSizes

    sizes = UnitSizes.for_model(ModelConfig.from_dir(model), _dtype(args), BLOCK)
    turns, first, new, out_len, convs = 8, 2048, 300, 200, args.conversations
    longest = first + turns * (new + out_len)
    blocks = convs * 2 * -(-longest // BLOCK) + 64
    result["multi_turn"] = {}
    for mode, entries in (("cache", args.prefix_entries), ("no_cache", 0)):
        port = free_port()
        extra = ("--prefix-cache-entries", str(entries))
        children = start_stack(model, 1, args.device, "127.0.0.1", port, timeout=900,
                               shard_args=_shard_args(args, convs + 2, blocks, longest + BLOCK, extra))
        try:
            report = _bench(port, args.out / f"multi_{mode}", args.bench_timeout, "--concurrency", str(convs),
                            "--num-prompts", str(convs * turns), "--turns", str(turns), "--input-len", str(first),
                            "--turn-len", str(new), "--output-len", str(out_len), "--warmup", "1")
            level = report["levels"][0]
            shard = _scrape(children[1].metrics_url)
            state_bytes, block_bytes = sizes.state_slot_bytes, sizes.kv_block_bytes
            result["multi_turn"][mode] = {
                "by_turn": level["by_turn"], "ttft_ms": level["ttft_ms"],
                "cached_prompt_tokens": level["cached_prompt_tokens"], "prompt_tokens": level["prompt_tokens"],
                "entries": shard.get("kimiserve_shard_prefix_cache_entries", 0.0),
                "entry_state_bytes": state_bytes,
                "cache_only_kv_blocks": shard.get("kimiserve_shard_prefix_cache_kv_blocks", 0.0),
                "kv_block_bytes": block_bytes,
                "kernels_after_warmup": shard.get("kimiserve_shard_kernels_after_warmup_total", 0.0)}
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


def _dtype(args):
    import torch

    return torch.float32 if args.device == "cpu" else torch.bfloat16


def in_process(args, model: Path, result: dict, save) -> None:
    import torch

    from shard_svc.checkpoint.dummy import dummy_model
    from shard_svc.config import ModelConfig
    from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
    from shard_svc.engine.engine import Engine, EngineConfig
    from shard_svc.engine.sampling import SamplingParams
    from shard_svc.ops import select_ops

    cfg = ModelConfig.from_dir(model)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the shards run (--cpu-threads 1): tiny ops, and other processes want the cores
    slots, blocks = capacity(args.levels, args.input_len, args.output_len)
    engine_cfg = EngineConfig(num_state_slots=slots, num_kv_blocks=blocks, kv_block_size=BLOCK,
                              prefill_token_budget=args.prefill_budget)
    engine = Engine(cfg, dummy_model(cfg, args.device, _dtype(args)), select_ops(device), device,
                    graph_engine_config(engine_cfg, device, False))
    enable_cuda_graphs(engine)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    prompt = lambda k: _ids(args.input_len, k)  # noqa: E731
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
    shard_args = _shard_args(args, 4, blocks, longest, shared_prefix.interval_args(args))
    result["shared_prefix"] = shared_prefix.run(model, args.device, shard_args,
                                                args.system_tokens, args.requests, args.doc_tokens, args.doc_shared,
                                                args.prefix_entries)
    save()


def table(result: dict) -> str:
    firsts = "; ".join(f"{name} first {f['first_ms']:.0f} ms vs warm {f['warm_ms']:.0f} ms "
                       f"({f['first_over_warm']:.2f}x)" for name, f in result.get("first_request", {}).items())
    lines = [f"startup {result.get('startup_s', float('nan')):.1f} s; {firsts}",
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

            def ms(part: dict, metric: str, q: str) -> str:
                return f"{part[metric].get(q, float('nan')):.0f}"

            lines.append(f"long-context {name}: long TTFT solo {lp['long_ttft_solo_s']:.1f} s mixed "
                         f"{lp['long_ttft_mixed_s']:.1f} s ({lp['long_ttft_ratio']:.2f}x); 16 shorts TTFT p50/p99 ms "
                         f"alone {ms(a, 'ttft_ms', 'p50')}/{ms(a, 'ttft_ms', 'p99')} during "
                         f"{ms(d, 'ttft_ms', 'p50')}/{ms(d, 'ttft_ms', 'p99')}; ITL p99 ms alone "
                         f"{ms(a, 'itl_ms', 'p99')} during {ms(d, 'itl_ms', 'p99')}")
        if c256:
            lines.append(f"long-context {name}: c=256 {c256['output_tokens_per_s']:.0f} output tok/s")
    auto = result.get("served_auto")
    if auto:
        hand = {s["concurrency"]: s["output_tokens_per_s"] for s in result.get("served", [])}
        lines.append(f"no capacity flags: {auto['capacity']}; /v1/models max_model_len "
                     f"{auto['v1_models_max_model_len']}; long prompt {auto.get('long_prompt')}")
        for s in auto.get("levels", []):
            ratio = s["output_tokens_per_s"] / hand[s["concurrency"]] if s["concurrency"] in hand else float("nan")
            lines.append(f"{s['concurrency']:>5} {s['output_tokens_per_s']:>13.0f} tok/s with no capacity flags, "
                         f"{ratio:.2f}x the hand-picked flags; TTFT p50 {s['ttft_ms']['p50']:.0f} ms")
    for mode, m in result.get("multi_turn", {}).items():
        turns = " ".join(f"{t['ttft_ms'].get('p50', float('nan')):.0f}" for t in m["by_turn"])
        lines.append(f"multi-turn {mode}: TTFT p50 by turn (ms) {turns}; cached {m['cached_prompt_tokens']} of "
                     f"{m['prompt_tokens']} prompt tokens; {m['entries']:.0f} entries x "
                     f"{m['entry_state_bytes'] / 2**20:.1f} MiB + {m['cache_only_kv_blocks']:.0f} blocks x "
                     f"{m['kv_block_bytes'] / 2**10:.0f} KiB; kernels first met after the warm-up: "
                     f"{m.get('kernels_after_warmup', 0):.0f}")
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
    p.add_argument("--prefix-entries", type=int, default=16,
                   help="multi-turn and shared-prefix: --prefix-cache-entries when on")
    p.add_argument("--auto-capacity", action="store_true",
                   help="also the levels against a shard with no capacity flags (sized from GPU memory)")
    p.add_argument("--long-prompt", type=int, default=0,
                   help="with --auto-capacity: one prompt of this many tokens (e.g. 262144), admitted or refused")
    p.add_argument("--long-context", action="store_true",
                   help="also the fair-prefill comparison: long-prompt interference and c=256 per policy variant")
    p.add_argument("--long-len", type=int, default=None,
                   help="long-context: the long prompt's tokens (default 262,000; 4,096 with --dry-run)")
    p.add_argument("--long-variants", default="fcfs,fair", help=f"long-context: of {', '.join(LONG_VARIANTS)}")
    p.add_argument("--long-output-len", type=int, default=32,
                   help="long-context: the short clients' reply length (short enough that each client sends several "
                        "requests while the long prompt prefills)")
    p.add_argument("--c256-variants", default="fcfs,fair", help="long-context: the variants that also run c=256")
    p.add_argument("--throughput-prompts", type=int, default=512, help="long-context: requests of the c=256 run")
    p.add_argument("--shared-prefix", action="store_true",
                   help="also the shared-boundaries check with the prefix cache on/off (bench/shared_prefix.py)")
    shared_prefix.add_args(p)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny kimi_linear checkpoint instead of the 48B shape")
    p.add_argument("--layers", type=int, default=None,
                   help="the 48B shape with only this many layers (a GPU that cannot hold all 27; figures scale)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="every shard with --batch-invariant (shard_svc/ops/batch_invariant.py)")
    p.add_argument("--dry-run", action="store_true",
                   help="the whole path on the CPU: --tiny --device cpu, levels 1,2, 32 prompt and 4 output tokens, "
                        "prefill budget 64, --auto-capacity, long prompts of 4,096 tokens, c=256 runs of 64 requests")
    args = p.parse_args()
    if args.dry_run:
        args.tiny, args.device, args.levels, args.input_len, args.output_len = True, "cpu", "1,2", 32, 4
        args.prefill_budget, args.auto_capacity, args.long_prompt = 64, True, args.long_prompt or 4096
        args.long_len, args.throughput_prompts = args.long_len or 4096, min(args.throughput_prompts, 64)
    args.long_len = args.long_len or 262_000
    args.levels = [int(x) for x in args.levels.split(",")]
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "input_len": args.input_len, "output_len": args.output_len,
                    "levels": args.levels, "prefill_budget": args.prefill_budget}

    def save() -> None:
        (args.out / "served.json").write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp), args.tiny, args.layers)
        if not args.skip_served:
            served(args, model, result, save)
        if args.auto_capacity:
            served_auto(args, model, result, save)
        if args.multi_turn:
            multi_turn(args, model, result, save)
        if args.long_context:
            long_context(args, model, result, save)
        if args.shared_prefix:
            shared_boundaries(args, model, result, save)
        if not args.skip_in_process:
            in_process(args, model, result, save)
    sys.stdout.write(table(result))


if __name__ == "__main__":
    main()
