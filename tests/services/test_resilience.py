"""A shard that dies mid-stream loses no stream: the router fails its streams over to the other shard, and they
finish whole with exact usage; the router takes the shard back once it is healthy."""

from __future__ import annotations

import signal
import threading

import grpc

from kimiserve.v1 import common_pb2, router_pb2
from launcher.health import wait_serving
from tests.services.helpers import generate, scrape, shard_load, total, wait_until

TOKENS = 400


def test_killed_shard_fails_its_streams_over_and_comes_back(private_stack):
    stack = private_stack
    outcomes: dict[int, object] = {}
    started = threading.Barrier(7)

    def one(i: int) -> None:
        req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                            ignore_eos=True))
        req.prompt_token_ids.ids.extend([i + 1] * (4 + i))
        ids = []
        try:
            stream = stack.stub.Generate(req, timeout=180)
            first = next(stream)
            ids.extend(first.token_ids)
            started.wait(60)
            last = first
            for chunk in stream:
                ids.extend(chunk.token_ids)
                last = chunk
            outcomes[i] = ("done", len(ids), last.usage.completion_tokens)
        except grpc.RpcError as e:
            outcomes[i] = ("error", e.code(), e.details())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    [t.start() for t in threads]
    started.wait(120)  # every request has its first token, so each sits on a shard
    # the shard running the most of them (on a loaded machine the first streams can be done before the last starts)
    running = {i: shard_load(stack.shard(i).address).running_seqs for i in (0, 1)}
    victim = stack.shard(max(running, key=running.get))
    assert max(running.values()) > 0, f"the test needs work on the shard it kills: {running}"
    victim.proc.send_signal(signal.SIGKILL)
    [t.join(180) for t in threads]

    assert len(outcomes) == 6 and all(o == ("done", TOKENS, TOKENS) for o in outcomes.values()), outcomes
    router_metrics = stack.children["router"].metrics_url
    assert total(scrape(router_metrics), "kimiserve_router_failovers_total") >= 1

    # Still serving on the surviving shard.
    ids, _, last = generate(stack.stub, ids=[9, 9, 9], max_tokens=3, temperature=0.0, ignore_eos=True)
    assert last.usage.completion_tokens == 3

    victim.restart()
    wait_serving(victim.address, 120, alive=lambda: victim.proc.poll() is None)
    wait_until(lambda: scrape(router_metrics).get(
        f'kimiserve_router_shard_healthy{{shard="{victim.address}"}}') == 1.0, 30, "the router to take it back")

    results = []
    threads = [threading.Thread(target=lambda: results.append(
        generate(stack.stub, ids=[2, 3], max_tokens=2, temperature=0.0, ignore_eos=True))) for _ in range(6)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert len(results) == 6
    prefilled = scrape(victim.metrics_url)
    assert any(k.startswith("kimiserve_shard_prefill_tokens_total") and v > 0 for k, v in prefilled.items()), \
        "the restarted shard received no work"
