"""The prefix cache at shared boundaries, served (issue 26's GPU checks): the same requests against a stack with the
cache on and one with it off, one request at a time.

- shared system message: chat completions with one long system message (default 3,700 tokens) and different user
  messages. With the cache on the first request prefills it all and snapshots where the system message ends; every
  later one restores that. Reported: TTFT of each request, the later ones' TTFT against the first (the target is
  <= 0.3x), cached tokens, and whether each greedy reply equals the cache-off stack's.
- shared document start: an id prompt, then one that shares only its first part (default 6,000 of 8,192 tokens): the
  second restores the interval snapshot below the divergence.
- exactness: every greedy reply against the cache-off stack's, and the chosen tokens' logprobs against it. On a GPU
  in bf16 a different split of the same prompt into prefill passes rounds differently (matmul shapes change), so a
  third stack, cache off with a smaller prefill budget, measures that noise with no cache involved: the cache is
  exact where its differences from the cache-off stack are no larger than the control's.
- the cache's memory: snapshots made by kind, entries, state bytes against their bound, evictions (shard metrics).
- what the snapshots cost: the first (cold) chat's and document's TTFT with the cache on against off (the pass that
  reaches a snapshot point copies the state there out: every --prefix-state-interval tokens and the kept message
  ends).

On the H200, the 48B shape with dummy weights (from bench/served.py: `--shared-prefix`); anywhere, any checkpoint:

    python -m bench.shared_prefix --model DIR --device cpu --out DIR [--system-tokens 1500] [--doc-tokens 3000]
        [--doc-shared 2000] [--requests 4]

Writes shared_prefix.json under --out and prints a summary. Exit status 1 when a greedy reply differs between the
stacks (the cache must be exact).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from pathlib import Path

import grpc

from kimiserve.ports import free_port
from kimiserve.tokenizer_files.loading import load_tokenizer
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_stack, stop_stack
from tokenizer_svc.chat_template import BuiltinKimiTemplate
from tokenizer_svc.chat_types import ChatMessage

log = logging.getLogger("bench.shared_prefix")
WORDS = ("the", "house", "letter", "walk", "morning", "sister", "garden", "every", "friend", "said", "little", "room")
USERS = ("What is the garden like?", "Who wrote the letter?", "Tell me about the morning walk.",
         "Which sister said it?", "Where is the house?", "Why did the friend leave?", "What room was it?",
         "Who walked every morning?", "What did the letter say?", "Is the garden little?", "When was it said?",
         "Which friend wrote?")


def system_text(model: Path, tokens: int) -> str:
    """Words until the system turn alone renders to at least `tokens` tokens with the model's tokenizer."""
    tok, rng, words = load_tokenizer(model), random.Random(0), []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(256))
        text = " ".join(words) + "."
        rendered = BuiltinKimiTemplate().render([ChatMessage("system", text)], [], False)
        if len(tok.encode(rendered)) >= tokens:
            return text


CONTROL_BUDGET = 1024  # the control stack's prefill budget: splits every prompt here into other passes


def _stream(responses) -> dict:
    """A Generate / Chat stream's token ids, seconds to the first token, usage, and per token its logprob and the
    margin to the runner-up (top_logprobs 2)."""
    start, first, ids, logprobs, margins, usage = time.perf_counter(), None, [], [], [], None
    for chunk in responses:
        if chunk.token_ids and first is None:
            first = time.perf_counter() - start
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.token_logprobs)
        margins.extend(t.candidates[0].logprob - t.candidates[1].logprob for t in chunk.top_logprobs)
        if chunk.HasField("usage") and chunk.usage.prompt_tokens:
            usage = chunk.usage
    if first is None or usage is None:
        raise RuntimeError("the stream ended without a token or without usage")
    return {"tokens": ids, "ttft_s": first, "prompt_tokens": usage.prompt_tokens,
            "cached_tokens": usage.cached_prompt_tokens, "logprobs": logprobs, "margins": margins}


def compare(runs: list[dict], reference: list[dict]) -> dict:
    """How far `runs` are from `reference` (the same requests): replies equal, and over each pair's positions up to
    and including the first differing token, the largest |logprob difference| and the smallest runner-up margin."""
    diffs, margins = [], []
    for a, b in zip(runs, reference):
        n = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), len(a["tokens"]))
        upto = min(n + 1, len(a["tokens"]))
        diffs.extend(abs(x - y) for x, y in zip(a["logprobs"][:upto], b["logprobs"][:upto]))
        margins.extend(b["margins"][:upto])
    return {"equal": [a["tokens"] == b["tokens"] for a, b in zip(runs, reference)],
            "logprob_max_abs_diff": max(diffs, default=0.0), "min_margin": min(margins, default=float("nan"))}


