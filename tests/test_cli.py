"""The `kimiserve` command as a user meets it: every subcommand's --help lists each flag with its default, global
flags go before or after the subcommand, a user's mistake is one line and exit code 2 (a traceback only with
--debug), and logs are readable text on request and JSON otherwise."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kimiserve.cli import COMMANDS, build_parser


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimiserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_with_a_default_shows_it_in_help(command):
    parser = build_parser([command])
    p = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = p.format_help()
    for action in p._actions:
        if action.option_strings and not (action.default is None or action.default is False
                                          or action.default == argparse.SUPPRESS):
            assert f"default: {action.default}" in " ".join(text.split()), (command, action.option_strings)


def test_global_flags_are_accepted_after_the_subcommand():
    out = _cli("up", "--log-level", "DEBUG", "--log-format", "json", "--help")
    assert out.returncode == 0 and "--drain-timeout" in out.stdout


def test_a_missing_model_dir_is_one_line_and_exit_2(tmp_path):
    out = _cli("generate", "--model", str(tmp_path / "absent"), "--prompt-ids", "1,2")
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("kimiserve generate: error:")
    assert str(tmp_path / "absent") in out.stderr


def test_debug_shows_the_traceback(tmp_path):
    out = _cli("--debug", "generate", "--model", str(tmp_path / "absent"), "--prompt-ids", "1,2")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_log_formats(tmp_path):
    text = _cli("--log-format", "text", "make-tiny", "--family", "kimi_linear", "--out", str(tmp_path / "a"))
    assert text.returncode == 0, text.stderr
    line = text.stderr.strip().splitlines()[-1]
    assert " INFO " in line and "make-tiny:" in line and not line.startswith("{")
    auto = _cli("make-tiny", "--family", "kimi_linear", "--out", str(tmp_path / "b"))  # not a terminal: JSON
    assert json.loads(auto.stderr.strip().splitlines()[-1])["service"] == "make-tiny"


def test_up_refuses_a_router_port_in_use_before_starting_anything():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _cli("up", "--port", str(port), timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and f"127.0.0.1:{port} is in use" in out.stderr


def test_up_passes_shard_capacity_through_and_keeps_its_state_apart(tmp_path):
    import signal
    import time

    import grpc

    from kimiserve.ports import free_port
    from kimiserve.v1 import router_pb2, router_pb2_grpc
    from shard_svc.make_tiny import make_tiny

    model = make_tiny("kimi_linear", tmp_path / "model", seed=0)
    port, state = free_port(), tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "kimiserve.cli", "up", "--model", str(model), "--port", str(port),
                             "--num-kv-blocks", "8", "--kv-block-size", "16", "--state-dir", str(state)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "kimiserve is up" in proc.stdout.readline()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            card = router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest(), timeout=30)
        assert card.models[0].max_context_tokens == 8 * 16
        assert (state / "batches.sqlite3").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    assert proc.returncode == 0
