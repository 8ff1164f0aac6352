"""The served stack (router + tokenizer + shard as processes, gRPC on localhost) gives offline `kimiserve generate`'s
tokens, text, usage and log-probabilities on the trained default model, greedy and sampled, and a chat turn rendered
by the tokenizer service replies with offline's tokens for the same rendering."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import grpc
import pytest
import torch
from safetensors.torch import load_file

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_stack, stop_stack
from shard_svc import generate as generate_cli
from tests.trained.conftest import CHATS, LINEAR, chat_ids, model_dir

MAX_TOKENS = 32
TOP = 5
MODES = {"greedy": (0.0, []), "sampled": (0.8, ["--temperature", "0.8", "--seed", "5"])}


@pytest.fixture(scope="module")
def served():
    path = model_dir(LINEAR)
    children = start_stack(path, 1, "cpu", "127.0.0.1", free_port(), timeout=180,
                           shard_args=("--num-state-slots", "4", "--num-kv-blocks", "64"))
    router = next(c for c in children if c.name == "router").address
    channel = grpc.insecure_channel(router)
    yield path, router_pb2_grpc.RouterStub(channel)
    channel.close()
    stop_stack(children, grace_s=20)


def offline_generate(path, prompt: list[int], flags: list[str], dump) -> tuple[dict, torch.Tensor]:
    """`kimiserve generate --json --dump-logits` run in this process: (its JSON, the logits of each generated token)."""
    parser = argparse.ArgumentParser()
    generate_cli.add_args(parser)
    args = parser.parse_args(["--model", str(path), "--prompt-ids", ",".join(map(str, prompt)), "--json",
                              "--max-tokens", str(MAX_TOKENS), "--dump-logits", str(dump), *flags])
    out = io.StringIO()
    with redirect_stdout(out):
        assert generate_cli.run(args) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1]), load_file(str(dump))["step_logits"]


@pytest.mark.parametrize("mode", MODES)
def test_served_tokens_and_logprobs_equal_offline_generate(served, mode, tmp_path):
    path, stub = served
    temperature, flags = MODES[mode]
    prompt = chat_ids(path)[0]  # CHATS[0] in the Kimi format, the default system turn first
    ref, logits = offline_generate(path, prompt, flags, tmp_path / "logits.safetensors")
    assert ref["text"].strip(), "the trained model's reply is empty"
    sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5, logprobs=True,
                                         top_logprobs=TOP)
    ids, text, tops, last = [], "", [], None
    for chunk in stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=prompt),
                                                          sampling=sampling), timeout=120):
        ids += chunk.token_ids
        text += chunk.text
        tops += chunk.top_logprobs
        last = chunk
    assert (ids, text) == (ref["token_ids"], ref["text"]), f"{CHATS[0]!r}: served {text!r} != offline {ref['text']!r}"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(ids))
    # Each position's candidates: the top of the distribution the token was drawn from, as the offline logits say.
    dist = torch.log_softmax(logits.double() / (temperature or 1.0), -1)
    want = dist.topk(TOP, -1)
    assert len(tops) == len(ids)
    for i, top in enumerate(tops):
        assert [c.token_id for c in top.candidates] == want.indices[i].tolist(), f"position {i}: other candidates"
        got = torch.tensor([c.logprob for c in top.candidates], dtype=torch.float64)
        assert torch.allclose(got, want.values[i], atol=1e-5), f"position {i}: logprobs {got} != {want.values[i]}"


def test_served_chat_renders_the_kimi_format_and_replies_as_offline(served, tmp_path):
    path, stub = served
    ref, _ = offline_generate(path, chat_ids(path)[0], [], tmp_path / "logits.safetensors")
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content=CHATS[0])],
                                 sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    ids, text = [], ""
    for chunk in stub.Chat(req, timeout=120):
        ids += chunk.token_ids
        text += chunk.text
    assert (ids, text) == (ref["token_ids"], ref["text"])
