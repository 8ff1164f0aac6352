"""Structured logging: one JSON object per line on stderr, so log pipelines parse fields instead of grepping text.

Every line has ts (UTC, ISO 8601), level, service and msg; fields passed with `extra={...}` are added as is.
Request ids are logged whole (docs/lessons.md#whole-ids-in-logs).
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


def setup_logging(service: str, level: int | str = logging.INFO) -> None:
    """Route the root logger to stderr as JSON lines tagged with `service`. Replaces any handlers set before."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
