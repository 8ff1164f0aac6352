"""POST /v1/completions: prompt forms, echo, n, several prompts, and logprobs equal to the engine's own logits
(`kimiserve generate --dump-logits`), delivered on the gRPC API too."""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import torch
from safetensors.torch import load_file

from kimiserve.v1 import common_pb2, router_pb2
from shard_svc.make_tiny import IM_END

IDS = [1, 2, 3, 4, 5]
A = 14  # the tiny tokenizer's "a"


def test_text_and_token_id_prompts(http_stack):
    c = http_stack.client.completions
    text = c.create(model=http_stack.model, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].finish_reason in ("stop", "length") and text.usage.completion_tokens >= 1
    ids = c.create(model="", prompt=IDS, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == len(IDS) and ids.usage.completion_tokens == 4
    as_list = c.create(model="", prompt=[IDS], max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert as_list.choices[0].text == ids.choices[0].text


def test_echo_puts_the_prompt_first(http_stack):
    c = http_stack.client.completions
    plain = c.create(model="", prompt="Once upon a time", max_tokens=4, temperature=0)
    echoed = c.create(model="", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    streamed = c.create(model="", prompt="Once upon a time", max_tokens=4, temperature=0, echo=True, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == echoed.choices[0].text


def test_n_and_several_prompts_index_choices(http_stack):
    c = http_stack.client.completions
    out = c.create(model="", prompt=["Hello", IDS], n=2, max_tokens=3, temperature=1.0, seed=5,
                   extra_body={"ignore_eos": True})
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(["Hello", IDS]):
        for i in range(2):
            single = c.create(model="", prompt=prompt, max_tokens=3, temperature=1.0, seed=5 + i,
                              extra_body={"ignore_eos": True})
            assert out.choices[p * 2 + i].text == single.choices[0].text
    hello = c.create(model="", prompt="Hello", max_tokens=1).usage.prompt_tokens
    assert out.usage.prompt_tokens == hello + len(IDS)  # each prompt counted once, not once per choice
    assert out.usage.completion_tokens == 4 * 3


def dumped_logprobs(model_dir, tmp_path, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and log-softmax of their logits, from the engine run in-process (no services)."""
    dump = tmp_path / "logits.safetensors"
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--model", str(model_dir),
                          "--prompt-ids", ",".join(map(str, IDS)), "--max-tokens", str(max_tokens), "--ignore-eos",
                          "--json", "--dump-logits", str(dump)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    tokens = json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]
    logp = torch.log_softmax(load_file(str(dump))["step_logits"].double(), -1)
    return tokens, [logp[i, t].item() for i, t in enumerate(tokens)]


def test_logprobs_equal_the_engine_logits(http_stack, tmp_path):
    tokens, expected = dumped_logprobs(http_stack.model_dir, tmp_path, 6)
    out = http_stack.client.completions.create(model="", prompt=IDS, max_tokens=6, temperature=0, logprobs=0,
                                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.text_offset) == 6
    assert lp.token_logprobs == pytest.approx(expected, abs=2e-4)
    assert "".join(lp.tokens) == out.choices[0].text  # no stop string: every token's text is in the reply
    assert lp.text_offset[0] == 0 and all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:],
                                                                            lp.tokens))
    # The gRPC API delivers the same values (token_logprobs, one per token id).
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=IDS), sampling=common_pb2.SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))
    chunks = list(http_stack.grpc.Generate(req, metadata=http_stack.auth, timeout=120))
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert all(len(c.token_logprobs) == len(c.token_ids) for c in chunks)
    assert [v for c in chunks for v in c.token_logprobs] == pytest.approx(expected, abs=2e-4)



def test_stop_strings_cut_the_text(http_stack):
    kw = dict(model="", prompt=IDS, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    full = http_stack.client.completions.create(**kw).choices[0].text
    stop = next(full[k:k + n] for n in (2, 1) for k in range(1, len(full) - n)
                if full.find(full[k:k + n]) == k and full[k:k + n].strip())
    cut = http_stack.client.completions.create(**kw, stop=[stop, "never-appears"]).choices[0]
    assert cut.text == full[:full.find(stop)] and cut.finish_reason == "stop"
    streamed = list(http_stack.client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = http_stack.client.completions.create(**kw, stop=[stop, "never-appears"]).choices[0]
    assert kept.text == full[:full.find(stop) + len(stop)] and kept.finish_reason == "stop"
    streamed = list(http_stack.client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == kept.text


def test_min_tokens_holds_off_eos_stop_ids_and_stop_strings(http_stack):
    """vLLM's min_tokens: EOS biased to all but certain ends the reply at once, or on the first token after
    min_tokens; a stop string ending in the text of the first min_tokens - 1 tokens is passed over (the 3rd `a` of
    `aaaa` stops min_tokens 3), streamed or not."""
    kw = dict(model="", prompt=IDS, max_tokens=10, temperature=0)
    c = http_stack.client.completions
    eos = {"logit_bias": {str(IM_END): 100}}
    assert c.create(**kw, extra_body=eos).usage.completion_tokens == 1
    held = c.create(**kw, extra_body=eos | {"min_tokens": 4})
    assert held.usage.completion_tokens == 5 and held.choices[0].finish_reason == "stop"
    a = {"logit_bias": {str(A): 100}, "min_tokens": 3}
    cut = c.create(**kw, stop=["a"], extra_body=a).choices[0]
    assert (cut.text, cut.finish_reason) == ("aa", "stop")
    streamed = list(c.create(**kw, stop=["a"], extra_body=a, stream=True))
    assert "".join(x.choices[0].text for x in streamed) == "aa"


@pytest.mark.parametrize("extra, param", [
    ({"min_tokens": 11}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_min_tokens_out_of_bounds_is_refused(http_stack, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        http_stack.client.completions.create(model="", prompt=IDS, max_tokens=10, extra_body=extra)
    assert e.value.body["param"] == param and "min_tokens" in e.value.body["message"]


def test_legacy_top_logprobs(http_stack):
    out = http_stack.client.completions.create(model="", prompt=IDS, max_tokens=4, temperature=0, logprobs=2,
                                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    for chosen, alternatives in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(alternatives) <= 2 and max(alternatives.values()) == pytest.approx(chosen)
