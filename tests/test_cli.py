"""The `kimiserve` command as a user meets it: every subcommand's --help lists each flag with its default, global
flags go before or after the subcommand, a user's mistake is one line and exit code 2 (a traceback only with
--debug), logs are readable text on a terminal or on request and JSON otherwise, and a stack never shares a port
or a batch database with another (the HTTP port: tests/router/http/test_up.py)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from launcher.cli import COMMANDS, build_parser


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _parsers(p: argparse.ArgumentParser, name: str) -> list[tuple[str, argparse.ArgumentParser]]:
    """`p` and every parser below it (`batch submit`, ...)."""
    found = [(name, p)]
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                found += _parsers(sub, f"{name} {sub_name}")
    return found


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_with_a_default_shows_it_in_help(command):
    parser = build_parser([command])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    for name, p in _parsers(top, command):
        text = " ".join(p.format_help().split())
        formatter = p._get_formatter()
        for action in p._actions:
            if action.option_strings and not (action.default is None or action.default is False
                                              or action.default in ("", argparse.SUPPRESS)):
                assert f"default: {action.default}" in text, (name, action.option_strings)
            if action.help:  # one default per flag: a help text that states its own would contradict or repeat
                assert formatter._expand_help(action).count("(default") <= 1, (name, action.option_strings)


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


def test_up_passes_shard_capacity_through_and_keeps_its_state_apart(tiny_linear, tmp_path):
    import signal
    import time

    import grpc

    from kimiserve.ports import free_port
    from kimiserve.v1 import router_pb2, router_pb2_grpc

    port, state = free_port(), tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "up", "--model", str(tiny_linear), "--port",
                             str(port), "--http-port", str(free_port()), "--num-kv-blocks", "8", "--kv-block-size",
                             "16", "--state-dir", str(state)],
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


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """A servable tiny checkpoint, one without tokenizer files, one with a malformed config.json, one absent."""
    from shard_svc.make_tiny import make_tiny

    root = tmp_path_factory.mktemp("models")
    dirs = {"tiny": make_tiny("kimi_linear", root / "tiny"), "no-tokenizer": root / "no-tokenizer",
            "bad-config": root / "bad-config", "absent": root / "absent"}
    for name in ("no-tokenizer", "bad-config"):
        dirs[name].mkdir()
    (dirs["no-tokenizer"] / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    (dirs["bad-config"] / "config.json").write_text("{not json")
    return {name: str(path) for name, path in dirs.items()}


@pytest.mark.parametrize("args, says", [
    (("up", "--model", "{absent}", "--port", "0", "--http-port", "0"), "no config.json there"),
    (("up", "--model", "{no-tokenizer}", "--port", "0", "--http-port", "0"),
     "neither tokenizer.json nor tiktoken.model is there"),
    (("tokenizer", "--model", "{no-tokenizer}", "--port", "0"), "neither tokenizer.json nor tiktoken.model"),
    (("tokenizer", "--model", "{absent}", "--port", "0"), "config.json"),
    (("shard", "--model", "{absent}", "--port", "0"), "no config.json in"),
    (("generate", "--model", "{bad-config}", "--prompt-ids", "1"), "config.json"),
    (("batch", "submit", "{absent}/batch.jsonl"), "cannot read"),
    (("chat", "Hello", "--tls-ca", "{absent}/ca.pem"), "cannot read the CA (--tls-ca)"),
])
def test_user_mistakes_are_one_line_and_exit_2(model_dirs, args, says):
    path = next(a.format_map(model_dirs) for a in args if "{" in a)
    out = _cli(*(a.format_map(model_dirs) for a in args))
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith((f"kimiserve {args[0]}: error:", "kimiserve: ")), line
    assert says in line and path in line, line


def test_a_server_refuses_a_port_another_server_holds_even_with_so_reuseport(model_dirs):
    """gRPC's default SO_REUSEPORT would let a second server share the port and split its clients: it is off."""
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a default gRPC server binds
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        out = _cli("tokenizer", "--model", model_dirs["tiny"], "--port", str(port), timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and f"cannot serve on 127.0.0.1:{port}" in out.stderr


def test_a_metrics_port_in_use_is_one_line_naming_it(model_dirs):
    import socket

    from kimiserve.ports import free_port

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        out = _cli("tokenizer", "--model", model_dirs["tiny"], "--port", str(free_port()), "--metrics-port",
                   str(taken), timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and f"cannot serve /metrics on 127.0.0.1:{taken}" in out.stderr


def test_two_stacks_get_their_own_state_dir_by_default(tmp_path, monkeypatch):
    from launcher.up import add_args, state_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = argparse.ArgumentParser()
    add_args(p)
    first, second = (state_dir(p.parse_args(["--port", port])) for port in ("50051", "50061"))
    assert first != second and first.parent == second.parent == tmp_path / "kimiserve"
    assert state_dir(p.parse_args(["--state-dir", str(tmp_path / "s")])) == tmp_path / "s"


def test_logs_are_text_on_a_terminal_by_default(tmp_path):
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "launcher.cli", "make-tiny", "--family", "kimi_linear", "--out",
                               str(tmp_path / "m")], stderr=follower, stdout=subprocess.DEVNULL, timeout=120)
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other side is closed and everything was read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if follower != -1:
            os.close(follower)
        os.close(leader)
    assert proc.returncode == 0
    last = seen.decode().strip().splitlines()[-1]
    assert " INFO " in last and "make-tiny:" in last and not last.startswith("{")


def test_the_readme_puts_kimiserve_on_path_before_using_it():
    """`make` installs kimiserve into .venv/bin, which is not on PATH: the README activates it before any bare
    `kimiserve` command of its shell blocks."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shell = "\n".join(re.findall(r"```bash\n(.*?)```", readme, flags=re.DOTALL))
    activate = shell.find(". .venv/bin/activate")
    bare = re.search(r"(^|[\s(=])kimiserve (?!\S*/)", shell, flags=re.MULTILINE)
    assert bare is not None and 0 <= activate < bare.start(), (activate, bare and bare.group(0))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_global_flags_after_a_subcommand_show_their_real_default(command):
    """After the subcommand they default to SUPPRESS (so a value given before it stands); the help must still say
    INFO / auto (`batch --help` has no flags of its own, so these are all it shows)."""
    parser = build_parser([command])
    top = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    text = " ".join(top.format_help().split())
    assert "ERROR (default: INFO)" in text and "otherwise (default: auto)" in text
