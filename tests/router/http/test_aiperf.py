"""NVIDIA's aiperf (the real client, as `aiperf profile` runs it) streams a short chat benchmark against the stack:
every request completes without an error, most arrive in several chunks, and the usage each stream reports counts
exactly the tokens asked for (ignore_eos, as benchmark harnesses send it).

Its extra inputs also set a logit_bias that makes every token a whole word: a random model's tokens can be byte
pieces that complete no character until the stream's final flush, and with the fast 4-layer test model a whole
reply of them then arrived as one chunk (seen on CI), which says nothing about streaming."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.router.http.conftest import API_KEY

REQUESTS, CONCURRENCY, INPUT_TOKENS, OUTPUT_TOKENS = 8, 2, 32, 16
WORD = 300  # a tiny-tokenizer id that decodes to whole characters ("it")


def test_aiperf_streams_a_chat_benchmark_without_errors(http_stack, tmp_path):
    aiperf = shutil.which("aiperf", path=str(Path(sys.executable).parent))
    assert aiperf, "aiperf is a test dependency (pyproject's test extra)"
    out = tmp_path / "aiperf"
    # HF_HUB_OFFLINE makes aiperf look a local tokenizer path up in the hub cache; a path needs no hub either way.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    # Its dataset files and their cache go under the test's directory, not the system temp and ~/.cache.
    env |= {"AIPERF_DATASET_MMAP_BASE_PATH": str(tmp_path / "mmap"), "AIPERF_DATASET_MMAP_CACHE_DIR":
            str(tmp_path / "mmap-cache"), "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [aiperf, "profile", "--model", http_stack.model, "--url", http_stack.base, "--endpoint-type", "chat",
         "--streaming", "--api-key", API_KEY, "--tokenizer", str(http_stack.model_dir),
         "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY), "--isl", str(INPUT_TOKENS),
         "--osl", str(OUTPUT_TOKENS), "--random-seed", "7",
         "--extra-inputs", json.dumps({"ignore_eos": True, "logit_bias": {str(WORD): 100}}),
         "--artifact-dir", str(out), "--ui", "none",
         # What this test does not read, each a wait of its own at start (DCGM endpoints, a /metrics scrape loop,
         # a pool of worker processes sized from the machine's cores).
         "--no-gpu-telemetry", "--no-server-metrics", "--workers-max", "1", "--record-processors", "1"],
        env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["error_summary"] == [] and not summary["was_cancelled"], summary["error_summary"]
    assert summary["request_count"]["avg"] == REQUESTS
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == REQUESTS
    chunks = []
    for r in records:
        assert r.get("error") is None, r["error"]
        metrics = {name: m["value"] for name, m in r["metrics"].items()}
        assert metrics["usage_completion_tokens"] == OUTPUT_TOKENS, metrics
        chunks.append(metrics["http_req_chunks_received"])
        # The response's first bytes come well before its end, and its first text no later than its end.
        assert metrics["http_req_waiting"] < metrics["request_latency"], metrics
        assert metrics["time_to_first_token"] <= metrics["request_latency"], metrics
    # Streamed, not one body. A client the loaded 2-core CI machine deschedules for the ~50 ms a reply takes reads a
    # whole stream in one go (seen once on CI: 1 chunk, TTFT equal to the latency), so most, not all, must show it;
    # a server that does not stream gives one chunk to every request.
    assert sum(c > 1 for c in chunks) >= REQUESTS // 2, chunks
