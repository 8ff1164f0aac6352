"""Durable batch state in SQLite (WAL): batches, their requests and one result per request.

Every change is one transaction, committed before the caller goes on, so a router SIGKILLed at any point restarts
with a consistent picture: a request either has its result (never run again) or not (run again). A result and the
batch's counts / usage change together. `results` has a unique key on (batch_id, idx), so a second result for a
request is refused (DuplicateResult) instead of silently doubling it.

Ownership: several routers may share a file. A batch is run by the router whose `owner` name it carries, under a
lease it renews; another router takes it over only once the lease has run out (a router restarted with the same
owner name takes its batches back at once). Apart from that, a batch belongs to the `tenant` that created it
(kimiserve/tenants.py); a database from before tenants gets the column, its rows the tenant `default` (migrate).

The file and its directory are private to the router's user (kimiserve/private_files.py): they hold prompts.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kimiserve.private_files import private_dir, private_file
from router.batch import states
from router.batch.errors import BatchStoreError, BatchStoreFull, BatchStoreReadOnly, DuplicateResult
from router.batch.parse import INVALID, BatchIssue, ParsedRequest

log = logging.getLogger(__name__)
SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,       -- creation order, for paging
    id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,
    input_kind TEXT NOT NULL,                    -- 'jsonl' | 'inline'
    input BLOB,                                  -- the raw input until validated, then NULL
    metadata TEXT NOT NULL,                      -- JSON object
    errors TEXT NOT NULL DEFAULT '[]',           -- JSON list of {code, message, line}
    completion_window_s INTEGER NOT NULL,
    max_concurrency INTEGER NOT NULL,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    owner TEXT NOT NULL,                         -- the router running it (lease)
    tenant TEXT NOT NULL DEFAULT 'default',      -- who created it: the only tenant that sees it (and admins)
    lease_until_ms INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL,
    expires_at_ms INTEGER NOT NULL,
    in_progress_at_ms INTEGER, finalizing_at_ms INTEGER, completed_at_ms INTEGER, failed_at_ms INTEGER,
    expired_at_ms INTEGER, cancelling_at_ms INTEGER, cancelled_at_ms INTEGER
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    kind TEXT NOT NULL,                          -- 'generate' | 'chat' | 'invalid'
    payload BLOB NOT NULL,                       -- serialized GenerateRequest / ChatRequest
    attempts INTEGER NOT NULL DEFAULT 0,         -- runs started, across restarts
    PRIMARY KEY (batch_id, idx),
    UNIQUE (batch_id, custom_id)
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    seq INTEGER NOT NULL,                        -- 1, 2, ... in recording order within the batch
    idx INTEGER NOT NULL,
    ok INTEGER NOT NULL,                         -- 1: response, 0: error
    payload BLOB NOT NULL,                       -- serialized BatchResult
    PRIMARY KEY (batch_id, seq),
    UNIQUE (batch_id, idx)
);
"""
# After the tables exist and every column is there (migrate): the listing of one tenant's batches, newest first.
INDEXES = "CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);"
MAX_SEQ = (1 << 63) - 1  # SQLite's largest INTEGER: no seq, and no page token, is beyond it
SQLITE_FULL, SQLITE_READONLY = 13, 8  # SQLite's primary result codes SQLITE_FULL, SQLITE_READONLY
TIMESTAMP_COLUMNS = {s: f"{s}_at_ms" for s in states.STATUSES if s != states.VALIDATING}


@dataclass(frozen=True)
class BatchRow:
    seq: int
    id: str
    status: str
    metadata: dict[str, str]
    errors: list[dict]
    completion_window_s: int
    max_concurrency: int
    total: int
    completed: int
    failed: int
    prompt_tokens: int
    completion_tokens: int
    owner: str
    tenant: str
    lease_until_ms: int
    created_at_ms: int
    expires_at_ms: int
    reached_ms: dict[str, int]  # status -> when it was reached (validating: created_at_ms)

    @property
    def terminal(self) -> bool:
        return self.status in states.TERMINAL

    @property
    def unfinished(self) -> int:
        return self.total - self.completed - self.failed


@dataclass(frozen=True)
class RequestRow:
    idx: int
    custom_id: str
    kind: str
    payload: bytes


