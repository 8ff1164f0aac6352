"""Structured logging on stderr: one JSON object per line for log pipelines (the default when stderr is not a
terminal), or one readable line per record on a terminal (`--log-format text`, the default there).

Every record has ts (UTC, ISO 8601), level, service and msg; fields passed with `extra={...}` are added as is (in
text, as key=value after the message). Request ids are logged whole (docs/lessons.md#whole-ids-in-logs).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

# Attributes every LogRecord has; anything else on a record came from `extra=` and is emitted as a field.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        # default=str: an extra field that is not JSON-serialisable is logged as its str() instead of failing the line.
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """One readable line: time, level, service, message, then the extra fields as key=value (whole values)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created).strftime("%H:%M:%S.%f")[:-3]
        fields = " ".join(f"{k}={json.dumps(v, ensure_ascii=False, default=str)}" for k, v in vars(record).items()
                          if k not in _STANDARD_ATTRS)
        line = f"{ts} {record.levelname:<7} {self.service}: {record.getMessage()}" + (f"  {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


LOG_FORMATS = ("auto", "json", "text")


def setup_logging(service: str, level: int | str = logging.INFO, log_format: str = "auto") -> None:
    """Route the root logger to stderr tagged with `service`, as JSON lines or text lines (auto: text on a
    terminal, JSON otherwise). Replaces any handlers set before."""
    if log_format == "auto":
        log_format = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TextFormatter(service) if log_format == "text" else JsonFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
