"""kimiserve.logs: one JSON object per line with ts, level, service, msg and the `extra` fields."""

from __future__ import annotations

import json
import logging

import pytest

from kimiserve.logs import setup_logging


def test_json_lines_carry_extra_fields(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("tokenizer", "debug")
        logging.getLogger("kimiserve.test").info(
            "request %s done", "mmlu-030-0001", extra={"request_id": "mmlu-030-0001", "path": object()}
        )
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("kimiserve.test").exception("failed")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert first["service"] == "tokenizer" and first["level"] == "INFO" and first["ts"].endswith("+00:00")
    assert first["msg"] == "request mmlu-030-0001 done" and first["request_id"] == "mmlu-030-0001"
    assert first["path"].startswith("<object object")  # not JSON-serialisable: logged as str, the line survives
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]
