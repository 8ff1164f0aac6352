"""Metrics, health and reflection as operators meet them: a real scrape of each service after traffic, and the
per-request and prefill series moving by exactly what a known set of requests did."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.services.helpers import generate, scrape, shard_load, total, wait_until


@pytest.fixture(scope="module")
def after_traffic(stack):
    for i in range(4):
        generate(stack.stub, ids=[i + 1, 2, 3, 4], max_tokens=4, temperature=0.0, ignore_eos=True)
    return stack


ROUTER_SERIES = ["kimiserve_router_requests_total", "kimiserve_router_time_to_first_token_seconds_count",
                 "kimiserve_router_time_per_output_token_seconds_count",
                 "kimiserve_router_request_duration_seconds_count",
                 "kimiserve_router_queue_seconds_count", "kimiserve_router_prompt_tokens_total",
                 "kimiserve_router_generation_tokens_total", "kimiserve_router_shard_healthy",
                 "kimiserve_router_prefill_seconds_count", "kimiserve_router_inter_token_latency_seconds_count",
                 "kimiserve_router_request_prompt_tokens_count", "kimiserve_router_request_generation_tokens_count",
                 "kimiserve_router_finished_requests_total"]
SHARD_SERIES = ["kimiserve_shard_prefill_pass_seconds_count", "kimiserve_shard_decode_step_seconds_count",
                "kimiserve_shard_prefill_tokens_total", "kimiserve_shard_decode_tokens_total",
                "kimiserve_shard_state_slots_total", "kimiserve_shard_kv_blocks_total",
                "kimiserve_shard_sequences_finished_total", "kimiserve_shard_prefill_pass_sequences_count",
                "kimiserve_shard_prefill_pass_tokens_count", "kimiserve_shard_prefill_pass_chunks_count",
                "kimiserve_shard_prefill_pass_max_chunk_tokens_count", "kimiserve_shard_request_queue_seconds_count",
                "kimiserve_shard_request_prefill_seconds_count", "kimiserve_shard_time_to_first_token_seconds_count",
                "kimiserve_shard_time_per_output_token_seconds_count", "kimiserve_shard_request_duration_seconds_count",
                "kimiserve_shard_request_prompt_tokens_count", "kimiserve_shard_request_generation_tokens_count"]


def test_router_metrics_after_traffic(after_traffic):
    series = scrape(after_traffic.children["router"].metrics_url)
    for name in ROUTER_SERIES:
        assert total(series, name) > 0, f"{name} missing or zero"
    assert series.get('kimiserve_router_requests_total{method="Generate",status="OK"}', 0) >= 4
    for i in (0, 1):
        assert series[f'kimiserve_router_shard_healthy{{shard="{after_traffic.shard(i).address}"}}'] == 1


def test_shard_metrics_after_traffic_are_labelled(after_traffic):
    for i in (0, 1):
        series = scrape(after_traffic.shard(i).metrics_url)
        for name in SHARD_SERIES:
            assert total(series, name) > 0, f"shard-{i}: {name} missing or zero"
        labelled = [k for k in series if k.startswith("kimiserve_shard_prefill_pass_seconds_count")]
        assert labelled == [f'kimiserve_shard_prefill_pass_seconds_count{{rank="0",shard="shard-{i}"}}']
        assert series[f'kimiserve_shard_state_slots_total{{rank="0",shard="shard-{i}"}}'] == 8


def test_per_request_and_prefill_series_move_by_what_the_requests_did(stack):
    """Four requests of known prompt and output lengths (prompts new to the prefix cache, so every prompt token is
    prefilled): every per-request histogram counts each request once, the length histograms sum to their lengths,
    the prefill pass series add up to the prompt tokens, and the finish-reason counter moves by four."""
    urls = [stack.children["router"].metrics_url] + [stack.shard(i).metrics_url for i in (0, 1)]
    before = [scrape(u) for u in urls]
    salt = 50 + secrets.randbelow(150)
    work = [([salt + 7 * i + k for k in range(5 + 4 * i)], 3 + i) for i in range(4)]  # (prompt ids, max_tokens)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda w: generate(stack.stub, ids=w[0], max_tokens=w[1], temperature=0.0,
                                                ignore_eos=True), work))
    assert [len(ids) for ids, _, _ in outs] == [n for _, n in work]
    after = [scrape(u) for u in urls]

    def moved(metric: str, which=(0,)) -> float:
        return sum(total(after[i], metric) - total(before[i], metric) for i in which)

    prompt, generated, n = sum(len(p) for p, _ in work), sum(m for _, m in work), len(work)
    router, shards = (0,), (1, 2)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "request_duration_seconds",
                 "queue_seconds", "prefill_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert moved(f"kimiserve_router_{name}_count", router) == n, name
    assert moved("kimiserve_router_inter_token_latency_seconds_count", router) == generated - n
    assert moved("kimiserve_router_request_prompt_tokens_sum", router) == prompt
    assert moved("kimiserve_router_request_generation_tokens_sum", router) == generated
    key = 'kimiserve_router_finished_requests_total{finish_reason="length",method="Generate"}'
    assert after[0][key] - before[0].get(key, 0) == n
    for name in ("request_queue_seconds", "request_wait_seconds", "request_prefill_seconds",
                 "time_to_first_token_seconds",
                 "time_per_output_token_seconds", "request_duration_seconds", "request_prompt_tokens"):
        assert moved(f"kimiserve_shard_{name}_count", shards) == n, name
    assert moved("kimiserve_shard_request_prompt_tokens_sum", shards) == prompt
    assert moved("kimiserve_shard_request_generation_tokens_sum", shards) == generated
    assert moved("kimiserve_shard_prefill_pass_tokens_sum", shards) == prompt
    assert moved("kimiserve_shard_prefill_tokens_total", shards) == prompt
    passes = moved("kimiserve_shard_prefill_pass_seconds_count", shards)
    assert 1 <= passes <= n and moved("kimiserve_shard_prefill_pass_chunks_sum", shards) == passes
    assert moved("kimiserve_shard_prefill_pass_sequences_sum", shards) == n  # each prompt fits one pass
    assert moved("kimiserve_shard_prefill_pass_max_chunk_tokens_sum", shards) == prompt  # one chunk per pass


def test_tokenizer_metrics_count_a_text_request(stack):
    """A delta around one text Generate (the router tokenizes it once): the counter is shared with earlier tests."""
    url, key = stack.children["tokenizer"].metrics_url, 'kimiserve_tokenizer_requests_total{code="OK",rpc="Tokenize"}'
    before = scrape(url).get(key, 0)
    generate(stack.stub, text="count this text once", max_tokens=2, temperature=0.0)
    assert scrape(url)[key] - before == 1


def test_requests_the_client_ends_are_counted_once_by_status(stack):
    """A stream the client cancels after its first chunk counts as CANCELLED, one cut by its deadline as
    DEADLINE_EXCEEDED (Generate and Chat alike), each exactly once, in the same series as OK and the error statuses;
    the shards get their sequences back."""
    from kimiserve.v1 import common_pb2, router_pb2

    url = stack.children["router"].metrics_url
    key = 'kimiserve_router_requests_total{{method="{}",status="{}"}}'
    outcomes = [("Generate", "CANCELLED"), ("Chat", "CANCELLED"), ("Generate", "DEADLINE_EXCEEDED")]
    before = scrape(url)
    long = common_pb2.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # minutes of decoding
    generate_req = router_pb2.GenerateRequest(sampling=long)
    generate_req.prompt_token_ids.ids.extend([5, 6, 7, 8])
    chat_req = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="Hello")], sampling=long)
    for call in (stack.stub.Generate(generate_req, timeout=120), stack.stub.Chat(chat_req, timeout=120)):
        next(call)  # the request is running on a shard
        call.cancel()
    with pytest.raises(grpc.RpcError) as cut:
        for _ in stack.stub.Generate(generate_req, timeout=1.0):
            pass
    assert cut.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def moved(after, method, status):
        return after.get(key.format(method, status), 0) - before.get(key.format(method, status), 0)

    wait_until(lambda: all(moved(scrape(url), m, st) >= 1 for m, st in outcomes), what="the ended requests counted")
    after = scrape(url)
    assert [moved(after, m, st) for m, st in outcomes] == [1, 1, 1]
    assert moved(after, "Generate", "OK") == 0 and moved(after, "Chat", "OK") == 0
    def idle(address: str) -> bool:
        load = shard_load(address)
        return load.running_seqs + load.queued_seqs == 0

    wait_until(lambda: idle(stack.shard(0).address) and idle(stack.shard(1).address),
               what="the shards to drop the ended sequences")


@pytest.mark.parametrize("service", ["router", "shard-0", "tokenizer"])
def test_health_and_reflection(stack, service):
    address = stack.children[service].address
    with grpc.insecure_channel(address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    expected = {"router": "kimiserve.v1.Router", "shard-0": "kimiserve.v1.Shard", "tokenizer": "kimiserve.v1.Tokenizer"}
    assert {expected[service], "grpc.health.v1.Health"} <= names
