"""`kimiserve generate --tp N --ep N` as a user runs it: the same JSON as one process; failures loud, never a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from shard_svc.make_tiny import make_tiny


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    return {"kimi_linear": make_tiny("kimi_linear", root / "linear", seed=4),
            "kimi_k3": make_tiny("kimi_k3", root / "k3", seed=5, layers=14)}  # 93 layers: test_group_parity


def generate(*args: str) -> tuple[dict, str]:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3"])
def test_group_generate_prints_the_same_json_as_one_process(models, tmp_path, family):
    args = ["--model", str(models[family]), "--prompt", "Hello there, tiny model", "--max-tokens", "8", "--json",
            "--ignore-eos"]
    one, _ = generate(*args, "--dump-logits", str(tmp_path / "one.safetensors"))
    group, stderr = generate(*args, "--tp", "2", "--ep", "2", "--dump-logits", str(tmp_path / "group.safetensors"))
    assert group == one
    assert one["usage"]["completion_tokens"] == 8 and one["finish_reason"] == "length"
    assert '"service": "shard-rank1"' in stderr and '"msg": "rank stopped"' in stderr  # the worker stopped cleanly
    a, b = load_file(str(tmp_path / "group.safetensors")), load_file(str(tmp_path / "one.safetensors"))
    for key in ("prompt_logits", "step_logits"):  # float32 on the CPU: equal up to the all-reduce order
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-3 * float(b[key].abs().max()))


def test_a_layout_that_does_not_fit_fails_before_spawning(models):
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--model", str(models["kimi_linear"]),
                          "--prompt-ids", "1,2", "--tp", "3", "--ep", "3"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert out.returncode == 2 and "Traceback" not in out.stderr  # a user mistake: one line, no traceback
    assert "cannot be split with --tp 3 --ep 3: KDA heads = 4 is not divisible by tp = 3" in out.stderr
    assert "shard-rank1" not in out.stderr


def _start_long_group_generate(model) -> tuple[subprocess.Popen, int]:
    """A group generate that runs for minutes; returns it with rank 1's pid once the group is ready."""
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "generate", "--model", str(model),
                             "--prompt-ids", "1,2,3", "--max-tokens", "16000", "--ignore-eos", "--json", "--tp", "2",
                             "--group-timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if '"shard group ready"' in line:
            return proc, json.loads(line)["pids"][0]
    raise AssertionError(f"the group never became ready (exit {proc.wait()})")


def test_killed_worker_fails_generate_loudly_and_quickly(models):
    proc, worker = _start_long_group_generate(models["kimi_linear"])
    time.sleep(1.0)  # decoding
    os.kill(worker, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - killed < 15, "the group took too long to notice a dead rank"
    assert proc.returncode == 1
    assert "the shard group broke" in stderr and f"rank 1 (pid {worker}) was killed by SIGKILL" in stderr


def test_killed_rank0_takes_its_workers_down(models):
    proc, worker = _start_long_group_generate(models["kimi_linear"])
    time.sleep(1.0)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError(f"rank 1 (pid {worker}) outlived rank 0 by 15 s")
