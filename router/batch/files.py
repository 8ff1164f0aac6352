"""Uploaded files (the HTTP API's /v1/files) and which file a batch came from, in the batch store's SQLite file.

Only input files are stored; a batch's output and error files are rendered from its results when read, so results
live in one place (the `results` table). Its own connection: WAL lets it share the file with BatchStore.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from router.batch.errors import BatchStoreError

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    content BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS batch_inputs (
    batch_id TEXT PRIMARY KEY,                   -- batches created from an uploaded file
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL              -- as the client gave it, e.g. "24h"
);
"""


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at_ms: int


@dataclass(frozen=True)
class BatchInput:
    input_file_id: str
    endpoint: str
    completion_window: str


class FileStore:
    def __init__(self, path: Path):
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as e:
            raise BatchStoreError(f"file store {path} cannot be opened: {e}") from e

    def close(self) -> None:
        self._db.close()

    def add(self, f: StoredFile, content: bytes) -> None:
        self._db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at_ms, content) VALUES "
                         "(?,?,?,?,?,?)", (f.id, f.purpose, f.filename, f.bytes, f.created_at_ms, content))

    def get(self, file_id: str) -> StoredFile | None:
        row = self._db.execute("SELECT id, purpose, filename, bytes, created_at_ms FROM files WHERE id = ?",
                               (file_id,)).fetchone()
        return StoredFile(*row) if row else None

    def content(self, file_id: str) -> bytes | None:
        row = self._db.execute("SELECT content FROM files WHERE id = ?", (file_id,)).fetchone()
        return row[0] if row else None

    def link(self, batch_id: str, source: BatchInput) -> None:
        self._db.execute("INSERT INTO batch_inputs (batch_id, input_file_id, endpoint, completion_window) VALUES "
                         "(?,?,?,?)", (batch_id, source.input_file_id, source.endpoint, source.completion_window))

    def input_of(self, batch_id: str) -> BatchInput | None:
        row = self._db.execute("SELECT input_file_id, endpoint, completion_window FROM batch_inputs WHERE "
                               "batch_id = ?", (batch_id,)).fetchone()
        return BatchInput(*row) if row else None

    def request_kinds(self, batch_id: str) -> dict[str, str]:
        """custom_id -> request kind ('chat', 'generate', 'invalid') of a validated batch."""
        return dict(self._db.execute("SELECT custom_id, kind FROM requests WHERE batch_id = ?", (batch_id,)))
