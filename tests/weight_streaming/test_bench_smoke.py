"""bench/streaming.py (the H200 benchmark) is import-safe and its pieces run end to end on the CPU at tiny width."""

from __future__ import annotations

import torch

from tests.weight_streaming.conftest import CPU


def test_full_width_slice_layout():
    from bench import streaming as bench

    sizes = bench.layer_bytes(4)  # layers 0-2 KDA, 3 MLA; every one a MoE layer with 896 MXFP4 experts
    expert = 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)  # w1/w3 [3072, 3584] and w2 [3584, 3072], packed + scales
    assert expert == 17_547_264
    assert all(896 * expert < s < 896 * expert + 2 * 1024**3 for s in sizes)
    assert sizes[3] < sizes[0]  # the MLA layer's dense part is smaller than a KDA layer's


def test_bench_pieces_run_on_cpu():
    from bench import streaming as bench

    cfg, model, host, streamer, setup = bench.build(5, 2, None, CPU, full_width=False)
    ring = bench.ring_only(streamer, reps=1)
    tensor_bytes = sum(m.nbytes for plan in host.plans.values() for m in plan.members())
    assert ring["runs"][0]["bytes"] == tensor_bytes <= host.total_bytes  # every tensor, no alignment padding
    result = bench.prefill_and_decode(cfg, model, streamer, batch=2, length=16, decode_steps=2, op_backend="eager")
    assert len(result["prefill"]) == 4 and len(result["decode"]) == 2
    assert all(not row["routed_experts"] for row in result["prefill"])
    # steady state: the previous pass fetched the first two layers; the last prefill starts from a cold ring
    assert [(row["ready_layers"], row["cold"]) for row in result["prefill"]] == [(0, False), (2, False), (2, False),
                                                                               (0, True)]
    assert all(torch.isfinite(torch.tensor(row["tokens_per_s"])) for row in result["prefill"])
    peak = {"peak_GBps": 10.0, "GBps_by_size": {"1MiB": 10.0}}
    text = bench.table({"device": "cpu", "torch": torch.__version__, "layers": 5, "slice_GiB": 0.01, "slots": 3,
                        "slot_GiB": 0.001, "depth": 2, "pinned_copy": peak, "ring": ring, "prefill": result})
    assert "pinned-copy peak" in text and "prefill 2 x 16" in text and "decode batch 2" in text
    assert "prefill 2 x 16 cold" in text and "cross-pass prefetch" in text
