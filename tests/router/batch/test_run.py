"""A batch over two real shards: every custom_id exactly once, results equal to the single requests, max_tokens=1 at
prefill, status timestamps and usage, paging, results while running, metrics."""

from __future__ import annotations

from kimiserve.v1 import common_pb2, router_pb2
from tests.router.batch.lines import assert_each_once, line, mixed_spec, run_singles, single_request, slow_lines
from tests.services.helpers import scrape, total, wait_until

N = 500


def test_500_requests_over_two_shards_equal_single_requests(router, backends):
    prefill_before = [total(scrape(u), "kimiserve_shard_prefill_tokens_total") for u in backends.shard_metrics]
    specs = [mixed_spec(i) for i in range(N)]
    ids = [f"req-{i:04d}" for i in range(N)]
    jsonl = "\n".join(line(cid, url, **body) for cid, (url, body) in zip(ids, specs))
    batch = router.create(jsonl, metadata={"suite": "batch"}, max_concurrency=64)
    assert batch.status == router_pb2.BATCH_STATUS_VALIDATING and batch.id.startswith("batch_")
    done = router.wait(batch.id, timeout=180)

    assert done.status == router_pb2.BATCH_STATUS_COMPLETED, done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (N, N, 0)
    assert dict(done.metadata) == {"suite": "batch"}
    assert (done.created_at_ms <= done.in_progress_at_ms <= done.finalizing_at_ms <= done.completed_at_ms)
    assert not done.HasField("failed_at_ms") and not done.HasField("cancelled_at_ms")

    # Before the single requests below, which also reach both shards.
    prefill_after = [total(scrape(u), "kimiserve_shard_prefill_tokens_total") for u in backends.shard_metrics]
    assert len(prefill_before) == 2 and all(a > b for a, b in zip(prefill_after, prefill_before, strict=True)), \
        f"both shards should have served the batch: prefill tokens {prefill_before} -> {prefill_after}"

    results = router.results(batch.id)
    assert_each_once(results, ids)
    by_id = {r.custom_id: r for r in results}
    assert done.usage.prompt_tokens == sum(r.response.usage.prompt_tokens for r in results)
    assert done.usage.completion_tokens == sum(r.response.usage.completion_tokens for r in results)

    singles = run_singles(router.address, [single_request(url, body) for url, body in specs])
    mismatched = [cid for cid, single in zip(ids, singles, strict=True) if by_id[cid].response != single]
    assert not mismatched, (f"{len(mismatched)} batch results differ from the single request, e.g. "
                            f"{mismatched[0]}: batch {by_id[mismatched[0]].response} single "
                            f"{singles[ids.index(mismatched[0])]}")
    for cid, (_, body) in zip(ids, specs, strict=True):
        r = by_id[cid].response
        assert r.usage.completion_tokens == len(r.token_ids) <= body["max_tokens"]
        if body["max_tokens"] == 1:
            assert r.finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)


def test_max_tokens_1_completes_at_prefill(router, backends):
    decode_before = [total(scrape(u), "kimiserve_shard_decode_tokens_total") for u in backends.shard_metrics]
    ids = [f"one-{i}" for i in range(40)]
    batch = router.create("\n".join(line(c, prompt=f"prefill only {i}", max_tokens=1, temperature=0, ignore_eos=True)
                                    for i, c in enumerate(ids)))
    done = router.wait(batch.id)
    assert done.status == router_pb2.BATCH_STATUS_COMPLETED and done.request_counts.completed == 40
    results = router.results(batch.id)
    assert_each_once(results, ids)
    for r in results:
        assert len(r.response.token_ids) == 1 and r.response.usage.completion_tokens == 1
        assert r.response.finish_reason == common_pb2.FINISH_REASON_LENGTH
    decode_after = [total(scrape(u), "kimiserve_shard_decode_tokens_total") for u in backends.shard_metrics]
    assert decode_after == decode_before, "max_tokens=1 requests must not take a decode step"


def test_results_are_streamed_while_the_batch_runs(router):
    ids = [f"s-{i}" for i in range(48)]
    batch = router.create(slow_lines(48, max_tokens=16), max_concurrency=4)
    router.wait(batch.id, until=lambda b: b.request_counts.completed >= 4)
    early = router.results(batch.id)
    assert 4 <= len(early) < 48, "results must be readable as they complete, before the batch ends"
    followed = router.results(batch.id, after_seq=2, follow=True)  # stays open until the batch is terminal
    assert router.get(batch.id).status == router_pb2.BATCH_STATUS_COMPLETED
    assert [r.seq for r in followed] == list(range(3, 49))
    assert_each_once(router.results(batch.id), ids)
    assert [r.SerializeToString() for r in followed[: len(early) - 2]] == \
        [r.SerializeToString() for r in early[2:]]


def test_inline_requests_and_paging(router):
    gen = router_pb2.GenerateRequest(text="inline", sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
    chat = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="user", content="hi")],
                                  sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
    created = []
    for i in range(3):
        created.append(router.create(inline=[router_pb2.BatchRequestItem(custom_id="g", generate=gen),
                                             router_pb2.BatchRequestItem(custom_id="c", chat=chat),
                                             router_pb2.BatchRequestItem(custom_id="empty")]).id)
    for batch_id in created:
        done = router.wait(batch_id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == (
            router_pb2.BATCH_STATUS_COMPLETED, 2, 1)
    errors = {r.custom_id: r.error.code for r in router.results(created[0]) if r.HasField("error")}
    assert errors == {"empty": "invalid_request"}

    seen, token = [], ""
    while True:
        page = router.stub.ListBatches(router_pb2.ListBatchesRequest(page_size=2, page_token=token), timeout=30)
        assert len(page.batches) <= 2
        seen += [b.id for b in page.batches]
        token = page.next_page_token
        if not token:
            break
    assert seen[:3] == created[::-1], "newest first"
    assert len(seen) == len(set(seen))


def test_metrics_count_one_batch(router):
    """Before/after deltas around one batch of its own: earlier tests' batches raised the same counters."""
    in_progress, completed = (f'kimiserve_router_batches{{status="{s}"}}' for s in ("in_progress", "completed"))
    ok = 'kimiserve_router_batch_requests_total{code="ok",outcome="completed"}'
    # gauges are refreshed by the runner's tick
    wait_until(lambda: scrape(router.metrics_url).get(in_progress, 0) == 0, 30, "earlier batches to finish")
    before = scrape(router.metrics_url)
    jsonl = "\n".join(line(f"m-{i}", url, **body) for i, (url, body) in enumerate(map(mixed_spec, range(4))))
    done = router.wait(router.create(jsonl).id, timeout=60)
    assert done.status == router_pb2.BATCH_STATUS_COMPLETED and done.request_counts.completed == 4, done

    def delta(series: dict[str, float], key: str) -> float:
        return total(series, key) - total(before, key)

    wait_until(lambda: delta(scrape(router.metrics_url), completed) == 1, 10, "the batch counted as completed")
    after = scrape(router.metrics_url)
    assert delta(after, completed) == 1 and after[in_progress] == 0
    assert delta(after, ok) == 4 and delta(after, "kimiserve_router_batch_requests_total") == 4
    assert delta(after, "kimiserve_router_batch_generation_tokens_total") == done.usage.completion_tokens > 0
    assert delta(after, "kimiserve_router_batch_prompt_tokens_total") == done.usage.prompt_tokens > 0
    assert after["kimiserve_router_batch_throughput_tokens_per_second"] > 0
    assert after["kimiserve_router_batch_queue_depth"] == 0
    assert "kimiserve_router_batch_running_requests" in after
