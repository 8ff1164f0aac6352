"""The served stack (router + tokenizer + shard as processes, gRPC on localhost) gives offline `kimiserve generate`'s
tokens, text and usage for a chat prompt on the trained default model, and the shard's logprobs equal the offline
logits' log-probabilities of the same tokens."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch
from safetensors.torch import load_file

from kimiserve.ports import free_port
from kimiserve.up import start_stack, stop_stack
from kimiserve.v1 import common_pb2, shard_pb2, shard_pb2_grpc
from tests.services.helpers import cli_json
from tests.trained.conftest import CHATS, LINEAR, chat_ids, model_dir

MAX_TOKENS = 32
TEMPERATURE = 0.8
FLAGS = {"greedy": ["--max-tokens", str(MAX_TOKENS)],
         "sampled": ["--max-tokens", str(MAX_TOKENS), "--temperature", str(TEMPERATURE), "--seed", "5"]}


@pytest.fixture(scope="module")
def served():
    path = model_dir(LINEAR)
    children = start_stack(path, 1, "cpu", "127.0.0.1", free_port(), timeout=180,
                           shard_args=("--num-state-slots", "4", "--num-kv-blocks", "64"))
    yield path, {c.name: c.address for c in children}
    stop_stack(children, grace_s=20)


def shard_tokens(address: str, prompt: list[int], sampling: common_pb2.SamplingParams) -> list[tuple[int, float]]:
    """(token, logprob) of one sequence submitted straight to the served shard's Stream."""
    done = threading.Event()

    def requests():
        yield shard_pb2.ShardRequest(submit=shard_pb2.ShardRequest.Submit(
            request_id="trained-parity-1", prompt_token_ids=prompt, sampling=sampling, max_tokens=MAX_TOKENS))
        done.wait(120)  # keep the stream open until the sequence finished

    out = []
    with grpc.insecure_channel(address) as channel:
        try:
            for event in shard_pb2_grpc.ShardStub(channel).Stream(requests(), timeout=120):
                kind = event.WhichOneof("kind")
                assert kind != "error", event.error.message
                if kind == "token":
                    out.append((event.token.token_id, event.token.logprob))
                if kind == "finished":
                    break
        finally:
            done.set()
    return out


@pytest.mark.parametrize("mode", FLAGS)
def test_served_chat_reply_equals_offline_generate(served, mode, tmp_path):
    path, addresses = served
    prompt = ",".join(map(str, chat_ids(path)[0]))  # CHATS[0], rendered in the Kimi format with the default system
    dump = tmp_path / "logits.safetensors"
    offline = cli_json("generate", "--model", str(path), "--prompt-ids", prompt, "--json", "--dump-logits", str(dump),
                       *FLAGS[mode])
    online = cli_json("complete", "--router", addresses["router"], "--prompt-ids", prompt, "--json", *FLAGS[mode])
    assert online == offline, f"{CHATS[0]!r}: served {online} != offline {offline}"
    assert offline["text"].strip(), "the trained model's reply is empty"

    temperature = TEMPERATURE if mode == "sampled" else 0.0
    sampling = common_pb2.SamplingParams(temperature=temperature, seed=5, logprobs=True)
    events = shard_tokens(addresses["shard-0"], [int(t) for t in prompt.split(",")], sampling)
    assert [t for t, _ in events] == offline["token_ids"]
    logits = load_file(str(dump))["step_logits"]  # [C, vocab]: the logits each generated token was drawn from
    scaled = logits / temperature if temperature else logits
    expected = torch.log_softmax(scaled.double(), -1).gather(-1, torch.tensor(offline["token_ids"])[:, None])[:, 0]
    got = torch.tensor([lp for _, lp in events], dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-5), f"logprobs differ by {float((got - expected).abs().max()):.2e}"
