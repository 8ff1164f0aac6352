"""The request contract without a network: one sampling rule set on both sides of the shard's wire, and the
router's one error table (shard refusals, tokenizer statuses, what a client is told)."""

import grpc
import pytest

from kimiserve.v1 import common_pb2, shard_pb2
from router.errors import (
    AlreadyExists, InvalidArgument, NotFound, RouterError, ShardUnavailable, from_shard, from_tokenizer, refusal)
from router.generation import validate_sampling
from shard_svc.engine.grammar import ResponseFormat
from shard_svc.engine.sampling import SamplingParams
from shard_svc.errors import InvalidRequest

VOCAB = 100


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("temperature", -0.5), ("temperature", 101.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
    ("min_p", -0.5), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.5), ("top_logprobs", 21), ("prompt_logprobs", 21),
])
def test_router_and_shard_refuse_the_same_value_with_the_same_words(field, value):
    """The router refuses early and the shard again (for callers that are not our router): one rule, one text.
    Values exact in float32, the wire's width."""
    wire = common_pb2.SamplingParams(logprobs=True, **{field: value})
    with pytest.raises(InvalidArgument) as routed:
        validate_sampling(wire)
    with pytest.raises(InvalidRequest) as on_shard:
        SamplingParams(logprobs=True, **{field: value}).validate(VOCAB)
    assert routed.value.param == on_shard.value.param == field
    assert str(routed.value) == str(on_shard.value) and field in str(routed.value)


def test_response_format_rules_are_shared_and_blame_response_format():
    wire = common_pb2.SamplingParams(ignore_eos=True, response_format=common_pb2.ResponseFormat(regex=""))
    with pytest.raises(InvalidArgument) as routed:
        validate_sampling(wire)
    with pytest.raises(InvalidRequest) as on_shard:
        SamplingParams(ignore_eos=True, response_format=ResponseFormat("regex", "")).validate(VOCAB)
    assert routed.value.param == on_shard.value.param == "response_format"
    for text in (str(routed.value), str(on_shard.value)):
        assert "ignore_eos cannot be combined" in text and "regex is empty" in text


def test_min_tokens_over_max_tokens_is_refused_on_both_sides_with_the_same_words():
    with pytest.raises(InvalidArgument) as routed:
        validate_sampling(common_pb2.SamplingParams(max_tokens=4, min_tokens=5))
    with pytest.raises(InvalidRequest) as on_shard:
        SamplingParams(max_tokens=4, min_tokens=5).validate(VOCAB)
    assert routed.value.param == on_shard.value.param == "min_tokens"
    assert str(routed.value) == str(on_shard.value) == "min_tokens must be <= max_tokens (4), got 5"


def test_stop_token_ids_outside_the_vocabulary_are_refused_by_the_shard_with_their_field():
    with pytest.raises(InvalidRequest, match=r"stop_token_ids: 1 token ids outside \[0, vocab size 100\)") as e:
        SamplingParams(stop_token_ids=(3, 100)).validate(VOCAB)
    assert e.value.param == "stop_token_ids"


def test_a_shard_refusal_keeps_its_code_and_the_field_it_blames():
    error = from_shard(shard_pb2.ShardEvent.Error(code=shard_pb2.SHARD_ERROR_CODE_INVALID_ARGUMENT,
                                                  message="top_p must be in (0, 1], got 2", param="top_p"))
    assert isinstance(error, InvalidArgument) and error.param == "top_p" and "top_p must be" in str(error)
    duplicate = from_shard(shard_pb2.ShardEvent.Error(code=shard_pb2.SHARD_ERROR_CODE_ALREADY_EXISTS, message="x"))
    assert isinstance(duplicate, AlreadyExists) and duplicate.param is None
    unknown = from_shard(shard_pb2.ShardEvent.Error(code=shard_pb2.SHARD_ERROR_CODE_INTERNAL, message="boom"))
    assert type(unknown) is RouterError and unknown.code == grpc.StatusCode.INTERNAL


@pytest.mark.parametrize("details, param", [
    ("messages[2]: unknown role 'wizard'", "messages"),
    ("tools[0]: malformed JSON: Expecting value", "tools"),
    ("text: 5,000 characters is over the limit of 10", "prompt"),
    ("TokenBytes takes at most 65536 ids, got 70000", None),
])
def test_a_tokenizer_refusal_names_the_request_field(details, param):
    error = from_tokenizer(grpc.StatusCode.INVALID_ARGUMENT, details)
    assert isinstance(error, InvalidArgument) and error.param == param
    assert str(error) == f"tokenizer service: {details}"


def test_a_broken_tokenizer_connection_is_unavailable_not_internal():
    """grpc's core reports a connection that broke under a call as INTERNAL "Internal error from Core"; the
    tokenizer's own INTERNAL (a bug there) stays INTERNAL."""
    broken = from_tokenizer(grpc.StatusCode.INTERNAL, "Internal error from Core", "DetokenizeStream")
    assert isinstance(broken, ShardUnavailable) and broken.code == grpc.StatusCode.UNAVAILABLE
    assert "DetokenizeStream ended with UNAVAILABLE" in str(broken)
    bug = from_tokenizer(grpc.StatusCode.INTERNAL, "internal error in Tokenize: KeyError: 3")
    assert bug.code == grpc.StatusCode.INTERNAL and not isinstance(bug, ShardUnavailable)
    assert isinstance(from_tokenizer(grpc.StatusCode.NOT_FOUND, "model 'x' is not served here"), NotFound)


def test_a_client_hears_a_named_error_but_never_a_bugs_text():
    assert refusal(NotFound("no batch b")) == (grpc.StatusCode.NOT_FOUND, "no batch b")
    code, message = refusal(KeyError("secret input"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message
