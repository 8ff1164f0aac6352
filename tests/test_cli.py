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
        if action.option_strings and action.default not in (None, False, "==SUPPRESS==") and \
                action.dest != "help":
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
