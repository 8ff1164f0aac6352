"""The device benchmark's script (issue 7, item 6) runs end to end on the CPU at a tiny shape, so a GPU run does not
fail on the script itself."""

import json
import subprocess
import sys

from bench.group_bench import add_speedups


def test_group_bench_smoke(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.group_bench", "--device", "cpu", "--config", "tiny",
                          "--layouts", "2x1", "--skip-parity", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "group_bench.json").read_text())
    assert [(r["tp"], r["ep"], r["world"]) for r in result["layouts"]] == [(2, 1, 2)]
    for layout in result["layouts"]:
        assert [d["batch"] for d in layout["decode"]] == [1, 4] and layout["prefill"][0]["tokens_per_s"] > 0
        assert all("speedup_vs_2x1" in d for d in layout["decode"] + layout["prefill"])


def test_speedups_are_each_rows_throughput_over_the_first_layouts_same_row():
    def layout(tp: int, ep: int, prefill: list[float], decode: list[float]) -> dict:
        return {"tp": tp, "ep": ep, "prefill": [{"tokens_per_s": t} for t in prefill],
                "decode": [{"tokens_per_s": t} for t in decode]}

    layouts = [layout(1, 1, [100.0], [10.0, 40.0]), layout(2, 2, [150.0], [5.0, 100.0])]
    add_speedups(layouts)
    assert [r["speedup_vs_1x1"] for r in layouts[1]["prefill"]] == [1.5]
    assert [r["speedup_vs_1x1"] for r in layouts[1]["decode"]] == [0.5, 2.5]
    assert [r["speedup_vs_1x1"] for r in layouts[0]["decode"]] == [1.0, 1.0]
