"""Interactive first: an interactive request sent while batch requests wait for admission is admitted ahead of all
of them. Checked on the ORDER of the router's admission log lines, not on timing."""

from __future__ import annotations

from kimiserve.v1 import common_pb2, router_pb2
from tests.router.batch.lines import slow_lines

PROBE = "interactive-probe-0001"


def test_interactive_request_is_admitted_ahead_of_queued_batch_requests(make_router):
    # Two requests at the shards at once, so the batch (concurrency 12) keeps ~10 requests waiting in admission.
    r = make_router("--max-in-flight", "2", log_level="DEBUG")
    batch = r.create(slow_lines(40, max_tokens=24), max_concurrency=12)
    r.wait(batch.id, until=lambda b: b.request_counts.completed >= 2)
    req = router_pb2.GenerateRequest(text="an interactive question", request_id=PROBE,
                                     sampling=common_pb2.SamplingParams(max_tokens=2, temperature=0))
    chunks = list(r.stub.Generate(req, timeout=60))
    assert chunks[-1].usage.completion_tokens == 2
    assert r.wait(batch.id).status == router_pb2.BATCH_STATUS_COMPLETED

    events = [(e["msg"], e["request_id"], e["priority"]) for e in r.logs()
              if e.get("msg") in ("admission queued", "admission granted")]
    queued_at = events.index(("admission queued", PROBE, "interactive"))
    granted_at = events.index(("admission granted", PROBE, "interactive"))
    granted_before = {rid for msg, rid, _ in events[:queued_at] if msg == "admission granted"}
    waiting_batch = [rid for msg, rid, prio in events[:queued_at]
                     if msg == "admission queued" and prio == "batch" and rid not in granted_before]
    assert len(waiting_batch) >= 5, f"the batch should have had requests waiting, got {waiting_batch}"
    overtaken = [e for e in events[queued_at + 1:granted_at] if e[0] == "admission granted"]
    assert overtaken == [], f"batch requests admitted ahead of the interactive one: {overtaken}"
    granted_after = [rid for msg, rid, _ in events[granted_at + 1:] if msg == "admission granted"]
    assert set(waiting_batch) <= set(granted_after)
