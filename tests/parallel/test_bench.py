"""The device benchmark's script (issue 7, item 6) runs end to end on the CPU at a tiny shape, so a GPU run does not
fail on the script itself."""

import json
import subprocess
import sys


def test_group_bench_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "shard_svc.parallel.bench", "--device", "cpu", "--config", "tiny",
                          "--layouts", "2x1", "--skip-parity", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "group_bench.json").read_text())
    assert [(r["tp"], r["ep"], r["world"]) for r in result["layouts"]] == [(2, 1, 2)]
    for layout in result["layouts"]:
        assert [d["batch"] for d in layout["decode"]] == [1, 4] and layout["prefill"][0]["tokens_per_s"] > 0
        assert layout["decode"][0]["speedup_vs_2x1"] == 1.0
