"""`kimiserve generate`: run the engine in-process on one prompt (no services), for checks and parity runs.

A checkpoint without tokenizer files still generates from `--prompt-ids`: the reply is then its token ids. Whatever
needs text (`--prompt`, `--output text`, `--json-schema`) is refused before the model loads, naming the missing files.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from kimiserve.devices import DEVICE_HELP, resolve_device
from kimiserve.sampling_args import add_sampling_args
from kimiserve.tokenizer_files.errors import MissingTokenizer
from kimiserve.tokenizer_files.loading import TIKTOKEN_MODEL, TOKENIZER_JSON, has_tokenizer, load_tokenizer
from shard_svc.build import EngineOptions, build_engine
from shard_svc.checkpoint import LOAD_FORMATS
from shard_svc.engine.engine import Engine, EngineConfig
from shard_svc.engine.grammar import ResponseFormat
from shard_svc.engine.sampling import SamplingParams
from shard_svc.parallel.errors import GroupError
from shard_svc.parallel.launch import add_group_args
from shard_svc.weight_streaming.mode import add_weights_args, weights_args

log = logging.getLogger(__name__)


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    fmt = ResponseFormat("json_schema", args.json_schema) if args.json_schema is not None else None
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids),
                          ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                          response_format=fmt, min_tokens=args.min_tokens)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    add_sampling_args(p)
    p.add_argument("--device", default="auto", help=f"{DEVICE_HELP} (default: %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--load-format", choices=sorted(LOAD_FORMATS), default="safetensors",
                   help="dummy: random weights from config.json alone (benchmarks)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (default on CUDA when every decode op is graph-safe)")
    p.add_argument("--output", choices=["auto", "text", "ids"], default="auto",
                   help="what stdout shows without --json: the reply's text or its comma-separated token ids; auto: "
                        "text when the checkpoint has a tokenizer, else ids")
    p.add_argument("--dump-logits", type=Path, default=None,
                   help="write prompt_logits [P, vocab] and step_logits [C, vocab] (float32) as safetensors")
    add_group_args(p)
    add_weights_args(p)  # --weights resident|stream|auto, --prefetch-depth, --weight-slots, --pinned-memory-gb


def _check_tokenizer_needs(args: argparse.Namespace) -> None:
    """Refuses, before the model loads, what needs text from a checkpoint without tokenizer files."""
    needs = [why for why, asked in (("--prompt (text to encode)", args.prompt is not None),
                                    ("--output text", args.output == "text"),
                                    ("--json-schema (a grammar over token texts)", args.json_schema is not None))
             if asked]
    if needs and not has_tokenizer(args.model):
        raise MissingTokenizer(f"{args.model} has no tokenizer (neither {TOKENIZER_JSON} nor {TIKTOKEN_MODEL}), "
                               f"which {' and '.join(needs)} needs; pass --prompt-ids and read token ids instead")


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    """One sequence at a time; the response_format vocabulary only when --json-schema asks for it."""
    return EngineOptions(args.model, resolve_device(args.device), args.dtype, load_format=args.load_format,
                         config=EngineConfig(num_state_slots=1), weights=weights_args(args),
                         enforce_eager=args.enforce_eager, grammars=args.json_schema is not None, tp=args.tp,
                         ep=args.ep, group_timeout_s=args.group_timeout)


def run(args: argparse.Namespace) -> int:
    _check_tokenizer_needs(args)
    built = build_engine(options_from_args(args))
    failed = True
    try:
        code = _generate(args, built.engine)
        failed = False
    except GroupError as e:
        log.error("generate failed: the shard group broke", extra={"error": str(e)})
        return 1
    finally:
        built.close(failed=failed)
    return code


def _generate(args: argparse.Namespace, engine: Engine) -> int:
    tokenizer = load_tokenizer(args.model) if has_tokenizer(args.model) else None  # None: ids only (checked in run)
    prompt = args.prompt_ids if args.prompt is None else tokenizer.encode(args.prompt)
    seq = engine.generate(prompt, sampling_from_args(args), keep_prompt_logits=args.dump_logits is not None)
    if args.dump_logits:
        from safetensors.torch import save_file

        save_file({"prompt_logits": torch.cat(seq.prompt_logits).float().contiguous(),
                   "step_logits": torch.cat(seq.step_logits).float().contiguous()}, str(args.dump_logits))
    text = tokenizer.decode(seq.output) if tokenizer is not None else None  # None: no tokenizer to decode with
    result = {"token_ids": seq.output, "text": text, "finish_reason": seq.finish_reason,
              "usage": {"prompt_tokens": len(seq.prompt), "completion_tokens": len(seq.output)}}
    if args.json:
        shown = json.dumps(result)
    elif text is not None and args.output != "ids":
        shown = text
    else:
        shown = ",".join(str(t) for t in seq.output)
    sys.stdout.write(shown + "\n")
    return 0 if seq.finish_reason in ("stop", "length") else 1
