"""Issue 13's defects that one request could cause, each reproduced against real processes (tokenizer, two shards,
router): an overflowing temperature, a duplicate live request id, a forged batch request id, a request id that
cannot travel in metadata, a context the KV cache cannot hold, and gauges left stale by a cancel."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from launcher.up import start_stack, stop_stack

# The KV cache (16 blocks x 16 tokens) is smaller than the model's context: it must be what is advertised.
KV_TOKENS = 256
SHARD_ARGS = ("--num-state-slots", "4", "--num-kv-blocks", "16", "--kv-block-size", "16")


@pytest.fixture(scope="module")
def stack(tiny_linear, tmp_path_factory):
    db = tmp_path_factory.mktemp("defects-db") / "batches.sqlite"
    children = start_stack(tiny_linear, 2, "cpu", "127.0.0.1", free_port(), timeout=180, shard_args=SHARD_ARGS,
                           router_args=("--batch-db", str(db)))
    channel = grpc.insecure_channel(children[-1].address)
    yield router_pb2_grpc.RouterStub(channel), children
    channel.close()
    stop_stack(children, grace_s=20)


def _gen(stub, request_id=None, max_tokens=4, **sampling):
    req = router_pb2.GenerateRequest(prompt_token_ids=common_pb2.TokenIds(ids=[5, 6, 7, 8]),
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                        **sampling))
    if request_id is not None:
        req.request_id = request_id
    return stub.Generate(req, timeout=120)


def _drain(stream) -> tuple[list[int], router_pb2.GenerateResponse]:
    tokens, last = [], None
    for last in stream:
        tokens.extend(last.token_ids)
    return tokens, last


def _refused(stream) -> tuple[grpc.StatusCode, str, int]:
    """(code, details, chunks received before the error)."""
    received = 0
    try:
        for _ in stream:
            received += 1
    except grpc.RpcError as e:
        return e.code(), e.details(), received
    pytest.fail(f"the request was not refused ({received} chunks received)")


def _serves(stub) -> None:
    tokens, last = _drain(_gen(stub))
    assert len(tokens) == 4 and last.usage.completion_tokens == 4


def _shard_gauge(children, name: str) -> float:
    total = 0.0
    for child in children:
        if not child.name.startswith("shard-"):
            continue
        with urllib.request.urlopen(child.metrics_url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def test_overflowing_temperature_samples_the_argmax_and_the_shard_keeps_serving(stack):
    stub, _ = stack
    greedy, _ = _drain(_gen(stub, max_tokens=8, temperature=0.0))
    for _ in range(3):  # both shards see one
        tiny, last = _drain(_gen(stub, max_tokens=8, temperature=1e-45, seed=3))
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert tiny == greedy
    _serves(stub)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 1e9, -1.0])
def test_temperature_out_of_range_is_invalid_argument(stack, temperature):
    stub, _ = stack
    code, details, received = _refused(_gen(stub, temperature=temperature))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in details and received == 0
    _serves(stub)


def test_duplicate_live_request_id_is_refused_before_any_token_and_the_first_stream_is_untouched(stack):
    stub, _ = stack
    long = KV_TOKENS - 8  # as long as the cache allows: still live when the second arrives on a loaded machine
    first = _gen(stub, request_id="dup-1", max_tokens=long)
    it = iter(first)
    head = next(it)  # the first request is live and streaming
    results: dict = {}

    def second():
        results["second"] = _refused(_gen(stub, request_id="dup-1", max_tokens=4))

    t = threading.Thread(target=second)
    t.start()
    tokens, last = list(head.token_ids), head
    for last in it:
        tokens.extend(last.token_ids)
    t.join(60)
    code, details, received = results["second"]
    assert code == grpc.StatusCode.ALREADY_EXISTS and "dup-1" in details and received == 0
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert len(tokens) == long and last.usage.completion_tokens == long
    again, _ = _drain(_gen(stub, request_id="dup-1"))  # free again once finished
    assert len(again) == 4


def test_a_batch_request_id_cannot_be_forged_and_the_batch_completes(stack):
    stub, _ = stack
    items = [router_pb2.BatchRequestItem(custom_id=f"line-{i}", generate=router_pb2.GenerateRequest(
        prompt_token_ids=common_pb2.TokenIds(ids=[3, 4, 5]),
        sampling=common_pb2.SamplingParams(max_tokens=30, ignore_eos=True))) for i in range(3)]
    batch = stub.CreateBatch(router_pb2.CreateBatchRequest(inline=router_pb2.BatchInlineRequests(requests=items)))
    for i in range(3):
        for attempt in (1, 2):
            code, details, received = _refused(_gen(stub, request_id=f"{batch.id}:line-{i}:{attempt}"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in details and received == 0
    deadline = time.monotonic() + 120
    while True:
        got = stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch.id))
        if got.status == router_pb2.BATCH_STATUS_COMPLETED or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got.status == router_pb2.BATCH_STATUS_COMPLETED
    assert got.request_counts.completed == 3 and got.usage.completion_tokens == 90


@pytest.mark.parametrize("request_id", ["tab\there", "newline\n", "nul\x00", "é-non-ascii", "x" * 257])
def test_request_id_that_cannot_travel_is_invalid_before_generation(stack, request_id):
    stub, _ = stack
    code, details, received = _refused(_gen(stub, request_id=request_id))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "request id" in details and received == 0
    _serves(stub)


def test_advertised_context_is_what_the_kv_cache_holds_and_a_longer_prompt_names_both(stack):
    stub, _ = stack
    card = stub.ListModels(router_pb2.ListModelsRequest()).models[0]
    assert card.max_context_tokens == KV_TOKENS
    prompt = common_pb2.TokenIds(ids=[5] * (KV_TOKENS + 10))
    code, details, received = _refused(stub.Generate(router_pb2.GenerateRequest(prompt_token_ids=prompt),
                                                     timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and received == 0
    assert str(KV_TOKENS + 10) in details and str(KV_TOKENS) in details
    _serves(stub)


def test_slot_and_block_gauges_return_to_zero_right_after_a_cancel(stack):
    stub, children = stack
    stream = _gen(stub, max_tokens=200)
    next(iter(stream))
    stream.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (_shard_gauge(children, "kimiserve_shard_state_slots_used")
                                           or _shard_gauge(children, "kimiserve_shard_kv_blocks_used")):
        time.sleep(0.05)
    assert _shard_gauge(children, "kimiserve_shard_state_slots_used") == 0
    assert _shard_gauge(children, "kimiserve_shard_kv_blocks_used") == 0
