"""Parity of the fast paths on the trained models: kernels + CUDA graphs against the eager reference, measured where
users feel it: next-token agreement and perplexity on held-out prose, and greedy chat replies.

Variants (each the served engine, shard_svc/engine): `eager-fp32` (the reference), `eager-bf16` (the reference's
own rounding noise at the serving dtype), `kernels-bf16` (the Triton ops and, on CUDA, decode CUDA graphs: what a
shard serves), and `kernels-fp32` (the same fast paths in float32, where a correct kernel differs from the
reference by rounding only, so replies should match token for token). For each variant against the reference:
- held-out: WINDOWS windows of SEQ tokens of the corpus's held-out paragraphs, teacher-forced through prefill;
  top-1 agreement of the next-token argmax, with the reference and with the eager path at the variant's own dtype
  (what the kernels alone change), and the variant's perplexity next to the reference's;
- greedy: the chat prompts decoded for --tokens tokens; how many replies are identical and the mean length of the
  common prefix.

    python -m bench.trained_parity --out DIR [--models models/kimi-linear-austen ...] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kimiserve.tokenizer_files.loading import load_tokenizer
from shard_svc.checkpoint.loader import load_model
from shard_svc.engine.cuda_graphs import enable_cuda_graphs, graph_engine_config
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.sampling import SamplingParams
from shard_svc.ops import select_ops
from tokenizer_svc.chat_types import ChatMessage
from tokenizer_svc.kimi_chat import BuiltinKimiTemplate
from training.corpus import load_corpus
from training.data import token_stream

log = logging.getLogger("bench.trained_parity")

REPO = Path(__file__).resolve().parents[1]
CHATS = ["Hello", "Who are you?", "Who wrote Emma?", "Tell me a story.", "Who is Mr. Darcy?",
         "What is a ball?", "Describe the weather.", "Who is Elizabeth Bennet?"]
SEQ, WINDOWS = 256, 16
VARIANTS = {"eager-fp32": ("eager", torch.float32), "kernels-fp32": ("auto", torch.float32),
            "eager-bf16": ("eager", torch.bfloat16), "kernels-bf16": ("auto", torch.bfloat16)}


@dataclass
class VariantResult:
    variant: str
    perplexity: float
    top1_agreement: float  # held-out positions whose argmax equals the reference's
    top1_same_dtype: float  # ... equals the eager path's at this variant's dtype: the kernels' own share
    identical_replies: int
    mean_common_prefix: float  # greedy tokens before the first difference from the reference, per reply
    cuda_graphs: bool


def build(path: Path, backend: str, dtype: torch.dtype, device: torch.device, slots: int) -> tuple[Engine, bool]:
    cfg, model = load_model(path, device=device, dtype=dtype)
    engine_cfg = EngineConfig(num_state_slots=slots, num_kv_blocks=slots * (SEQ + 512) // 16 + 8,
                              prefill_token_budget=SEQ * slots)
    eager = backend == "eager"
    engine = Engine(cfg, model, select_ops(device, backend), device, graph_engine_config(engine_cfg, device, eager))
    graphs = None if eager else enable_cuda_graphs(engine)
    return engine, graphs is not None


def run(engine: Engine, prompts: list[list[int]], tokens: int, keep_prompt_logits: bool):
    seqs = [engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                               keep_prompt_logits=keep_prompt_logits) for i, p in enumerate(prompts)]
    while engine.has_work():
        engine.step()
    return seqs


def held_out_windows(path: Path) -> list[list[int]]:
    ids = token_stream(load_corpus().held_out, load_tokenizer(path))
    return [ids[i * SEQ:(i + 1) * SEQ].tolist() for i in range(WINDOWS)]


def chat_prompts(path: Path) -> list[list[int]]:
    tok, template = load_tokenizer(path), BuiltinKimiTemplate()
    return [tok.encode(template.render([ChatMessage("user", c)], (), add_generation_prompt=True)) for c in CHATS]


def measure(path: Path, device: torch.device, tokens: int) -> list[VariantResult]:
    windows, chats = held_out_windows(path), chat_prompts(path)
    outputs = {}
    for name, (backend, dtype) in VARIANTS.items():
        engine, graphs = build(path, backend, dtype, device, slots=max(len(windows), len(chats)))
        logits = torch.stack([torch.cat(s.prompt_logits).float() for s in run(engine, windows, 1, True)])
        replies = [s.output for s in run(engine, chats, tokens, False)]
        outputs[name] = (logits, replies, graphs)
        log.info("variant done", extra={"model": path.name, "variant": name, "cuda_graphs": graphs})
        del engine
    targets = torch.tensor([w[1:] for w in windows])
    ref_logits, ref_replies, _ = outputs["eager-fp32"]
    results = []
    for name, (logits, replies, graphs) in outputs.items():
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device))
        top1 = logits[:, :-1].argmax(-1)
        agree = (top1 == ref_logits[:, :-1].argmax(-1)).float().mean()
        eager = outputs["eager-" + name.split("-")[1]][0]
        agree_dtype = (top1 == eager[:, :-1].argmax(-1)).float().mean()
        prefixes = [next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                    for r, g in zip(ref_replies, replies)]
        results.append(VariantResult(
            name, math.exp(float(nll)), top1_agreement=float(agree), top1_same_dtype=float(agree_dtype),
            identical_replies=sum(r == g for r, g in zip(ref_replies, replies)),
            mean_common_prefix=sum(prefixes) / len(prefixes), cuda_graphs=graphs))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trained_parity", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", nargs="+", type=Path, default=sorted((REPO / "models").iterdir()))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=128, help="greedy tokens per chat reply")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    device = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "seq": SEQ, "windows": WINDOWS, "chats": len(CHATS), "tokens": args.tokens, "models": {}}
    header = (f"{'model':<22} {'variant':<20} {'ppl':>8} {'top-1 agree':>12} {'vs eager, same dtype':>21} "
              f"{'identical':>10} {'common prefix':>14}")
    lines = [header]
    for path in args.models:
        results = measure(path, device, args.tokens)
        report["models"][path.name] = [asdict(r) for r in results]
        lines += [f"{path.name:<22} {r.variant + ('+graphs' if r.cuda_graphs else ''):<20} {r.perplexity:>8.3f} "
                  f"{r.top1_agreement:>12.4f} {r.top1_same_dtype:>21.4f} {r.identical_replies:>6}/{len(CHATS):<3} "
                  f"{r.mean_common_prefix:>14.1f}"
                  for r in results]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "trained_parity.json").write_text(json.dumps(report, indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
