"""A checkpoint whose config.json names an eos id its tokenizer does not hold (issue 25: the served benchmark's
full-size config beside the tiny tokenizer killed the shard at start-up) is served: the shard starts with its
default capacity, structured output is refused per request with the reason, and other requests are answered."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from openai import OpenAI

from kimiserve.ports import free_port
from launcher.up import start_stack, stop_stack


@pytest.fixture(scope="module")
def client(tiny_linear, tmp_path_factory):
    model = tmp_path_factory.mktemp("eos") / "tiny-eos-900"
    shutil.copytree(tiny_linear, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = 900  # in the model's 1,024 ids, past the tokenizer's 768
    (model / "config.json").write_text(json.dumps(config))
    http_port = free_port()
    children = start_stack(model, 1, "cpu", "127.0.0.1", free_port(), timeout=180,
                           router_args=("--http-port", str(http_port),
                                        "--batch-db", str(model.parent / "batches.sqlite3")))
    yield OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
    stop_stack(children, grace_s=20)


def test_response_format_is_refused_naming_why_and_the_shard_keeps_serving(client):
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Hello"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                       response_format={"type": "json_object"})
    text = str(e.value)
    assert "response_format cannot be enforced" in text and "eos_token_id [900]" in text and "768 ids" in text
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
