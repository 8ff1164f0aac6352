"""Uploaded files (the HTTP API's /v1/files) and which file a batch came from, in the batch store's SQLite file.

Only input files are stored; a batch's output and error files are rendered from its results when read, so results
live in one place (the `results` table). Its own connection: WAL lets it share the file with BatchStore.

A batch copies its input when it is created (BatchStore's `input`), so deleting a file never changes a batch's run;
still, a file is kept while a batch created from it has not ended, so a live batch's `input_file_id` always resolves.

A file belongs to the tenant that uploaded it (`tenant`; rows from before tenants: `default`); who may see or change
it is decided by the caller (router/http/batches.py, kimiserve/tenants.py).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from kimiserve.text import clip

from router.batch import states
from router.batch.errors import BatchStoreError, FileInUse
from router.errors import NotFound
from router.batch.store import migrate, where_clause, write_error

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    content BLOB NOT NULL,
    tenant TEXT NOT NULL DEFAULT 'default'        -- who uploaded it
);
CREATE TABLE IF NOT EXISTS batch_inputs (
    batch_id TEXT PRIMARY KEY,                   -- batches created from an uploaded file
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL              -- as the client gave it, e.g. "24h"
);
"""


class FileNotFound(NotFound):
    """No uploaded file with that id."""


@dataclass(frozen=True)
class StoredFile:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at_ms: int
    tenant: str


@dataclass(frozen=True)
class BatchInput:
    input_file_id: str
    endpoint: str
    completion_window: str


_FILE_COLUMNS = "id, purpose, filename, bytes, created_at_ms, tenant"
_TERMINAL = tuple(sorted(states.TERMINAL))
_LIVE_USERS = ("SELECT bi.batch_id FROM batch_inputs bi JOIN batches b ON b.id = bi.batch_id "
               f"WHERE bi.input_file_id = ? AND b.status NOT IN ({','.join('?' * len(_TERMINAL))}) ORDER BY b.seq")


class FileStore:
    def __init__(self, path: Path):
        self.path = path
        try:
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA busy_timeout=10000")
            self._db.executescript(SCHEMA)
        except sqlite3.Error as e:
            raise BatchStoreError(f"file store {path} cannot be opened: {e}") from e
        migrate(self._db, path, "files", "tenant", "TEXT NOT NULL DEFAULT 'default'")

    def close(self) -> None:
        self._db.close()

    def add(self, f: StoredFile, content: bytes) -> None:
        self._db.execute("INSERT INTO files (id, purpose, filename, bytes, created_at_ms, content, tenant) VALUES "
                         "(?,?,?,?,?,?,?)", (f.id, f.purpose, f.filename, f.bytes, f.created_at_ms, content, f.tenant))

    def get(self, file_id: str) -> StoredFile | None:
        row = self._db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?", (file_id,)).fetchone()
        return StoredFile(*row) if row else None

    def page(self, limit: int, after: str | None, descending: bool, purpose: str | None, tenant: str | None
             ) -> tuple[list[StoredFile], bool]:
        """Up to `limit` files in upload order (newest first when `descending`), after the file `after` (a cursor: the
        last id of the previous page), with `purpose` if given, of `tenant` (None: every tenant's); and whether more
        follow. Raises FileNotFound for an `after` that is no file of `tenant`'s."""
        cursor = None
        if after is not None:
            row = self._db.execute("SELECT rowid, tenant FROM files WHERE id = ?", (after,)).fetchone()
            if row is None or (tenant is not None and row[1] != tenant):
                raise FileNotFound(f"no file {clip(after)} (the `after` cursor names the last file of a page)")
            cursor = row[0]
        where, args = where_clause(("rowid < ?" if descending else "rowid > ?", cursor), ("tenant = ?", tenant),
                                   ("purpose = ?", purpose))
        sql = f"SELECT {_FILE_COLUMNS} FROM files{where} ORDER BY rowid {'DESC' if descending else 'ASC'} LIMIT ?"
        rows = self._db.execute(sql, (*args, limit + 1)).fetchall()
        return [StoredFile(*r) for r in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> None:
        """Deletes an uploaded file, in one transaction with the check that no live batch was created from it.
        Raises FileNotFound, or FileInUse naming the batches."""
        try:
            self._db.execute("BEGIN IMMEDIATE")  # the check and the delete see one state of the store
            try:
                users = [r[0] for r in self._db.execute(_LIVE_USERS, (file_id, *_TERMINAL))]
                deleted = 0 if users else self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise
        except sqlite3.OperationalError as e:
            raise write_error(self.path, e) from e
        if users:
            raise FileInUse(f"file {clip(file_id)} is the input of batch(es) {users}, which have not ended; delete "
                            "it once they end (or cancel them first)")
        if not deleted:
            raise FileNotFound(f"no file {clip(file_id)}")

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
        """custom_id -> request kind ('chat', 'generate', 'responses', 'invalid') of a validated batch."""
        return dict(self._db.execute("SELECT custom_id, kind FROM requests WHERE batch_id = ?", (batch_id,)))

    def request_payloads(self, batch_id: str, kind: str) -> dict[str, bytes]:
        """custom_id -> stored request (router/batch/parse.py ParsedRequest.payload) of `kind` in a batch."""
        return dict(self._db.execute("SELECT custom_id, payload FROM requests WHERE batch_id = ? AND kind = ?",
                                     (batch_id, kind)))