@dataclass(frozen=True)
class NewResult:
    idx: int
    ok: bool
    prompt_tokens: int
    completion_tokens: int
    make_payload: Callable[[int], bytes]  # seq -> serialized BatchResult (the seq is known only inside the transaction)


_BATCH_COLUMNS = ("seq, id, status, metadata, errors, completion_window_s, max_concurrency, total, completed, "
                  "failed, prompt_tokens, completion_tokens, owner, tenant, lease_until_ms, created_at_ms, "
                  "expires_at_ms, " + ", ".join(TIMESTAMP_COLUMNS.values()))


class BatchStore:
    def __init__(self, path: Path):
        self.path = path
        try:
            private_dir(path.parent)
            private_file(path)  # SQLite gives its -wal and -shm files the database file's mode
            for companion in (path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                if companion.exists():  # left by a router that was killed
                    private_file(companion)
            # isolation_level=None: autocommit; every multi-statement change below is an explicit transaction.
            self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except (OSError, sqlite3.Error) as e:
            raise BatchStoreError(f"batch store {path} cannot be opened: {e} (set --batch-db to a writable "
                                  "file on a local filesystem)") from e
        if mode.lower() != "wal":
            raise BatchStoreError(f"batch store {path}: SQLite refused WAL journaling (journal_mode={mode!r}); "
                                  "put --batch-db on a local filesystem")
        # NORMAL in WAL mode: a commit survives a killed process (only power loss may drop the last commits).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=10000")
        self._db.executescript(SCHEMA)
        migrate(self._db, path, "batches", "tenant", "TEXT NOT NULL DEFAULT 'default'")
        self._db.executescript(INDEXES)

    def close(self) -> None:
        self._db.close()

    def _tx(self):
        return _Transaction(self._db, self.path)

    # ---- batches ----------------------------------------------------------------------------------------------
    def create(self, batch_id: str, input_kind: str, raw_input: bytes, metadata: dict[str, str], window_s: int,
               max_concurrency: int, owner: str, tenant: str, now_ms: int, lease_until_ms: int) -> BatchRow:
        with self._tx():
            self._db.execute(
                "INSERT INTO batches (id, status, input_kind, input, metadata, completion_window_s, max_concurrency,"
                " owner, tenant, lease_until_ms, created_at_ms, expires_at_ms) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (batch_id, states.VALIDATING, input_kind, raw_input, json.dumps(metadata), window_s,
                 max_concurrency, owner, tenant, lease_until_ms, now_ms, now_ms + window_s * 1000))
        return self.get(batch_id)

    def get(self, batch_id: str) -> BatchRow | None:
        row = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return _batch_row(row) if row else None

    def page(self, limit: int, before_seq: int | None, tenant: str | None) -> list[BatchRow]:
        """Newest first; `before_seq` continues after the previous page's last batch. Only `tenant`'s batches, or
        every tenant's for None."""
        where, args = where_clause(("seq < ?", before_seq), ("tenant = ?", tenant))
        rows = self._db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches{where} ORDER BY seq DESC LIMIT ?",
                                (*args, limit)).fetchall()
        return [_batch_row(r) for r in rows]

    def raw_input(self, batch_id: str) -> tuple[str, bytes]:
        kind, data = self._db.execute("SELECT input_kind, input FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return kind, data

    def status_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(states.STATUSES, 0)
        counts.update(self._db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall())
        return counts

    def transition(self, batch_id: str, old: frozenset[str] | set[str], new: str, now_ms: int,
                   errors: list[BatchIssue] = ()) -> bool:
        """Moves the batch to `new` if it is in one of `old`; records when. False if it was not."""
        for o in old:
            states.check_transition(o, new)
        marks = ",".join("?" * len(old))
        with self._tx():
            cur = self._db.execute(
                f"UPDATE batches SET status = ?, {TIMESTAMP_COLUMNS[new]} = ?"
                + (", errors = ?" if errors else "") + f" WHERE id = ? AND status IN ({marks})",
                (new, now_ms, *([json.dumps([vars(e) for e in errors])] if errors else []), batch_id, *old))
        return cur.rowcount == 1

    # ---- ownership --------------------------------------------------------------------------------------------
    def claimable(self, owner: str, now_ms: int) -> list[str]:
        """Non-terminal batches this owner may run: its own, and those whose owner's lease ran out."""
        marks = ",".join("?" * len(states.TERMINAL))
        rows = self._db.execute(
            f"SELECT id FROM batches WHERE status NOT IN ({marks}) AND (owner = ? OR lease_until_ms < ?) "
            "ORDER BY seq", (*states.TERMINAL, owner, now_ms)).fetchall()
        return [r[0] for r in rows]

    def claim(self, batch_id: str, owner: str, now_ms: int, lease_until_ms: int) -> bool:
        with self._tx():
            cur = self._db.execute("UPDATE batches SET owner = ?, lease_until_ms = ? WHERE id = ? AND "
                                   "(owner = ? OR lease_until_ms < ?)",
                                   (owner, lease_until_ms, batch_id, owner, now_ms))
        return cur.rowcount == 1

    def renew(self, batch_ids: list[str], owner: str, lease_until_ms: int) -> None:
        if batch_ids:
            with self._tx():
                self._db.executemany("UPDATE batches SET lease_until_ms = ? WHERE id = ? AND owner = ?",
                                     [(lease_until_ms, b, owner) for b in batch_ids])

    # ---- requests ---------------------------------------------------------------------------------------------
    def start(self, batch_id: str, requests: list[ParsedRequest], invalid_payload, now_ms: int) -> bool:
        """VALIDATING -> IN_PROGRESS with its requests, and the results of requests invalid from the start, in one
        transaction. `invalid_payload(request, seq)` serializes such a request's error result."""
        with self._tx():
            cur = self._db.execute(
                "UPDATE batches SET status = ?, in_progress_at_ms = ?, total = ?, input = NULL "
                "WHERE id = ? AND status = ?", (states.IN_PROGRESS, now_ms, len(requests), batch_id,
                                                states.VALIDATING))
            if cur.rowcount != 1:
                return False
            self._db.executemany(
                "INSERT INTO requests (batch_id, idx, custom_id, line, kind, payload) VALUES (?,?,?,?,?,?)",
                [(batch_id, r.idx, r.custom_id, r.line, r.kind, r.payload) for r in requests])
            invalid = [r for r in requests if r.kind == INVALID]
            self._db.executemany("INSERT INTO results (batch_id, seq, idx, ok, payload) VALUES (?,?,?,0,?)",
                                 [(batch_id, seq, r.idx, invalid_payload(r, seq))
                                  for seq, r in enumerate(invalid, start=1)])
            self._db.execute("UPDATE batches SET failed = ? WHERE id = ?", (len(invalid), batch_id))
        return True

    def pending(self, batch_id: str, after_idx: int, limit: int) -> list[RequestRow]:
        """Requests without a result, in input order, after `after_idx`."""
        rows = self._db.execute(
            "SELECT r.idx, r.custom_id, r.kind, r.payload FROM requests r WHERE r.batch_id = ? AND r.idx > ? AND "
            "NOT EXISTS (SELECT 1 FROM results s WHERE s.batch_id = r.batch_id AND s.idx = r.idx) "
            "ORDER BY r.idx LIMIT ?", (batch_id, after_idx, limit)).fetchall()
        return [RequestRow(*r) for r in rows]

    def begin_attempt(self, batch_id: str, idx: int) -> int:
        """Counts one more run of the request (persisted, so ids stay unique across restarts); returns its number."""
        with self._tx():
            self._db.execute("UPDATE requests SET attempts = attempts + 1 WHERE batch_id = ? AND idx = ?",
                             (batch_id, idx))
            return self._db.execute("SELECT attempts FROM requests WHERE batch_id = ? AND idx = ?",
                                    (batch_id, idx)).fetchone()[0]

    # ---- results ----------------------------------------------------------------------------------------------
    def record(self, batch_id: str, results: list[NewResult]) -> list[int]:
        """Records results and updates the batch's counts and usage in one transaction; returns their seqs."""
        seqs = []
        with self._tx():
            done, = self._db.execute("SELECT completed + failed FROM batches WHERE id = ?", (batch_id,)).fetchone()
            try:
                for i, r in enumerate(results, start=done + 1):
                    self._db.execute("INSERT INTO results (batch_id, seq, idx, ok, payload) VALUES (?,?,?,?,?)",
                                     (batch_id, i, r.idx, int(r.ok), r.make_payload(i)))
                    seqs.append(i)
            except sqlite3.IntegrityError as e:
                raise DuplicateResult(f"batch {batch_id}: request index {r.idx} already has a result ({e})") from e
            ok = sum(r.ok for r in results)
            self._db.execute(
                "UPDATE batches SET completed = completed + ?, failed = failed + ?, prompt_tokens = prompt_tokens + ?,"
                " completion_tokens = completion_tokens + ? WHERE id = ?",
                (ok, len(results) - ok, sum(r.prompt_tokens for r in results),
                 sum(r.completion_tokens for r in results), batch_id))
        return seqs

    def unfinished(self, batch_id: str) -> list[tuple[int, str]]:
        """(idx, custom_id) of every request without a result."""
        return self._db.execute(
            "SELECT r.idx, r.custom_id FROM requests r WHERE r.batch_id = ? AND NOT EXISTS (SELECT 1 FROM results s"
            " WHERE s.batch_id = r.batch_id AND s.idx = r.idx) ORDER BY r.idx", (batch_id,)).fetchall()

    def results(self, batch_id: str, after_seq: int, limit: int) -> list[bytes]:
        rows = self._db.execute("SELECT payload FROM results WHERE batch_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                                (batch_id, after_seq, limit)).fetchall()
        return [r[0] for r in rows]

    def result_count(self, batch_id: str) -> int:
        return self._db.execute("SELECT COUNT(*) FROM results WHERE batch_id = ?", (batch_id,)).fetchone()[0]


class _Transaction:
    """BEGIN IMMEDIATE (takes the write lock up front, so two routers never deadlock on an upgrade) ... COMMIT,
    ROLLBACK on an exception. A write the filesystem refuses (full, read-only) is rolled back whole and raised as a
    named BatchStoreError naming the file; nothing of it reaches the database."""

    def __init__(self, db: sqlite3.Connection, path: Path):
        self._db, self._path = db, path

    def __enter__(self):
        try:
            self._db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:
            raise write_error(self._path, e) from e

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self._db.execute("COMMIT")
                return False
            except sqlite3.OperationalError as e:
                self._rollback()
                raise write_error(self._path, e) from e
        self._rollback()
        if isinstance(exc, sqlite3.OperationalError):
            raise write_error(self._path, exc) from exc
        return False

    def _rollback(self) -> None:
        if self._db.in_transaction:  # SQLite may have rolled back already (e.g. after SQLITE_FULL)
            self._db.execute("ROLLBACK")


def migrate(db: sqlite3.Connection, path: Path, table: str, column: str, declaration: str) -> None:
    """Adds `column` to `table` of a database made before it existed (its rows get the declaration's default), in
    one transaction that also rechecks, so routers starting together on one file add it once."""
    with _Transaction(db, path):
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
            log.info("batch store migrated", extra={"db": str(path), "table": table, "added_column": column})


def where_clause(*conditions: tuple[str, object]) -> tuple[str, list]:
    """(" WHERE c1 AND c2 ...", their arguments) of the (condition, argument) pairs whose argument is not None: the
    optional filters of a page query ("" when none applies)."""
    used = [(c, a) for c, a in conditions if a is not None]
    return (" WHERE " + " AND ".join(c for c, _ in used) if used else ""), [a for _, a in used]


def write_error(path: Path, e: sqlite3.OperationalError) -> BatchStoreError:
    """The named error for a write SQLite could not make (sqlite_errorcode needs Python 3.11; older: generic)."""
    primary = (getattr(e, "sqlite_errorcode", None) or 0) & 0xFF
    if primary == SQLITE_FULL:
        return BatchStoreFull(f"batch store {path}: the disk is full ({e}); batch results cannot be recorded "
                              "until space is freed")
    if primary == SQLITE_READONLY:
        return BatchStoreReadOnly(f"batch store {path}: the file or its filesystem is read-only ({e})")
    return BatchStoreError(f"batch store {path}: write failed: {e}")


def _batch_row(r: tuple) -> BatchRow:
    (seq, bid, status, metadata, errors, window, conc, total, completed, failed, pt, ct, owner, tenant, lease,
     created, expires, *stamps) = r
    reached = {states.VALIDATING: created}
    reached.update({s: v for s, v in zip(TIMESTAMP_COLUMNS, stamps) if v is not None})
    return BatchRow(seq, bid, status, json.loads(metadata), json.loads(errors), window, conc, total, completed,
                    failed, pt, ct, owner, tenant, lease, created, expires, reached)
