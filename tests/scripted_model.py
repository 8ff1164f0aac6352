"""A tiny Kimi-Linear checkpoint whose greedy reply the test chooses: its next token depends only on the current one.

Every layer's output projection (attention, KDA, dense MLP, experts, shared experts) is zeroed, so the residual stream
at each position is the token's own embedding; the embeddings are random unit vectors (nearly orthogonal in 64
dimensions), and lm_head's row for token s is a multiple of the embedding of the token that should precede it. So
greedy decoding follows a chain of tokens exactly. The real loader, shard, tokenizer and router serve it unchanged,
which lets a stack test pin what the model says (a thinking block, a tool call) instead of hoping a random model
says it.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shard_svc.make_tiny import make_tiny

ZEROED = ("o_proj.weight", "down_proj.weight", ".w2.weight")  # every write back into the residual stream
HEAD_SCALE = 4.0  # the successor's logit is HEAD_SCALE * sqrt(hidden) = 32; any other row's about +-4


def write_scripted_model(out: Path, chain: list[int | str], seed: int = 0) -> Path:
    """make_tiny's Kimi-Linear checkpoint and tokenizer in `out`, rewritten so that greedy decoding follows `chain`:
    after each of its tokens comes the next. A token is an id or a special token's text ("<think>"). A token may
    come back (a loop), but always followed by the same token: the next token depends on the current one only."""
    make_tiny("kimi_linear", out, seed)
    added = {t["content"]: t["id"] for t in json.loads((out / "tokenizer.json").read_text())["added_tokens"]}
    ids = [added[t] if isinstance(t, str) else t for t in chain]
    successor: dict[int, int] = {}
    for before, after in pairwise(ids):
        if successor.setdefault(before, after) != after:
            raise ValueError(f"token {before} is followed by both {successor[before]} and {after} in {chain}")
    path = out / "model.safetensors"
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith(ZEROED):
            t.zero_()
    embed = tensors["model.embed_tokens.weight"]
    vocab, hidden = embed.shape
    unit = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
    unit = unit / unit.norm(dim=1, keepdim=True)
    head = torch.zeros(vocab, hidden)
    for before, after in successor.items():  # a row sums its predecessors' directions: each one selects it
        head[after] += HEAD_SCALE * unit[before]
    tensors["model.embed_tokens.weight"] = unit.to(embed.dtype)
    tensors["lm_head.weight"] = head.to(tensors["lm_head.weight"].dtype)
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    save_file(tensors, path, metadata={"format": "pt"})
    return out
