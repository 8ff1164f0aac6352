"""The SQLite store on its own: WAL, transitions, exactly one result per request, paging, leases, tenants (and the
migration of a database from before them), private file modes."""

import os
import sqlite3
import stat

import grpc
import pytest

from kimiserve.v1 import router_pb2
from router.batch import states
from router.batch.errors import BatchStoreReadOnly, DuplicateResult
from router.batch.parse import parse_jsonl
from router.batch.files import FileStore, StoredFile
from router.batch.store import BatchStore, NewResult

# The tables that gained a `tenant` column, as a router before tenants created them.
PRE_TENANT_SCHEMA = """
CREATE TABLE batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, status TEXT NOT NULL, input_kind TEXT NOT NULL,
    input BLOB, metadata TEXT NOT NULL, errors TEXT NOT NULL DEFAULT '[]', completion_window_s INTEGER NOT NULL,
    max_concurrency INTEGER NOT NULL, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0, owner TEXT NOT NULL, lease_until_ms INTEGER NOT NULL,
    created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, in_progress_at_ms INTEGER,
    finalizing_at_ms INTEGER, completed_at_ms INTEGER, failed_at_ms INTEGER, expired_at_ms INTEGER,
    cancelling_at_ms INTEGER, cancelled_at_ms INTEGER);
CREATE TABLE files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL, bytes INTEGER NOT NULL,
                    created_at_ms INTEGER NOT NULL, content BLOB NOT NULL);
INSERT INTO batches (id, status, input_kind, metadata, completion_window_s, max_concurrency, owner, lease_until_ms,
                     created_at_ms, expires_at_ms)
    VALUES ('batch_old', 'completed', 'jsonl', '{}', 60, 1, 'r0', 0, 5, 65);
INSERT INTO files VALUES ('file-old', 'batch', 'old.jsonl', 2, 5, X'7B7D');
"""


def jsonl(n, bad=()):
    lines = []
    for i in range(n):
        url = "/v1/nope" if i in bad else "/v1/completions"
        lines.append(f'{{"custom_id": "r{i}", "url": "{url}", "body": {{"prompt": "p{i}"}}}}')
    return "\n".join(lines)


def payload_of(custom_id, code=None):
    def make(seq):
        r = router_pb2.BatchResult(custom_id=custom_id, seq=seq)
        if code:
            r.error.code = code
        else:
            r.response.text = "x"
        return r.SerializeToString()
    return make


@pytest.fixture
def store(tmp_path):
    s = BatchStore(tmp_path / "sub" / "b.sqlite3")
    yield s
    s.close()


def new_batch(store, batch_id="batch_a", n=4, bad=(), owner="r1", now=1000):
    store.create(batch_id, "jsonl", jsonl(n, bad).encode(), {"k": "v"}, 60, 2, owner, "default", now, now + 30_000)
    parsed = parse_jsonl(jsonl(n, bad))

    def invalid(r, seq):
        return payload_of(r.custom_id, r.error[0])(seq)

    assert store.start(batch_id, parsed.requests, invalid, now + 1)
    return parsed


def test_wal_and_lifecycle(store, tmp_path):
    assert sqlite3.connect(tmp_path / "sub" / "b.sqlite3").execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    row = store.create("batch_a", "jsonl", b"{}", {"k": "v"}, 60, 2, "r1", "default", 1000, 31_000)
    assert (row.status, row.expires_at_ms, row.metadata, row.reached_ms) == (states.VALIDATING, 61_000, {"k": "v"},
                                                                            {states.VALIDATING: 1000})
    assert store.transition("batch_a", {states.VALIDATING}, states.CANCELLING, 1500)
    assert not store.transition("batch_a", {states.VALIDATING}, states.CANCELLING, 1600)  # not validating anymore
    assert store.transition("batch_a", {states.CANCELLING}, states.CANCELLED, 1700)
    row = store.get("batch_a")
    assert row.terminal and row.reached_ms == {"validating": 1000, "cancelling": 1500, "cancelled": 1700}
    with pytest.raises(ValueError, match="cannot move"):
        store.transition("batch_a", {states.CANCELLED}, states.IN_PROGRESS, 1800)


def test_start_records_invalid_requests_and_pending_excludes_them(store):
    new_batch(store, n=5, bad=(1, 3))
    row = store.get("batch_a")
    assert (row.status, row.total, row.completed, row.failed) == (states.IN_PROGRESS, 5, 0, 2)
    assert [r.custom_id for r in store.pending("batch_a", -1, 10)] == ["r0", "r2", "r4"]
    assert [r.custom_id for r in store.pending("batch_a", 0, 10)] == ["r2", "r4"]
    blobs = [router_pb2.BatchResult.FromString(b) for b in store.results("batch_a", 0, 10)]
    assert [(b.seq, b.custom_id, b.error.code) for b in blobs] == [(1, "r1", "invalid_request"),
                                                                   (2, "r3", "invalid_request")]


