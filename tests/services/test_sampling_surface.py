"""Penalties, top_logprobs and response_format through the real stack (router, tokenizer, shards over gRPC)."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from kimiserve.v1 import common_pb2, router_pb2
from tests.services.helpers import cli_json, generate

PROMPT = "The quick brown fox"
# Small and bounded, so that even a random model completes it in a few dozen tokens.
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_penalties_change_greedy_output_and_it_equals_offline_generate(stack, tiny_k3):
    penalties = ["--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--repetition-penalty", "1.3"]
    base = ["--prompt", PROMPT, "--json", "--max-tokens", "16", "--ignore-eos"]
    offline = cli_json("generate", "--model", str(tiny_k3), *base, *penalties)
    served = cli_json("complete", "--router", stack.router, *base, *penalties)
    assert served == offline
    plain, _, _ = generate(stack.stub, text=PROMPT, max_tokens=16, ignore_eos=True)
    assert plain != served["token_ids"]


def test_json_schema_output_validates(stack):
    fmt = common_pb2.ResponseFormat(json_schema=common_pb2.ResponseFormat.JsonSchema(
        name="reply", schema=json.dumps(SCHEMA), strict=True))
    for kw in (dict(), dict(temperature=0.7, seed=5)):
        _, text, last = generate(stack.stub, text=PROMPT, max_tokens=48, response_format=fmt, **kw)
        assert last.finish_reason == common_pb2.FINISH_REASON_STOP, (kw, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_penalised_requests_repeat_exactly(stack):
    kw = dict(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True, frequency_penalty=2.0,
              repetition_penalty=1.5)
    first, second = generate(stack.stub, text=PROMPT, **kw), generate(stack.stub, text=PROMPT, **kw)
    assert first[0] == second[0] and len(first[0]) == 12


def test_top_logprobs_arrive_with_every_token(stack):
    for method in ("Generate", "Chat"):
        sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True,
                                             top_logprobs=4, presence_penalty=1.0)
        if method == "Generate":
            chunks = list(stack.stub.Generate(router_pb2.GenerateRequest(text=PROMPT, sampling=sampling), timeout=60))
        else:
            chunks = list(stack.stub.Chat(router_pb2.ChatRequest(
                messages=[common_pb2.ChatMessage(role="user", content="Hi")], sampling=sampling), timeout=60))
        tokens = [(t, top) for c in chunks for t, top in zip(c.token_ids, c.top_logprobs, strict=True)]
        assert len(tokens) == 6 and all(len(c.top_logprobs) == len(c.token_ids) for c in chunks), method
        for token, top in tokens:
            lps = [c.logprob for c in top.candidates]
            assert len(top.candidates) == 4 and lps == sorted(lps, reverse=True) and lps[0] <= 0
            # greedy: the drawn token is the most likely candidate of the distribution it was drawn from
            assert top.candidates[0].token_id == token or lps[0] == lps[1]


@pytest.mark.parametrize("sampling,needle", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(top_logprobs=3), "needs logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(response_format=common_pb2.ResponseFormat(
        json_schema=common_pb2.ResponseFormat.JsonSchema(schema="{nope"))), "not JSON"),
    (dict(response_format=common_pb2.ResponseFormat(json_object=common_pb2.ResponseFormat.JsonObject()),
          ignore_eos=True), "ignore_eos"),
    # passes the router's checks; the shard's grammar engine refuses it at submit
    (dict(response_format=common_pb2.ResponseFormat(json_schema=common_pb2.ResponseFormat.JsonSchema(
        schema=json.dumps({"type": "array", "uniqueItems": True})))), "uniqueItems"),
    (dict(response_format=common_pb2.ResponseFormat(regex="[a-")), "unclosed character class"),
])
def test_bad_sampling_fields_are_invalid_argument(stack, sampling, needle):
    req = router_pb2.GenerateRequest(text=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=4, **sampling))
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()
    ids, _, last = generate(stack.stub, ids=[1, 2, 3], max_tokens=2, ignore_eos=True)
    assert len(ids) == 2 and last.usage.completion_tokens == 2, "the stack keeps serving"
