"""Train the two small Kimi models of models/ from nothing: `python3 -m training --out DIR`.

Steps, all with fixed seeds: learn a 2,048-token byte-level BPE on the training split of the corpus (corpus.py) and
add Kimi's 256 special ids; pretrain each model (models.py) on random 256-token windows of the novels; a short
supervised pass on templated dialogues (dialogues.py) mixed half and half with prose, learning only the assistant's
replies; then held-out perplexity, the unigram baseline and greedy samples (evaluate.py); write each model as a
checkpoint in the published format (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) under
DIR/<name>/ and the report as DIR/summary.json (also the last line of stdout).

On a GPU the models train in bf16 (fp32 master weights). By default each pretraining phase measures its step time
after 10 steps and fits its cosine schedule to a time budget (`--pretrain-s`), so the run takes a known time on any
GPU; the report gives the steps taken, and `--steps N --sft-steps M` repeats a run step for step. Imports only
torch, tokenizers, safetensors, numpy and the project's model, config, checkpoint-writing and tokenizer modules.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kimiserve.logs import setup_logging
from shard_svc.checkpoint.writer import published_tensors, write_shards
from shard_svc.config import ModelConfig
from training.corpus import CORPUS_FILE, load_corpus
from training.data import DialogueSampler, ProseSampler, pack_dialogues, token_stream
from training.dialogues import make_dialogues
from training.evaluate import Lexicon, english_check, held_out_perplexity, samples, unigram_perplexity
from training.loop import PhaseReport, Schedule, Trainer
from training.models import BASE_VOCAB, MODELS, PAD, init_model, kimi_k3_config, round_experts_to_mxfp4
from training.tokenizer import train_tokenizer

log = logging.getLogger(__name__)

SEQ_LEN = 256
KDA_CHUNK = 32
NUM_DIALOGUES = 20000


@dataclass(frozen=True)
class Recipe:
    batch: int
    lr: float
    pretrain_s: float  # time budget of the pretraining phase on a GPU
    sft_fraction: float  # supervised steps, as a fraction of the pretraining steps taken
    max_epochs: float = 6.0  # pretraining stops here even within the budget: ~1M tokens, a 4M-parameter model
    warmup: int = 50


RECIPES = {
    "kimi-linear-austen": Recipe(batch=64, lr=2e-3, pretrain_s=90.0, sft_fraction=0.15),
    "kimi-k3-austen": Recipe(batch=64, lr=1.5e-3, pretrain_s=420.0, sft_fraction=0.15, max_epochs=12.0),
}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, type=Path, help="new or empty directory for the models and summary.json")
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="the model's dtype while training (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None,
                   help="pretraining steps per model (default: as many as fit --pretrain-s)")
    p.add_argument("--sft-steps", type=int, default=None, help="supervised steps (default: a fraction of --steps)")
    p.add_argument("--pretrain-s", type=float, default=None, help="pretraining time budget per model (seconds)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the model's recipe)")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN)
    p.add_argument("--k3-layers", type=int, default=93, help="fewer only for smoke runs")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay each step's forward and backward as one CUDA graph (default: on a CUDA device)")
    p.add_argument("--sample-tokens", type=int, default=48)
    p.add_argument("--held-out-tokens", type=int, default=None,
                   help="evaluate perplexity on the first N held-out tokens only (default: all; for smoke runs)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    if args.out.exists() and any(args.out.iterdir()):
        raise FileExistsError(f"{args.out} is not empty; refusing to mix new models with old files")
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.cuda_graphs is None:
        args.cuda_graphs = device.type == "cuda"
    corpus = load_corpus()
    tok_dir = args.out / "tokenizer"
    tokenizer = train_tokenizer(corpus.train, BASE_VOCAB, tok_dir)
    train_stream = token_stream(corpus.train, tokenizer)
    held_stream = token_stream(corpus.held_out, tokenizer)[:args.held_out_tokens]
    dialogues = make_dialogues(NUM_DIALOGUES, corpus.train_by_novel, tokenizer, args.seed)
    packed = pack_dialogues(dialogues, args.seq_len, PAD)
    lexicon = Lexicon.of(corpus.train + corpus.held_out)
    summary: dict[str, Any] = {
        "seed": args.seed, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "cuda_graphs": args.cuda_graphs,
        "corpus": {"file": str(CORPUS_FILE.relative_to(Path(__file__).parent.parent)),
                   "sha256": hashlib.sha256(CORPUS_FILE.read_bytes()).hexdigest(),
                   "train_tokens": len(train_stream), "held_out_tokens": len(held_stream),
                   "bytes_per_token": round(sum(len(p.encode()) + 2 for p in corpus.train) / len(train_stream), 3)},
        "tokenizer": {"base_vocab": BASE_VOCAB, "vocab": tokenizer.vocab_size},
        "dialogues": {"count": len(dialogues), "packed_rows": len(packed.inputs)},
        "unigram_perplexity": unigram_perplexity(train_stream, held_stream, tokenizer.vocab_size),
        "models": {},
    }
    log.info("data ready", extra={k: summary[k] for k in ("corpus", "tokenizer", "dialogues")})
    for name in args.models:
        summary["models"][name] = train_one(name, args, device, dtype, tokenizer, tok_dir, train_stream, held_stream,
                                            packed, lexicon)
        summary["seconds"] = round(time.perf_counter() - start, 1)
        # After each model, so a later model's failure leaves the earlier ones' report with their checkpoints.
        (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    shutil.rmtree(tok_dir)  # each model directory holds its own copy
    return summary


def train_one(name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, tokenizer, tok_dir: Path,
              train_stream: torch.Tensor, held_stream: torch.Tensor, packed,
              lexicon: Lexicon) -> dict[str, Any]:
    recipe = RECIPES[name]
    raw = kimi_k3_config(args.k3_layers) if name == "kimi-k3-austen" else MODELS[name]()
    cfg = ModelConfig.from_dict(raw, source=name)
    torch.manual_seed(args.seed)
    model = init_model(cfg, dtype, device, args.seed)
    batch = args.batch or recipe.batch
    mxfp4 = cfg.quantization == "mxfp4"
    trainer = Trainer(model, batch, args.seq_len, KDA_CHUNK, mxfp4_experts=False, cuda_graphs=args.cuda_graphs)
    prose = ProseSampler(train_stream, args.seq_len, device, args.seed)
    fixed = args.steps is not None
    total = args.steps or max(1, int(recipe.max_epochs * len(train_stream) / (batch * args.seq_len)))
    schedule = Schedule(recipe.lr, min(recipe.warmup, max(1, total // 10)), total)
    budget = None if fixed else (args.pretrain_s or recipe.pretrain_s)
    pre = trainer.run(prose.sample, schedule, PhaseReport(), log_every=10 if fixed else 50, name=name,
                      budget_s=budget)
    sft_steps = args.sft_steps if args.sft_steps is not None else max(1, round(recipe.sft_fraction * pre.steps))
    dialogues = DialogueSampler(packed, device, args.seed + 1)
    # MXFP4 experts: pretrain in bf16, then the supervised pass trains them as they will be served (rounded).
    trainer.use_mxfp4_experts(mxfp4)

    def mixed(rows: int):
        d, p = dialogues.sample(rows // 2), prose.sample(rows - rows // 2)
        return type(d)(torch.cat([d.inputs, p.inputs]), torch.cat([d.targets, p.targets]))

    sft = trainer.run(mixed, Schedule(recipe.lr * 0.3, max(1, sft_steps // 10), sft_steps, floor=0.0), PhaseReport(),
                      log_every=25, name=f"{name}/sft")
    trainer.finish()
    if mxfp4:
        round_experts_to_mxfp4(model)
    model.eval()
    report: dict[str, Any] = {
        "model_type": cfg.model_type, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "pretrain": asdict(pre), "sft": asdict(sft),
        "held_out": held_out_perplexity(model, held_stream, args.seq_len, batch, KDA_CHUNK),
        "samples": samples(model, tokenizer, args.sample_tokens, PAD, KDA_CHUNK),
        "english": english_check(model, tokenizer, lexicon, PAD, KDA_CHUNK),
    }
    out = args.out / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    write_shards(published_tensors(cfg, model), out, shards=1)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in out.iterdir())
    log.info("model written", extra={"model": name, "dir": str(out), "held_out": report["held_out"],
                                     "bytes": report["checkpoint_bytes"]})
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m training", description=__doc__.split("\n\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    setup_logging("training")
    summary = run(args)
    sys.stdout.write(json.dumps(summary) + "\n")
    return 0
