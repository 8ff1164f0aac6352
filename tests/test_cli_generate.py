"""`kimiserve make-tiny` and `kimiserve generate` as a user runs them: separate processes, JSON on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file


def kimiserve(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "kimiserve.cli", *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3"])
def test_make_tiny_then_generate_json_and_logits(tmp_path, family):
    model = tmp_path / family
    kimiserve("make-tiny", "--family", family, "--out", str(model), "--seed", "3")
    dump = tmp_path / "logits.safetensors"
    stdout = kimiserve("generate", "--model", str(model), "--prompt-ids", "1,2,3,4,5", "--max-tokens", "6",
                       "--ignore-eos", "--json", "--dump-logits", str(dump))
    result = json.loads(stdout.strip().splitlines()[-1])
    assert set(result) == {"token_ids", "text", "finish_reason", "usage"}
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 6
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 6}
    logits = load_file(str(dump))
    prompt, steps = logits["prompt_logits"], logits["step_logits"]
    assert prompt.shape == (5, 1024) and steps.shape == (6, 1024)
    # Greedy: every token is the argmax of the logits it was drawn from, and the first comes from prefill.
    assert steps.argmax(-1).tolist() == result["token_ids"]
    assert (steps[0] == prompt[-1]).all()


def test_generate_text_prompt_and_stop_on_eos(tmp_path):
    model = tmp_path / "m"
    kimiserve("make-tiny", "--family", "kimi_linear", "--out", str(model))
    stdout = kimiserve("generate", "--model", str(model), "--prompt", "Hello world", "--max-tokens", "4",
                       "--json", "--stop-token-ids", ",".join(str(i) for i in range(1024)))
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "stop" and len(result["token_ids"]) == 1
