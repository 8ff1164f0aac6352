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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import Any

import grpc
import torch
from openai import OpenAI
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from kimiserve.ports import free_port
from kimiserve.tokenizer_files.tiny import write_tiny_tokenizer
from kimiserve.v1 import router_pb2_grpc
from launcher.up import start_stack, stop_stack
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


def tiny_ids(out: Path) -> Callable[[str], list[int]]:
    """Text -> the ids of the tokenizer a scripted model gets (written to `out`), to script a reply in words."""
    write_tiny_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    return lambda text: tok.encode(text, add_special_tokens=False).ids


@contextmanager
def scripted_stack(model: Path) -> Iterator[dict[str, Any]]:
    """`kimiserve up` of a scripted checkpoint on the CPU, as a client meets it: "openai" (the SDK on its HTTP API),
    "grpc" (a Router stub), "router" (its gRPC address) and "model" (the served name)."""
    http_port = free_port()
    children = start_stack(model, 1, "cpu", "127.0.0.1", free_port(), timeout=180,
                           router_args=("--http-port", str(http_port)))
    router = {c.name: c for c in children}["router"].address
    channel = grpc.insecure_channel(router)
    try:
        yield {"openai": OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0,
                                timeout=60),
               "grpc": router_pb2_grpc.RouterStub(channel), "router": router, "model": model.name}
    finally:
        channel.close()
        stop_stack(children, grace_s=20)
