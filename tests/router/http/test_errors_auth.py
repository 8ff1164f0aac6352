"""Errors in OpenAI's shape with the mapped HTTP statuses, API keys, and the endpoints beside the completions."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.http.conftest import API_KEY, MAX_BODY

HELLO = [{"role": "user", "content": "Hello"}]


def post(http_stack, path: str, body, key: str | None = API_KEY, headers: dict = {}) -> httpx.Response:
    auth = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(http_stack.base + path, json=body, headers={**auth, **headers}, timeout=60)


def assert_error(resp: httpx.Response, status: int, code: str, param=None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and error["param"] == param and error["message"]
    return error


def test_api_key_is_required_except_for_health(http_stack):
    for key in (None, "wrong-key"):
        error = assert_error(post(http_stack, "/v1/chat/completions", {"messages": HELLO}, key=key), 401,
                             "invalid_api_key")
        assert error["type"] == "authentication_error" and "wrong-key" not in error["message"]
    bad = openai.OpenAI(base_url=http_stack.base + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    health = httpx.get(http_stack.base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("body, code, param, fragment", [
    ({"messages": HELLO, "temperature": "hot"}, "invalid_argument", "temperature", "temperature must be a number"),
    ({"messages": HELLO, "top_p": 5.0}, "invalid_argument", "top_p", "top_p must be in (0, 1]"),
    ({"messages": HELLO, "min_p": 1.5}, "invalid_argument", "min_p", "min_p must be in [0, 1]"),
    ({"messages": HELLO, "min_p": "high"}, "invalid_argument", "min_p", "min_p must be a number"),
    ({"messages": HELLO, "max_tokens": 0}, "invalid_argument", "max_tokens", "max_tokens must be >= 1"),
    ({"messages": HELLO, "logit_bias": {"1": 101}}, "invalid_argument", "logit_bias", "must be in [-100, 100]"),
    ({"messages": HELLO, "logit_bias": {"one": 5}}, "invalid_argument", "logit_bias", "keys must be token ids"),
    ({"messages": HELLO, "logit_bias": {"5000": 5}}, "invalid_argument", "logit_bias", "outside [0, vocab size"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "invalid_argument", "top_logprobs", "[0, 20]"),
    ({"messages": HELLO, "presence_penalty": 2.5}, "invalid_argument", "presence_penalty", "presence_penalty"),
    ({"messages": HELLO, "response_format": {"type": "xml"}}, "invalid_argument", "response_format", "json_schema"),
    ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "array", "uniqueItems": True}}}}, "invalid_argument", "response_format", "uniqueItems"),
    ({"messages": HELLO, "n": 99}, "invalid_argument", "n", "n must be an integer in [1, 16]"),
    ({"messages": []}, "invalid_argument", "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_argument", "messages", "wizard"),
])
def test_bad_parameters_are_400(http_stack, body, code, param, fragment):
    error = assert_error(post(http_stack, "/v1/chat/completions", body), 400, code, param)
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_streamed_bad_request_is_an_http_error_not_a_stream(http_stack):
    assert_error(post(http_stack, "/v1/chat/completions", {"messages": HELLO, "stream": True, "top_p": 5.0}), 400,
                 "invalid_argument", "top_p")


def test_unknown_model_route_and_file_are_404(http_stack):
    error = assert_error(post(http_stack, "/v1/chat/completions", {"model": "gpt-9", "messages": HELLO}), 404,
                         "not_found")
    assert "'gpt-9'" in error["message"] and repr(http_stack.model) in error["message"]
    assert_error(post(http_stack, "/v1/embeddings", {"input": "x"}), 404, "not_found")
    with pytest.raises(openai.NotFoundError):
        http_stack.client.files.retrieve("file-does-not-exist")


def test_body_over_the_limit_is_413(http_stack):
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    assert_error(post(http_stack, "/v1/chat/completions", big), 413, "request_too_large")
    chunked = httpx.post(http_stack.base + "/v1/completions", headers={"authorization": f"Bearer {API_KEY}"},
                         content=iter([b'{"prompt": "', b"x" * MAX_BODY, b'"}']), timeout=60)
    assert_error(chunked, 413, "request_too_large")


def test_not_json_and_bad_request_id_are_400(http_stack):
    resp = httpx.post(http_stack.base + "/v1/completions", content=b"{nope", timeout=10,
                      headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"})
    assert_error(resp, 400, "invalid_json")
    resp = post(http_stack, "/v1/completions", {"prompt": "x"}, headers={"x-request-id": "batch_" + "0" * 32 + ":a"})
    assert_error(resp, 400, "invalid_argument", "X-Request-Id")


def test_models_report_the_served_context(http_stack):
    models = http_stack.client.models.list().data
    assert [m.id for m in models] == [http_stack.model]
    assert models[0].max_model_len == 512  # the shard's --max-model-len, what the deployment really serves
    assert http_stack.client.models.retrieve(http_stack.model).id == http_stack.model
    with pytest.raises(openai.NotFoundError):
        http_stack.client.models.retrieve("other")
