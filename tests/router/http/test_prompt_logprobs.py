"""Scoring prompts over HTTP as eval harnesses do (lm-evaluation-harness's local-completions sends `echo` +
`logprobs` + `max_tokens` 1; OpenAI's form is `max_tokens` 0): the echoed prompt's logprobs must equal an eager
float reference from the same checkpoint (`kimiserve generate --dump-logits`, in-process, no services), with the
legacy shape's null first position and text offsets into the echoed text. Also: vLLM's continuous_usage_stats,
and token bytes that are the tokenizer's own (a token inside a multi-byte character included)."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest
import torch
from safetensors.torch import load_file

from kimiserve.tokenizer_files.loading import load_tokenizer
from kimiserve.v1 import common_pb2, router_pb2
from tests.router.http.conftest import API_KEY

PROMPT = [11, 300, 42, 517, 9, 230, 77, 600, 5, 128, 64]


@pytest.fixture(scope="module")
def reference(http_stack, tmp_path_factory) -> torch.Tensor:
    """log-softmax [P, vocab] of the prompt's logits from the engine run in-process in float32, taken in float64."""
    dump = tmp_path_factory.mktemp("ref") / "logits.safetensors"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--model", str(http_stack.model_dir),
                          "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "1", "--ignore-eos",
                          "--json", "--dump-logits", str(dump)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return torch.log_softmax(load_file(str(dump))["prompt_logits"].double(), -1)


def _expected(reference: torch.Tensor) -> list[float]:
    return [reference[i, t].item() for i, t in enumerate(PROMPT[1:])]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(http_stack, reference):
    out = http_stack.client.completions.create(model="", prompt=[PROMPT], max_tokens=1, logprobs=1, echo=True,
                                               temperature=0)
    choice = out.choices[0]
    lp = choice.logprobs
    n = len(PROMPT)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(_expected(reference), abs=2e-4)
    for i, top in enumerate(lp.top_logprobs[1:n]):  # the one alternative asked for: the argmax at that position
        assert list(top.values()) == pytest.approx([reference[i].max().item()], abs=2e-4)
    assert choice.text == "".join(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 1)]
    assert out.usage.prompt_tokens == n and out.usage.completion_tokens == 1


def test_grpc_generate_carries_the_scored_prompt_on_the_first_chunk(http_stack, reference):
    sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=sampling)
    chunks = list(http_stack.grpc.Generate(req, metadata=http_stack.auth, timeout=120))
    scored = chunks[0].prompt_logprobs
    assert all(not c.HasField("prompt_logprobs") for c in chunks[1:])
    assert list(scored.logprobs) == pytest.approx(_expected(reference), abs=2e-4)
    assert len(scored.top_logprobs) == len(PROMPT) - 1
    for i, top in enumerate(scored.top_logprobs):
        best = reference[i].topk(2)
        assert [c.token_id for c in top.candidates] == best.indices.tolist()
        assert [c.logprob for c in top.candidates] == pytest.approx(best.values.tolist(), abs=2e-4)


def test_max_tokens_zero_with_echo_returns_the_scored_prompt_alone(http_stack, reference):
    out = http_stack.client.completions.create(model="", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    choice, n = out.choices[0], len(PROMPT)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == n and choice.logprobs.top_logprobs is None
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(_expected(reference), abs=2e-4)
    assert choice.text == "".join(choice.logprobs.tokens)
    streamed = list(http_stack.client.completions.create(model="", prompt=PROMPT, max_tokens=0, logprobs=0,
                                                         echo=True, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert [v for c in streamed if c.choices and c.choices[0].logprobs
            for v in c.choices[0].logprobs.token_logprobs] == choice.logprobs.token_logprobs


def test_a_cached_prompt_is_scored_again(http_stack, reference):
    """The first requests above left PROMPT in the shard's prefix cache; scoring it recomputes the prefill."""
    http_stack.client.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0)
    out = http_stack.client.completions.create(model="", prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    assert out.choices[0].logprobs.token_logprobs[1:] == pytest.approx(_expected(reference), abs=2e-4)


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": -3}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 1, "temperature": -1.0}, "temperature"),
    ({"prompt": PROMPT, "max_tokens": 1, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": PROMPT, "max_tokens": 1, "logprobs": 6, "echo": True}, "logprobs"),
])
def test_every_400_names_its_param(http_stack, body, param):
    r = httpx.post(http_stack.base + "/v1/completions", json={"model": "", **body},
                   headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_refuses_prompt_logprobs_by_name(http_stack):
    r = httpx.post(http_stack.base + "/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"},
                   json={"model": "", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_continuous_usage_stats_puts_usage_on_every_chunk(http_stack):
    opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = list(http_stack.client.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True, **opts}))
    assert chunks and all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == len(PROMPT) for c in chunks)
    generated = [c.usage.completion_tokens for c in chunks if c.choices]
    assert generated == sorted(generated) and generated[-1] == 5 and chunks[-1].usage.completion_tokens == 5
    chat = list(http_stack.client.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, stream=True,
        extra_body={"ignore_eos": True, **opts}))
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chat)
    assert chat[-1].usage.completion_tokens == 4


