"""/v1/files and /v1/batches with the openai SDK: upload, run, follow, download output and error files in OpenAI's
line shapes, list and cancel; backed by the router's batch store."""

from __future__ import annotations

import io
import json
import time

import openai
import pytest

LINES = [
    {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}},
    {"custom_id": "text-1", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}},
    {"custom_id": "bad-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 7.0}},
    {"custom_id": "resp-1", "method": "POST", "url": "/v1/responses",
     "body": {"input": "Hello", "instructions": "Be brief.", "max_output_tokens": 4, "temperature": 0}},
    {"custom_id": "bad-2", "method": "POST", "url": "/v1/responses", "body": {"input": "x", "reasoning": {}}},
]


def wait_terminal(client, batch_id: str, timeout: float = 120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not terminal after {timeout} s")


def test_files_and_batches_round_trip(http_stack):
    client = http_stack.client
    data = "".join(json.dumps(line) + "\n" for line in LINES).encode()
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    assert uploaded.bytes == len(data) and uploaded.filename == "in.jsonl" and uploaded.purpose == "batch"
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).content == data

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "http-test"})
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    assert batch.metadata == {"run": "http-test"}
    done = wait_terminal(client, batch.id)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2), \
        client.files.content(done.error_file_id).text
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]

    out = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in out}
    assert set(by_id) == {"chat-1", "text-1", "resp-1"}
    chat = by_id["chat-1"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion" and body["id"] == f"chatcmpl-{chat['response']['request_id']}"
    single = client.chat.completions.create(model="", **LINES[0]["body"])
    assert body["choices"][0]["message"]["content"] == single.choices[0].message.content  # the same flow
    assert body["usage"]["completion_tokens"] == single.usage.completion_tokens
    assert by_id["text-1"]["response"]["body"]["object"] == "text_completion"
    response = by_id["resp-1"]["response"]
    assert response["body"]["object"] == "response" and response["body"]["id"] == f"resp_{response['request_id']}"
    alone = client.responses.create(model="", **LINES[3]["body"])
    assert [item["content"][0]["text"] for item in response["body"]["output"]] == [alone.output_text]
    usage = response["body"]["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (alone.usage.input_tokens, alone.usage.output_tokens)
    assert response["body"]["instructions"] == "Be brief." and response["body"]["status"] == alone.status

    errors = {e["custom_id"]: e for e in map(json.loads, client.files.content(done.error_file_id).text.splitlines())}
    assert set(errors) == {"bad-1", "bad-2"}
    assert errors["bad-2"]["response"]["body"]["error"]["param"] == "reasoning"
    assert errors["bad-1"]["response"]["status_code"] == 400
    error = errors["bad-1"]["response"]["body"]["error"]
    assert "top_p" in error["message"] and error["param"] == "top_p"  # the same OpenAI body the HTTP API answers
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_argument"
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    with pytest.raises(openai.BadRequestError):  # a completed batch cannot be cancelled
        client.batches.cancel(batch.id)


def test_batch_refusals(http_stack):
    client = http_stack.client
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.txt", io.BytesIO(b"hello")), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_" + "0" * 32)
