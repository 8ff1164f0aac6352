"""Prompt and sampling flags shared by `kimiserve generate` (in-process) and `kimiserve complete` (via the router),
so the two take the same flags and can be compared output for output."""

from __future__ import annotations

import argparse


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", type=_ids, help="comma-separated prompt token ids")
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=0, help="EOS and stop ids cannot end the output before this "
                                                              "many tokens; 0 = off")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="[0, 1]; 0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=_ids, default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2]; 0 = off")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2]; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="(0, 2]; 1 = off")
    p.add_argument("--json-schema", default=None, help="constrain the output to JSON valid under this schema "
                                                         "(JSON text)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object with tokens and usage")