def test_logprob_bytes_are_the_tokenizers_own(http_stack):
    """Alternatives that are part of a multi-byte character carry their real bytes (not the re-encoded U+FFFD)
    and a distinct `bytes:` name, so none merge; the chosen tokens' bytes are their ids' bytes."""
    table = load_tokenizer(http_stack.model_dir).token_bytes
    by_bytes = {b: i for i, b in enumerate(table)}
    out = http_stack.client.chat.completions.create(model="", messages=[{"role": "user", "content": "Tell a tale"}],
                                                    max_tokens=8, temperature=0, logprobs=True, top_logprobs=20,
                                                    extra_body={"ignore_eos": True})
    partial = 0
    for entry in out.choices[0].logprobs.content:
        assert bytes(entry.bytes) in by_bytes or entry.token.startswith("token_id:")  # an id past the tokenizer's
        names = [alt.token for alt in entry.top_logprobs]
        assert len(set(names)) == len(names)
        for alt in entry.top_logprobs:
            real = bytes(alt.bytes)
            if alt.token.startswith("token_id:"):  # a model id past the tokenizer's vocabulary: no bytes
                assert int(alt.token.removeprefix("token_id:")) >= len(table) and real == b""
                continue
            assert real in by_bytes
            try:
                assert alt.token == real.decode("utf-8")
            except UnicodeDecodeError:
                partial += 1
                assert alt.token == "bytes:" + "".join(f"\\x{x:02x}" for x in real)
    assert partial > 0  # the tiny tokenizer's byte tokens >= 0x80 are among the alternatives


def test_vllm_prompt_logprobs_extension(http_stack, reference):
    def post(body: dict) -> dict:
        r = httpx.post(http_stack.base + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"},
                       json={"model": "", "prompt": PROMPT, "prompt_logprobs": 2, **body}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    whole = post({"max_tokens": 1, "temperature": 0})
    scored = whole["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(PROMPT) and scored[0] is None
    for pos, entry in enumerate(scored[1:]):
        token, row = PROMPT[pos + 1], reference[pos]
        mine = entry[str(token)]
        assert mine["logprob"] == pytest.approx(row[token].item(), abs=2e-4)
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        best = row.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
        assert set(entry) == {str(token), *map(str, best)}
    streamed = httpx.post(http_stack.base + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"},
                          json={"model": "", "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 0,
                                "stream": True}, timeout=60)
    chunks = [json.loads(line.removeprefix("data: ")) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    with_scores = [c for c in chunks if c["choices"] and c["choices"][0].get("prompt_logprobs")]
    assert len(with_scores) == 1 and with_scores[0]["choices"][0]["prompt_logprobs"] == scored
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ""  # max_tokens 0: no completion


def test_each_choice_of_several_prompts_echoes_its_own_scored_prompt(http_stack, reference):
    other = PROMPT[3:]
    kw = dict(model="", prompt=[PROMPT, other], n=2, max_tokens=2, logprobs=0, echo=True, temperature=0,
              extra_body={"ignore_eos": True})
    whole = http_stack.client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for c in whole.choices:
        prompt = PROMPT if c.index < 2 else other
        assert len(c.logprobs.tokens) == len(prompt) + 2 and c.logprobs.token_logprobs[0] is None
    assert whole.choices[0].logprobs.token_logprobs[1:len(PROMPT)] == pytest.approx(_expected(reference), abs=2e-4)
    streamed: dict[int, list] = {}
    for chunk in http_stack.client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in whole.choices:  # equal but for the float noise of other batch neighbours
        mine = streamed[c.index]
        assert mine[0] is None and mine[1:] == pytest.approx(c.logprobs.token_logprobs[1:], abs=2e-4)


def test_grpc_chat_carries_the_scored_rendered_prompt(http_stack):
    req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Score me")],
                                 sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    chunks = list(http_stack.grpc.Chat(req, metadata=http_stack.auth, timeout=120))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert len(chunks[0].prompt_logprobs.logprobs) == prompt_tokens - 1 > 0
    assert all(lp <= 0 for lp in chunks[0].prompt_logprobs.logprobs)
