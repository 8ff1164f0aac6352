"""--weights resident|stream|auto, the pinned-memory budget and the generate CLI in stream mode."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shard_svc.config import ModelConfig
from shard_svc.host_memory import HostMemoryError
from shard_svc.make_tiny import kimi_k3_config
from shard_svc.weight_streaming import add_weights_args, choose_mode, weights_args
from shard_svc.weight_streaming.errors import StreamingConfigError
from shard_svc.weight_streaming.host_loader import load_streamed
from tests.weight_streaming.conftest import CPU

REPO = Path(__file__).resolve().parents[2]


def test_auto_keeps_the_resident_path_on_the_cpu():
    cfg = ModelConfig.from_dict(kimi_k3_config(8))
    assert choose_mode("auto", cfg, CPU, torch.float32)[0] == "resident"
    assert choose_mode("stream", cfg, CPU, torch.float32) == ("stream", "--weights stream")
    with pytest.raises(StreamingConfigError, match="choose one of"):
        choose_mode("hybrid", cfg, CPU, torch.float32)


def test_args_defaults():
    p = argparse.ArgumentParser()
    add_weights_args(p)
    w = weights_args(p.parse_args([]))
    assert (w.mode, w.prefetch_depth, w.num_slots, w.pinned_memory_gb) == ("auto", 2, None, None)
    w = weights_args(p.parse_args(["--weights", "stream", "--prefetch-depth", "3", "--pinned-memory-gb", "1.5"]))
    assert (w.mode, w.prefetch_depth, w.pinned_memory_gb) == ("stream", 3, 1.5)


def test_pinned_budget_too_small_names_the_sizes(tiny_k3):
    with pytest.raises(HostMemoryError, match=r"streaming 93 layers needs 0\.01 GiB .* budget is 0\.00 GiB"):
        load_streamed(tiny_k3, CPU, torch.float32, budget_bytes=4096)


def test_generate_cli_streams_the_same_tokens(tmp_path):
    """`kimiserve generate` end to end, resident and streamed, in fresh processes (an 8-layer K3: 2 MLA layers)."""
    from shard_svc.make_tiny import make_tiny

    model = make_tiny("kimi_k3", tmp_path / "k3-8", seed=1, layers=8)
    tokens = {}
    for weights in ("resident", "stream"):
        cmd = [sys.executable, "-m", "launcher.cli", "generate", "--model", str(model), "--prompt-ids", "1,2,3",
               "--max-tokens", "3", "--ignore-eos", "--json", "--weights", weights, "--prefetch-depth", "2"]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        tokens[weights] = json.loads(out.stdout.strip().splitlines()[-1])["token_ids"]
        if weights == "stream":
            assert "weights: stream (--weights stream)" in out.stderr
    assert len(tokens["resident"]) == 3 and tokens["stream"] == tokens["resident"]


def test_auto_streams_a_model_that_does_not_fit_the_device(monkeypatch):
    from bench.streaming import k3_slice_config

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 << 30, 141 << 30))
    k3 = ModelConfig.from_dict(k3_slice_config(4))  # 4 full-width layers: ~240 GB resident (experts dequantised)
    mode, why = choose_mode("auto", k3, cuda, torch.bfloat16)
    assert mode == "stream" and "needs" in why and "140.0 GiB free" in why
    tiny = ModelConfig.from_dict(kimi_k3_config(8))
    mode, why = choose_mode("auto", tiny, cuda, torch.bfloat16)
    assert mode == "resident" and "fits" in why
