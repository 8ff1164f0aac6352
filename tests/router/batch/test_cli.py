"""`kimiserve batch submit / status / results / cancel / list` against a running router, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.router.batch.conftest import REPO_ROOT
from tests.router.batch.lines import CHAT, line, slow_lines


def kimiserve(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120)
    if ok:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_batch_round_trip_with_the_cli(router, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([line("a", prompt="Hello", max_tokens=4, temperature=0),
                              line("b", CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, seed=1),
                              line("c", "/v1/nope", prompt="x")]) + "\n")
    batch_id = kimiserve("batch", "submit", str(src), "--router", router.address, "--metadata", "who=cli",
                         "--completion-window", "1h").stdout.strip()
    assert batch_id.startswith("batch_")

    out = tmp_path / "out.jsonl"
    fetched = kimiserve("batch", "results", batch_id, "-o", str(out), "--wait", "--router", router.address)
    assert "3 results written" in fetched.stderr
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows.keys() == {"a", "b", "c"}
    assert rows["a"]["response"]["usage"] == {"prompt_tokens": rows["a"]["response"]["usage"]["prompt_tokens"],
                                              "completion_tokens": len(rows["a"]["response"]["token_ids"])}
    assert rows["a"]["response"]["finish_reason"] in ("length", "stop")
    assert rows["c"]["error"]["code"] == "invalid_request"

    status = json.loads(kimiserve("batch", "status", batch_id, "--router", router.address).stdout)
    assert status["status"] == "completed" and status["metadata"] == {"who": "cli"}
    assert status["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert status["completion_window_s"] == 3600 and isinstance(status["completed_at_ms"], int)

    refused = kimiserve("batch", "cancel", batch_id, "--router", router.address, ok=False)
    assert refused.returncode == 2 and "FAILED_PRECONDITION" in refused.stderr

    slow = tmp_path / "slow.jsonl"
    slow.write_text(slow_lines(200, max_tokens=32))
    slow_id = kimiserve("batch", "submit", str(slow), "--router", router.address, "--max-concurrency", "2").stdout
    cancelled = json.loads(kimiserve("batch", "cancel", slow_id.strip(), "--router", router.address).stdout)
    assert cancelled["status"] in ("cancelling", "cancelled")
    router.wait(slow_id.strip())

    listed = kimiserve("batch", "list", "--router", router.address).stdout.splitlines()
    assert listed[0].startswith(slow_id.strip()) and batch_id in listed[1]

    missing = kimiserve("batch", "status", "batch_missing", "--router", router.address, ok=False)
    assert missing.returncode == 2 and "NOT_FOUND" in missing.stderr
