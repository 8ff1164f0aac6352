"""/v1/files with the openai SDK: list (purpose filter, limit, after, order), retrieve, content and delete, over the
router's durable batch store; deleting is refused while a batch created from the file has not ended, and for a
batch's own output files."""

from __future__ import annotations

import io
import json
import secrets

import openai
import pytest

from tests.router.http.test_batches import wait_terminal


def upload(client, name: str, lines: list[dict] | None = None):
    lines = lines or [{"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": name, "max_tokens": 1}}]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=(name, io.BytesIO(data)), purpose="batch"), data


def test_list_pages_through_uploads_newest_first(http_stack):
    client = http_stack.client
    tag = secrets.token_hex(3)
    ids = [upload(client, f"list-{tag}-{i}.jsonl")[0].id for i in range(3)]

    newest = client.files.list(limit=2)  # default order: newest first
    assert [f.id for f in newest.data] == ids[::-1][:2] and newest.has_more
    assert newest.data[0].object == "file" and newest.data[0].purpose == "batch"
    assert newest.data[0].status == "processed" and newest.data[0].filename == f"list-{tag}-2.jsonl"
    rest = client.files.list(limit=2, after=newest.data[-1].id)
    assert rest.data[0].id == ids[0]
    # The SDK's auto-pagination follows `after` / has_more: every file, each once.
    every = [f.id for f in client.files.list(limit=1)]
    assert len(every) == len(set(every)) and set(ids) <= set(every)

    oldest_first = [f.id for f in client.files.list(order="asc", purpose="batch")]
    assert [i for i in oldest_first if i in ids] == ids
    assert client.files.list(purpose="fine-tune").data == []  # only batch files are ever uploaded here


def test_list_refusals(http_stack):
    client = http_stack.client
    with pytest.raises(openai.BadRequestError, match="output_file_id"):
        client.files.list(purpose="batch_output")  # not listed: refused rather than an empty list
    with pytest.raises(openai.BadRequestError, match="after") as refused:  # a cursor, not a file looked up
        client.files.list(after="file-nope")
    assert refused.value.param == "after"
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.files.list(limit=0)
    with pytest.raises(openai.BadRequestError, match="order"):
        client.files.list(extra_query={"order": "sideways"})


def test_retrieve_content_and_delete(http_stack):
    client = http_stack.client
    f, data = upload(client, "delete-me.jsonl")
    got = client.files.retrieve(f.id)
    assert (got.id, got.bytes, got.filename, got.purpose) == (f.id, len(data), "delete-me.jsonl", "batch")
    assert client.files.content(f.id).content == data

    deleted = client.files.delete(f.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (f.id, "file", True)
    assert f.id not in [x.id for x in client.files.list()]
    for call in (client.files.retrieve, client.files.content, client.files.delete):
        with pytest.raises(openai.NotFoundError, match=f.id):
            call(f.id)


def test_a_file_is_kept_while_its_batch_runs(http_stack):
    client = http_stack.client
    lines = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": f"story {i}", "max_tokens": 200, "ignore_eos": True}} for i in range(4)]
    f, _ = upload(client, "long.jsonl", lines)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.delete(f.id)  # the batch has 800 tokens to generate: it is still running
    error = refused.value.body
    assert error["code"] == "failed_precondition" and batch.id in error["message"], error
    assert client.files.retrieve(f.id).id == f.id  # still there

    client.batches.cancel(batch.id)
    assert wait_terminal(client, batch.id).status == "cancelled"
    assert client.files.delete(f.id).deleted
    assert client.batches.retrieve(batch.id).input_file_id == f.id  # the batch's record still names its input


def test_a_batchs_output_file_is_not_deleted_alone(http_stack):
    client = http_stack.client
    f, _ = upload(client, "short.jsonl")
    batch = wait_terminal(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                        completion_window="24h").id)
    assert batch.status == "completed" and batch.output_file_id
    with pytest.raises(openai.BadRequestError, match="lasts as long as the batch"):
        client.files.delete(batch.output_file_id)
    assert client.files.content(batch.output_file_id).text  # untouched
    with pytest.raises(openai.NotFoundError):
        client.files.delete(f"file-batch_{'0' * 32}-output")
