"""Metrics, health and reflection as operators meet them: a real scrape of each service after traffic."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.services.helpers import generate, scrape, total


@pytest.fixture(scope="module")
def after_traffic(stack):
    for i in range(4):
        generate(stack.stub, ids=[i + 1, 2, 3, 4], max_tokens=4, temperature=0.0, ignore_eos=True)
    return stack


ROUTER_SERIES = ["kimiserve_router_requests_total", "kimiserve_router_time_to_first_token_seconds_count",
                 "kimiserve_router_time_per_output_token_seconds_count", "kimiserve_router_request_duration_seconds_count",
                 "kimiserve_router_queue_seconds_count", "kimiserve_router_prompt_tokens_total",
                 "kimiserve_router_generation_tokens_total", "kimiserve_router_shard_healthy"]
SHARD_SERIES = ["kimiserve_shard_prefill_pass_seconds_count", "kimiserve_shard_decode_step_seconds_count",
                "kimiserve_shard_prefill_tokens_total", "kimiserve_shard_decode_tokens_total",
                "kimiserve_shard_state_slots_total", "kimiserve_shard_kv_blocks_total",
                "kimiserve_shard_sequences_finished_total"]


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


def test_tokenizer_metrics_after_traffic(after_traffic):
    series = scrape(after_traffic.children["tokenizer"].metrics_url)
    assert total(series, "kimiserve_tokenizer_requests_total") > 0


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