def _run_requests(stub, system: str, requests: int, doc: list[int], doc_shared: int, max_tokens: int) -> dict:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True,
                                         top_logprobs=2)
    # The channel's connection is made here, not inside the first chat's TTFT: a first call on a fresh channel costs
    # the client 7-10 ms that later ones don't pay, which would flatter the later-over-first ratio.
    stub.ListModels(router_pb2.ListModelsRequest(), timeout=60)
    chats = []
    for user in USERS[:requests]:
        req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="system", content=system),
                                               common_pb2.ChatMessage(role="user", content=user)], sampling=sampling)
        chats.append(_stream(stub.Chat(req, timeout=900)))
    rng = random.Random(1)
    docs = []
    for prompt in (doc, doc[:doc_shared] + [rng.randrange(1, 400) for _ in range(len(doc) - doc_shared)]):
        req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt), sampling=sampling)
        docs.append(_stream(stub.Generate(req, timeout=900)))
    return {"chats": chats, "docs": docs}


def _metrics(url: str) -> dict[str, float]:
    """The prefix cache's series of one shard and its count of kernels first met after the warm-up, each summed over
    its labels but `kind`."""
    import urllib.request

    out: dict[str, float] = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if not line.startswith(("kimiserve_shard_prefix_cache", "kimiserve_shard_kernels_after_warmup")):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{")[0]
        if name.endswith("_created"):
            continue  # the counters' creation timestamps
        if 'kind="' in series:
            name += "." + series.split('kind="')[1].split('"')[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def run(model: Path, device: str, shard_args: tuple[str, ...], system_tokens: int, requests: int, doc_tokens: int,
        doc_shared: int, entries: int, max_tokens: int = 8) -> dict:
    """The stacks, one after the other; returns the report (see the module docstring). `entries`: the cache stack's
    --prefix-cache-entries, given because the shard's default follows its state slots (one per 4 on a GPU: a
    4-slot stack would keep a single entry, which each prompt's own end evicts)."""
    if not 2 <= requests <= len(USERS) or not 0 < doc_shared < doc_tokens:
        raise ValueError(f"--requests must be in [2, {len(USERS)}] (got {requests}) and --doc-shared in "
                         f"(0, --doc-tokens {doc_tokens}) (got {doc_shared})")
    system = system_text(model, system_tokens)
    doc = [random.Random(2).randrange(1, 400) for _ in range(doc_tokens)]
    report: dict = {"system_tokens": system_tokens, "doc_tokens": doc_tokens, "doc_shared": doc_shared,
                    "shard_args": list(shard_args)}
    control = ("--prefix-cache-entries", "0", "--prefill-token-budget", str(CONTROL_BUDGET))
    cache = ("--prefix-cache-entries", str(entries))
    for mode, extra in (("cache", cache), ("no_cache", ("--prefix-cache-entries", "0")), ("control", control)):
        port = free_port()
        children = start_stack(model, 1, device, "127.0.0.1", port, timeout=900, shard_args=shard_args + extra)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                report[mode] = _run_requests(router_pb2_grpc.RouterStub(channel), system, requests, doc, doc_shared,
                                             max_tokens)
            report[mode]["metrics"] = _metrics(next(c for c in children if c.role == "shard").metrics_url)
        finally:
            stop_stack(children, grace_s=30)
    on, off, ctl = report["cache"], report["no_cache"], report["control"]
    chats, docs = on["chats"], on["docs"]
    cache_vs_off = compare(chats + docs, off["chats"] + off["docs"])
    control_vs_off = compare(ctl["chats"] + ctl["docs"], off["chats"] + off["docs"])
    report["summary"] = {
        "chat_ttft_first_s": chats[0]["ttft_s"],
        "chat_ttft_later_max_over_first": max(c["ttft_s"] for c in chats[1:]) / chats[0]["ttft_s"],
        "chat_cached_share_later_min": min(c["cached_tokens"] / c["prompt_tokens"] for c in chats[1:]),
        "doc_shared_cached_tokens": docs[1]["cached_tokens"],
        "doc_ttft_shared_over_first": docs[1]["ttft_s"] / docs[0]["ttft_s"],
        # the same requests on the cache-off stack: what the cache saves, whatever the first request paid
        "chat_ttft_later_over_no_cache": sorted(c["ttft_s"] / o["ttft_s"] for c, o in zip(chats[1:], off["chats"][1:])),
        "doc_ttft_shared_over_no_cache": docs[1]["ttft_s"] / off["docs"][1]["ttft_s"],
        "greedy_equal": cache_vs_off["equal"],
        "cache_vs_no_cache": cache_vs_off,
        "control_vs_no_cache": control_vs_off,
        "no_cache_chat_ttft_s": [c["ttft_s"] for c in off["chats"]],
        # what taking the snapshots costs a cold prompt (a state copy per point inside its passes; and, before the
        # warm-up ran passes with points, the first use of their kernel variants)
        "cold_ttft_cache_over_no_cache": [chats[0]["ttft_s"] / off["chats"][0]["ttft_s"],
                                          docs[0]["ttft_s"] / off["docs"][0]["ttft_s"]],
    }
    return report


def summary_text(report: dict) -> str:
    s, m = report["summary"], report["cache"]["metrics"]
    later = s["chat_ttft_later_over_no_cache"]
    kinds = {k.rsplit(".", 1)[1]: int(v) for k, v in m.items()
             if k.startswith("kimiserve_shard_prefix_cache_snapshots")}
    return (f"shared system message ({report['system_tokens']} tokens): first TTFT {s['chat_ttft_first_s'] * 1e3:.0f} "
            f"ms, later ones at most {s['chat_ttft_later_max_over_first']:.2f}x of it, cached >= "
            f"{s['chat_cached_share_later_min']:.0%} of their prompts; against the cache-off stack's same requests "
            f"median {later[len(later) // 2]:.2f}x, at most {later[-1]:.2f}x\n"
            f"shared document start ({report['doc_shared']} of {report['doc_tokens']} tokens): cached "
            f"{s['doc_shared_cached_tokens']}, TTFT {s['doc_ttft_shared_over_first']:.2f}x of the first, "
            f"{s['doc_ttft_shared_over_no_cache']:.2f}x the cache-off stack's\n"
            f"greedy replies equal to the cache-off stack: {sum(s['greedy_equal'])} of {len(s['greedy_equal'])} "
            f"(logprobs within {s['cache_vs_no_cache']['logprob_max_abs_diff']:.2g}); control (cache off, budget "
            f"{CONTROL_BUDGET}): {sum(s['control_vs_no_cache']['equal'])} of {len(s['greedy_equal'])} (within "
            f"{s['control_vs_no_cache']['logprob_max_abs_diff']:.2g}); smallest runner-up margin "
            f"{s['cache_vs_no_cache']['min_margin']:.2g}\n"
            f"cold prompts (chat, document) with the cache on: "
            f"{' and '.join(f'{x:.2f}x' for x in s['cold_ttft_cache_over_no_cache'])} the TTFT with it off\n"
            f"snapshots by kind {kinds}; entries {m.get('kimiserve_shard_prefix_cache_entries', 0):.0f}; state "
            f"{m.get('kimiserve_shard_prefix_cache_state_bytes', 0) / 2**20:.1f} of "
            f"{m.get('kimiserve_shard_prefix_cache_state_bytes_limit', 0) / 2**20:.1f} MiB; evictions "
            f"{m.get('kimiserve_shard_prefix_cache_evictions_total', 0):.0f}\n"
            f"kernels first met after the warm-up (cache stack): "
            f"{m.get('kimiserve_shard_kernels_after_warmup_total', 0):.0f} (the shard's log names them)\n")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-tokens", type=int, default=3700, help="the shared system message, in prompt tokens")
    p.add_argument("--requests", type=int, default=12, help=f"chat requests sharing it (at most {len(USERS)})")
    p.add_argument("--doc-tokens", type=int, default=8192, help="the first id prompt of the shared-start case")
    p.add_argument("--doc-shared", type=int, default=6000, help="tokens the second one shares with it")
    p.add_argument("--prefix-state-interval", type=int, default=None,
                   help="the shards' --prefix-state-interval (default: theirs)")


def interval_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The shard flag add_args' --prefix-state-interval asks for, if any."""
    n = args.prefix_state_interval
    return () if n is None else ("--prefix-state-interval", str(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--prefix-entries", type=int, default=16, help="the cache stack's --prefix-cache-entries")
    add_args(p)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args.model, args.device, ("--max-model-len", str(args.max_model_len), "--num-kv-blocks",
                                           str(-(-args.max_model_len // 16) * 2 + 64), *interval_args(args)),
                 args.system_tokens, args.requests, args.doc_tokens, args.doc_shared, args.prefix_entries)
    (args.out / "shared_prefix.json").write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(summary_text(report))
    sys.exit(0 if all(report["summary"]["greedy_equal"]) else 1)


if __name__ == "__main__":
    main()