def test_exactly_one_result_per_request(store):
    new_batch(store, n=3)
    assert store.record("batch_a", [NewResult(0, True, 5, 7, payload_of("r0"))]) == [1]
    with pytest.raises(DuplicateResult, match="index 0 already has a result"):
        store.record("batch_a", [NewResult(0, True, 5, 7, payload_of("r0"))])
    row = store.get("batch_a")  # the refused duplicate changed nothing
    assert (row.completed, row.failed, row.prompt_tokens, row.completion_tokens) == (1, 0, 5, 7)
    assert store.record("batch_a", [NewResult(2, False, 0, 0, payload_of("r2", "x")),
                                    NewResult(1, True, 1, 1, payload_of("r1"))]) == [2, 3]
    assert store.unfinished("batch_a") == [] and store.result_count("batch_a") == 3
    assert [router_pb2.BatchResult.FromString(b).seq for b in store.results("batch_a", 1, 10)] == [2, 3]


def test_attempts_persist(store):
    new_batch(store, n=1)
    assert [store.begin_attempt("batch_a", 0) for _ in range(3)] == [1, 2, 3]


def test_paging_newest_first(store):
    for i in range(5):
        store.create(f"batch_{i}", "jsonl", b"", {}, 60, 1, "r1", "default", 1000 + i, 0)
    first = store.page(2, None, None)
    assert [r.id for r in first] == ["batch_4", "batch_3"]
    assert [r.id for r in store.page(2, first[-1].seq, None)] == ["batch_2", "batch_1"]
    assert store.status_counts()[states.VALIDATING] == 5


def test_leases(store):
    store.create("batch_a", "jsonl", b"", {}, 60, 1, "r1", "default", 1000, 5000)
    assert store.claimable("r1", 2000) == ["batch_a"]  # its own
    assert store.claimable("r2", 2000) == []  # r1's lease holds
    assert not store.claim("batch_a", "r2", 2000, 9000)
    assert store.claimable("r2", 6000) == ["batch_a"]  # lease ran out
    assert store.claim("batch_a", "r2", 6000, 36_000)
    assert store.get("batch_a").owner == "r2" and store.claimable("r1", 7000) == []


def test_a_write_the_file_refuses_is_rolled_back_and_named(tmp_path):
    """A store whose file turned read-only (its connection can no longer write): the write raises
    BatchStoreReadOnly naming the file, answered UNAVAILABLE, and leaves nothing behind. (A full disk, answered
    RESOURCE_EXHAUSTED, is tested on a real tmpfs in tests/reliability/test_faults.py.)"""
    path = tmp_path / "b.sqlite3"
    store = BatchStore(path)
    store.create("b1", "jsonl", jsonl(1).encode(), {}, 60, 4, "me", "default", 0, 10)
    store._db.close()
    store._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None, check_same_thread=False)
    with pytest.raises(BatchStoreReadOnly, match=f"batch store {path}: the file or its filesystem is read-only"
                       ) as refused:
        store.create("b2", "jsonl", jsonl(1).encode(), {}, 60, 4, "me", "default", 0, 10)
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert not store._db.in_transaction
    assert store.get("b1") is not None and store.get("b2") is None


def test_paging_lists_one_tenants_batches_or_everyones(store):
    for i, tenant in enumerate(["alice", "bob", "alice", "bob", "alice"]):
        store.create(f"batch_{i}", "jsonl", b"", {}, 60, 1, "r1", tenant, 1000 + i, 0)
    assert [r.id for r in store.page(10, None, "alice")] == ["batch_4", "batch_2", "batch_0"]
    assert [r.id for r in store.page(1, store.page(1, None, "bob")[0].seq, "bob")] == ["batch_1"]
    assert [r.id for r in store.page(10, None, None)] == [f"batch_{i}" for i in range(4, -1, -1)]
    assert store.get("batch_3").tenant == "bob"


def test_a_database_from_before_tenants_is_migrated_to_the_default_tenant(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript(PRE_TENANT_SCHEMA)
    old.close()
    os.chmod(path, 0o644)  # as an old router left it: readable by every local user
    store, files = BatchStore(path), FileStore(path)
    assert store.get("batch_old").tenant == "default"
    assert [r.id for r in store.page(10, None, "default")] == ["batch_old"] and store.page(10, None, "x") == []
    assert files.get("file-old").tenant == "default"
    files.add(StoredFile("file-new", "batch", "n.jsonl", 2, 6, "acme"), b"{}")
    assert [f.id for f in files.page(10, None, True, None, "acme")[0]] == ["file-new"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # tightened
    files.close()
    store.close()
    BatchStore(path).close()  # opening it again: already migrated, nothing to add


def test_the_store_creates_its_directories_and_file_private(tmp_path):
    path = tmp_path / "a" / "b" / "batches.sqlite3"
    before = os.umask(0o022)  # the usual umask, which would leave them 0755 / 0644
    try:
        BatchStore(path).close()
    finally:
        os.umask(before)
    assert [stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "a", tmp_path / "a" / "b", path)] == \
        [0o700, 0o700, 0o600]
