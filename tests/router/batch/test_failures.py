"""Failures: an unusable input fails the batch with the reason; a bad request fails alone with an error result;
cancel and expiry close a running batch with exactly one result per custom_id and free the shards."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from kimiserve.v1 import router_pb2, shard_pb2, shard_pb2_grpc
from tests.router.batch.lines import CHAT, assert_each_once, line, slow_lines


def shards_idle(backends) -> bool:
    for address in backends.shards:
        with grpc.insecure_channel(address) as ch:
            load = shard_pb2_grpc.ShardStub(ch).Load(shard_pb2.ShardLoadRequest(), timeout=10)
        if load.running_seqs or load.queued_seqs:
            return False
    return True


def wait_idle(backends, timeout=20):
    end = time.monotonic() + timeout
    while not shards_idle(backends):
        assert time.monotonic() < end, "shards still busy: cancelled requests were not cancelled on the shards"
        time.sleep(0.1)


@pytest.mark.parametrize("jsonl, code, line_no, fragment", [
    (line("a", prompt="x") + "\n{\"custom_id\": \"b\", oops}\n" + line("c", prompt="y"), "invalid_json", 2,
     "line 2 is not valid JSON"),
    (line("a", prompt="x") + "\n" + line("b", prompt="y") + "\n" + line("a", prompt="z"), "duplicate_custom_id", 3,
     "custom_id 'a' on line 3 was already used on line 1"),
    (json.dumps({"url": "/v1/completions", "body": {"prompt": "x"}}), "missing_custom_id", 1, "no custom_id"),
    ("\n\n", "empty_input", 0, "no requests"),
])
def test_unusable_input_fails_the_batch_with_the_reason(router, jsonl, code, line_no, fragment):
    batch = router.create(jsonl)
    done = router.wait(batch.id)
    assert done.status == router_pb2.BATCH_STATUS_FAILED
    assert done.HasField("failed_at_ms") and not done.HasField("in_progress_at_ms")
    assert [(e.code, e.line) for e in done.errors] == [(code, line_no)]
    assert fragment in done.errors[0].message
    assert done.request_counts.total == 0 and router.results(batch.id) == []


def test_bad_requests_fail_alone(router):
    too_long = list(range(5, 305))  # 300 prompt tokens; the shards' context is 256
    jsonl = "\n".join([
        line("good-1", prompt="fine", max_tokens=3, temperature=0),
        line("unknown-url", "/v1/embeddings", input="x"),
        line("too-long", prompt=too_long, max_tokens=2),
        line("bad-temperature", prompt="x", temperature=-1.0),
        line("zero-max-tokens", prompt="x", max_tokens=0),
        line("bad-role", CHAT, messages=[{"role": "wizard", "content": "abracadabra"}], max_tokens=2),
        line("bad-type", prompt="x", max_tokens="many"),
        line("unknown-model", model="gpt-9", prompt="x", max_tokens=2),
        line("good-2", CHAT, messages=[{"role": "user", "content": "hello"}], max_tokens=3, temperature=0),
    ])
    batch = router.create(jsonl)
    done = router.wait(batch.id)
    assert done.status == router_pb2.BATCH_STATUS_COMPLETED, done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (9, 2, 7)
    results = router.results(batch.id)
    assert_each_once(results, ["good-1", "unknown-url", "too-long", "bad-temperature", "zero-max-tokens",
                               "bad-role", "bad-type", "unknown-model", "good-2"])
    errors = {r.custom_id: (r.error.code, r.error.message) for r in results if r.HasField("error")}
    expected = {
        "unknown-url": ("invalid_request", "unknown url '/v1/embeddings'"),
        "too-long": ("invalid_argument", "prompt of 300 tokens leaves no room"),
        "bad-temperature": ("invalid_argument", "temperature must be in [0,"),
        "zero-max-tokens": ("invalid_request", "max_tokens 0 generates nothing"),  # a completions body: parse-time
        "bad-role": ("invalid_argument", "unknown role 'wizard'"),
        "bad-type": ("invalid_request", "max_tokens must be an integer"),
        "unknown-model": ("not_found", "model 'gpt-9' is not served"),
    }
    assert errors.keys() == expected.keys()
    for custom_id, (code, fragment) in expected.items():
        assert errors[custom_id][0] == code and fragment in errors[custom_id][1], (custom_id, errors[custom_id])
    ok = {r.custom_id for r in results if r.HasField("response")}
    assert ok == {"good-1", "good-2"}


def test_create_refuses_unusable_requests_and_unknown_ids(router):
    with pytest.raises(grpc.RpcError) as e:
        router.stub.CreateBatch(router_pb2.CreateBatchRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "inline or jsonl" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        router.create(line("a", prompt="x"), completion_window_s=30 * 86_400)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for call, req in ((router.stub.GetBatch, router_pb2.GetBatchRequest(batch_id="batch_nope")),
                      (router.stub.CancelBatch, router_pb2.CancelBatchRequest(batch_id="batch_nope"))):
        with pytest.raises(grpc.RpcError) as e:
            call(req, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "batch_nope" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        router.results("batch_nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancel_mid_batch(router, backends):
    ids = [f"s-{i}" for i in range(120)]
    batch = router.create(slow_lines(120, max_tokens=24), max_concurrency=8)
    router.wait(batch.id, until=lambda b: b.request_counts.completed >= 10)
    cancelling = router.stub.CancelBatch(router_pb2.CancelBatchRequest(batch_id=batch.id), timeout=30)
    assert cancelling.status in (router_pb2.BATCH_STATUS_CANCELLING, router_pb2.BATCH_STATUS_CANCELLED)
    done = router.wait(batch.id)
    assert done.status == router_pb2.BATCH_STATUS_CANCELLED
    assert done.HasField("cancelling_at_ms") and done.cancelled_at_ms >= done.cancelling_at_ms
    counts = done.request_counts
    assert counts.completed >= 10 and counts.completed + counts.failed == counts.total == 120 and counts.failed > 0
    results = router.results(batch.id)
    assert_each_once(results, ids)
    assert sum(r.HasField("response") for r in results) == counts.completed
    assert {r.error.code for r in results if r.HasField("error")} == {"batch_cancelled"}
    assert all(len(r.response.token_ids) == 24 for r in results if r.HasField("response"))
    wait_idle(backends)
    again = router.stub.CancelBatch(router_pb2.CancelBatchRequest(batch_id=batch.id), timeout=10)
    assert again.status == router_pb2.BATCH_STATUS_CANCELLED  # idempotent


def test_cancel_a_completed_batch_is_refused(router):
    batch = router.create(line("a", prompt="x", max_tokens=1))
    assert router.wait(batch.id).status == router_pb2.BATCH_STATUS_COMPLETED
    with pytest.raises(grpc.RpcError) as e:
        router.stub.CancelBatch(router_pb2.CancelBatchRequest(batch_id=batch.id), timeout=10)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "completed" in e.value.details()


def test_expiry_with_a_short_window(router, backends):
    ids = [f"s-{i}" for i in range(200)]
    batch = router.create(slow_lines(200, max_tokens=48), max_concurrency=4, completion_window_s=2)
    assert batch.expires_at_ms == batch.created_at_ms + 2000
    done = router.wait(batch.id, timeout=60)
    assert done.status == router_pb2.BATCH_STATUS_EXPIRED
    assert done.expired_at_ms >= done.expires_at_ms and not done.HasField("completed_at_ms")
    results = router.results(batch.id)
    assert_each_once(results, ids)
    codes = {r.error.code for r in results if r.HasField("error")}
    assert codes == {"batch_expired"} and done.request_counts.failed > 0
    assert done.request_counts.completed == sum(r.HasField("response") for r in results)
    wait_idle(backends)
