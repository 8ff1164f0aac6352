"""`--device auto` (kimiserve/devices.py): the GPU when torch sees one, else the CPU, for `shard`, `generate` and
`up` (which gives shard i cuda:i, or cuda:i*N with groups of N ranks); and `kimiserve shard --help` as a user reads
it: the auto default and the memory flag with its default."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kimiserve.devices import resolve_device, shard_devices


def test_auto_is_the_gpu_when_there_is_one_else_the_cpu():
    assert resolve_device("auto", cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")  # what torch says here
    assert resolve_device("cuda:3", cuda_available=False) == "cuda:3"  # an explicit device is taken as given
    assert resolve_device("cpu", cuda_available=True) == "cpu"


def test_up_gives_each_shard_its_own_gpu():
    assert shard_devices("auto", 3, 1, cuda_available=True) == ["cuda:0", "cuda:1", "cuda:2"]
    assert shard_devices("auto", 2, 4, cuda_available=True) == ["cuda:0", "cuda:4"]  # groups of 4 ranks
    assert shard_devices("cuda", 2, 1, cuda_available=False) == ["cuda:0", "cuda:1"]
    assert shard_devices("auto", 2, 1, cuda_available=False) == ["cpu", "cpu"]
    assert shard_devices("cpu", 2, 2, cuda_available=True) == ["cpu", "cpu"]


def _help(command: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launcher.cli", command, "--help"], capture_output=True, text=True,
                         timeout=120, check=True)
    return " ".join(out.stdout.split())


def test_shard_help_shows_the_auto_device_and_the_memory_flag():
    text = _help("shard")
    assert "--device DEVICE auto: the GPU when torch sees one (cuda), else the CPU" in text
    assert "(default: auto)" in text
    flag = text[text.index("--gpu-memory-utilization GPU_MEMORY_UTILIZATION share"):]
    assert "share of the GPU's total memory" in flag and "(default: 0.9)" in flag[:500]
    assert "Default: sized from memory on a GPU" in text and "16 on the CPU" in text  # --num-state-slots
    assert "Default: 8192 on a GPU, 512 on the CPU" in text  # --prefill-token-budget


def test_up_and_generate_default_to_auto():
    from launcher.cli import build_parser

    for command in ("up", "generate"):
        parser = build_parser([command])
        sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
        device = next(a for a in sub.choices[command]._actions if "--device" in a.option_strings)
        assert device.default == "auto", command


def test_shard_flags_parse_into_a_capacity_request(tmp_path):
    """Unset capacity flags stay unset (sized once the weights are placed), set ones are kept, `--host-kv-gb auto`
    asks for host sizing, and `--device auto` is resolved before the engine options are built."""
    import argparse

    from shard_svc.server.main import add_args, config_from_args

    def parsed(*flags: str):
        p = argparse.ArgumentParser()
        add_args(p)
        return config_from_args(p.parse_args(["--model", str(tmp_path), *flags])).engine

    opts = parsed()
    assert opts.device == ("cuda" if torch.cuda.is_available() else "cpu")
    req = opts.capacity
    assert (req.num_state_slots, req.num_kv_blocks, req.prefix_cache_entries, req.prefill_token_budget,
            req.max_model_len, req.kv_block_size, req.gpu_memory_utilization, req.host_kv_bytes) == \
        (None, None, None, None, None, None, 0.9, 0)
    req = parsed("--num-state-slots", "8", "--kv-block-size", "32", "--host-kv-gb", "auto",
                 "--gpu-memory-utilization", "0.8", "--device", "cpu").capacity
    assert (req.num_state_slots, req.kv_block_size, req.host_kv_bytes, req.gpu_memory_utilization) == \
        (8, 32, None, 0.8)
    assert parsed("--host-kv-gb", "1.5").capacity.host_kv_bytes == int(1.5 * (1 << 30))


def test_the_default_prefix_state_interval_fits_any_kv_block_size(tmp_path):
    """The default interval is rounded up to a multiple of the KV block size (a large block must not make the
    default invalid); a set interval that is not a multiple is refused, naming both."""
    import argparse

    from shard_svc.engine.prefix_cache import DEFAULT_PREFIX_STATE_INTERVAL
    from shard_svc.server.main import add_args, config_from_args

    def interval(*flags: str) -> int:
        p = argparse.ArgumentParser()
        add_args(p)
        return config_from_args(p.parse_args(["--model", str(tmp_path), "--device", "cpu", *flags])) \
            .engine.config.prefix_state_interval

    assert interval() == DEFAULT_PREFIX_STATE_INTERVAL == 1024
    assert interval("--kv-block-size", "48") == 1056  # 22 blocks of 48
    assert interval("--kv-block-size", "2048") == 2048
    assert interval("--prefix-state-interval", "0") == 0
    with pytest.raises(SystemExit, match="multiple of the KV block size 64 .got 1000"):
        interval("--kv-block-size", "64", "--prefix-state-interval", "1000")
