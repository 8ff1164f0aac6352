"""`kimiserve make-tiny` and `kimiserve generate` as a user runs them: separate processes, JSON on stdout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file


def kimiserve(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=300)
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


@pytest.fixture(scope="module")
def with_and_without_tokenizer(tmp_path_factory) -> tuple[Path, Path]:
    """One tiny checkpoint twice: as written, and with its tokenizer files deleted (weights and config only)."""
    from shard_svc.make_tiny import make_tiny

    full = make_tiny("kimi_linear", tmp_path_factory.mktemp("tok") / "full", seed=5)
    bare = tmp_path_factory.mktemp("notok") / "bare"
    shutil.copytree(full, bare)
    for name in ("tokenizer.json", "tiktoken.model", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    return full, bare


GREEDY = ("--prompt-ids", "1,2,3", "--max-tokens", "5", "--ignore-eos")


def test_generate_without_tokenizer_gives_token_ids(with_and_without_tokenizer):
    full, bare = with_and_without_tokenizer
    ids = kimiserve("generate", "--model", str(bare), *GREEDY).strip().splitlines()[-1]
    result = json.loads(kimiserve("generate", "--model", str(bare), *GREEDY, "--json").strip().splitlines()[-1])
    assert result["text"] is None and result["finish_reason"] == "length"
    assert ids == ",".join(str(t) for t in result["token_ids"]) and len(result["token_ids"]) == 5
    # The same weights with their tokenizer: the same tokens, shown as their text (plain --prompt-ids prints text).
    from kimiserve.tokenizer_files.loading import load_tokenizer

    text = kimiserve("generate", "--model", str(full), *GREEDY).removesuffix("\n")
    assert text == load_tokenizer(full).decode(result["token_ids"])


@pytest.mark.parametrize("asked", [("--prompt", "Hello"), ("--prompt-ids", "1,2", "--output", "text"),
                                   ("--prompt-ids", "1,2", "--json-schema", '{"type": "object"}')])
def test_text_without_tokenizer_is_one_line_and_exit_2(with_and_without_tokenizer, asked):
    _, bare = with_and_without_tokenizer
    out = subprocess.run([sys.executable, "-m", "launcher.cli", "generate", "--model", str(bare), *asked],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("kimiserve generate: error:") and str(bare) in line
    assert "tokenizer.json" in line and "tiktoken.model" in line and asked[-2] in line
