"""Tenants that cannot see each other, against a real router (`kimiserve router --api-keys-file ... --http-port`) with
three keys: alice, bob, and ops (an admin). Files and batches are reached over HTTP with the official openai SDK and
over gRPC: another tenant's are NOT_FOUND / 404 on every route, with the answer an id never issued gets; listings
hold only the caller's; the admin reads all and changes only its own. Also: page tokens and `after` cursors that
are no cursor, ids far too long to echo, and the modes of the batch database and its directory."""

from __future__ import annotations

import io
import json
import os
import re
import stat
import time

import grpc
import httpx
import openai
import pytest
from openai import OpenAI

from kimiserve.ports import free_port
from kimiserve.v1 import common_pb2, router_pb2
from tests.router.batch.conftest import TERMINAL, RouterProc

KEYS = {"alice": "key-alice-0123", "bob": "key-bob-4567", "ops": "key-ops-89ab"}
KEYS_FILE = f"""# tenants of the test deployment
{KEYS['alice']} alice
{KEYS['bob']}\tbob   # a tab works as well
{KEYS['ops']} ops admin
"""
LINES = "".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"prompt": f"secret prompt {i}", "max_tokens": 2, "temperature": 0}}) + "\n"
                for i in range(3)).encode()
NEVER_ISSUED_FILE, NEVER_ISSUED_BATCH = "file-" + "0" * 32, "batch_" + "0" * 32


class Tenants:
    def __init__(self, router: RouterProc, http_port: int):
        self.router = router
        self.base = f"http://127.0.0.1:{http_port}/v1"
        self.http = {name: OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=60)
                     for name, key in KEYS.items()}

    def md(self, name: str) -> tuple[tuple[str, str]]:
        return (("authorization", f"Bearer {KEYS[name]}"),)

    def grpc_error(self, name: str, rpc: str, request) -> grpc.RpcError:
        """Calls `rpc` as tenant `name`, expecting it to fail; returns the error (drains a stream)."""
        with pytest.raises(grpc.RpcError) as refused:
            reply = getattr(self.router.stub, rpc)(request, metadata=self.md(name), timeout=30)
            if rpc == "GetBatchResults":
                list(reply)
        return refused.value

    def batch(self, name: str, batch_id: str) -> router_pb2.Batch:
        return self.router.stub.GetBatch(router_pb2.GetBatchRequest(batch_id=batch_id), metadata=self.md(name),
                                         timeout=30)

    def wait(self, name: str, batch_id: str, timeout: float = 120) -> router_pb2.Batch:
        end = time.monotonic() + timeout
        while (b := self.batch(name, batch_id)).status not in TERMINAL:
            assert time.monotonic() < end, f"batch {batch_id} not terminal after {timeout} s: {b}"
            time.sleep(0.05)
        return b

    def upload(self, name: str) -> str:
        return self.http[name].files.create(file=("in.jsonl", io.BytesIO(LINES)), purpose="batch").id

    def http_batch(self, name: str) -> str:
        """A batch of `name`'s, created over HTTP from its own upload and run to completion."""
        batch = self.http[name].batches.create(input_file_id=self.upload(name), endpoint="/v1/completions",
                                              completion_window="24h")
        assert self.wait(name, batch.id).status == router_pb2.BATCH_STATUS_COMPLETED
        return batch.id


@pytest.fixture(scope="module")
def tenants(backends, tmp_path_factory) -> Tenants:
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys").write_text(KEYS_FILE)
    http_port = free_port()
    # The database's directory does not exist yet: the router creates it (0700) and the file (0600).
    r = RouterProc(backends, tmp / "state" / "batches.sqlite3", tmp / "router.log",
                   ("--api-keys-file", str(tmp / "keys"), "--http-port", str(http_port))).start()
    yield Tenants(r, http_port)
    r.close()


def _generic(message: str) -> str:
    """An error message with the file / batch ids and the request id it names made generic."""
    return re.sub(r"(file-|batch_)[0-9a-f]{32}", "ID", re.sub(r" \(request_id=[^)]*\)", "", message))


def _same_answer(a: str, b: str) -> bool:
    """Two refusals say the same, but for the ids they name."""
    return _generic(a) == _generic(b)


def test_another_tenants_file_does_not_exist_for_it_over_http(tenants):
    alice, bob, ops = (tenants.http[n] for n in ("alice", "bob", "ops"))
    mine = tenants.upload("alice")
    for call in (lambda f: bob.files.retrieve(f), lambda f: bob.files.content(f), lambda f: bob.files.delete(f),
                 lambda f: bob.batches.create(input_file_id=f, endpoint="/v1/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError) as foreign:
            call(mine)
        with pytest.raises(openai.NotFoundError) as never:
            call(NEVER_ISSUED_FILE)
        assert _same_answer(foreign.value.message, never.value.message), (foreign.value.message,
                                                                           never.value.message)
    assert mine not in [f.id for f in bob.files.list().data]
    with pytest.raises(openai.BadRequestError) as cursor:  # not a cursor of bob's: refused naming the field
        bob.files.list(after=mine)
    assert cursor.value.param == "after"
    assert alice.files.content(mine).content == LINES  # bob's attempts changed nothing

    # The admin reads it, and does not change it.
    assert mine in [f.id for f in ops.files.list().data]
    assert ops.files.retrieve(mine).id == mine and ops.files.content(mine).content == LINES
    with pytest.raises(openai.PermissionDeniedError, match="tenant 'alice'"):
        ops.files.delete(mine)
    with pytest.raises(openai.PermissionDeniedError, match="tenant 'alice'"):
        ops.batches.create(input_file_id=mine, endpoint="/v1/completions", completion_window="24h")
    assert alice.files.delete(mine).deleted


def test_another_tenants_batch_does_not_exist_for_it_over_http(tenants):
    alice, bob, ops = (tenants.http[n] for n in ("alice", "bob", "ops"))
    batch_id = tenants.http_batch("alice")
    done = alice.batches.retrieve(batch_id)
    output = alice.files.content(done.output_file_id).content
    assert b"secret prompt" not in output and len(output.splitlines()) == 3

    generated = done.output_file_id.replace(batch_id, NEVER_ISSUED_BATCH)
    for call, never_issued in ((lambda: bob.batches.retrieve(batch_id),
                                lambda: bob.batches.retrieve(NEVER_ISSUED_BATCH)),
                               (lambda: bob.batches.cancel(batch_id), lambda: bob.batches.cancel(NEVER_ISSUED_BATCH)),
                               (lambda: bob.files.content(done.output_file_id), lambda: bob.files.content(generated)),
                               (lambda: bob.files.retrieve(done.output_file_id), lambda: bob.files.retrieve(generated)),
                               (lambda: bob.files.delete(done.output_file_id), lambda: bob.files.delete(generated))):
        with pytest.raises(openai.NotFoundError) as foreign:
            call()
        with pytest.raises(openai.NotFoundError) as never:
            never_issued()
        assert _same_answer(foreign.value.message, never.value.message)
    assert batch_id not in [b.id for b in bob.batches.list(limit=100).data]
    with pytest.raises(openai.BadRequestError) as cursor:
        bob.batches.list(after=batch_id)
    assert cursor.value.param == "after"

    assert batch_id in [b.id for b in ops.batches.list(limit=100).data]
    assert ops.files.content(done.output_file_id).content == output
    with pytest.raises(openai.PermissionDeniedError, match="tenant 'alice'"):
        ops.batches.cancel(batch_id)


def test_another_tenants_batch_does_not_exist_for_it_over_grpc(tenants):
    stub, md = tenants.router.stub, tenants.md
    created = stub.CreateBatch(router_pb2.CreateBatchRequest(jsonl=LINES.decode()), metadata=md("alice"), timeout=30)
    # Refused while it runs: a cancel that worked would end it CANCELLED.
    for rpc, request in (("GetBatch", router_pb2.GetBatchRequest(batch_id=created.id)),
                         ("CancelBatch", router_pb2.CancelBatchRequest(batch_id=created.id)),
                         ("GetBatchResults", router_pb2.GetBatchResultsRequest(batch_id=created.id))):
        foreign = tenants.grpc_error("bob", rpc, request)
        request.batch_id = NEVER_ISSUED_BATCH
        never = tenants.grpc_error("bob", rpc, request)
        assert foreign.code() == never.code() == grpc.StatusCode.NOT_FOUND, (rpc, foreign.details())
        assert _same_answer(foreign.details(), never.details()), (foreign.details(), never.details())
    denied = tenants.grpc_error("ops", "CancelBatch", router_pb2.CancelBatchRequest(batch_id=created.id))
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED and "tenant 'alice'" in denied.details()

    done = tenants.wait("alice", created.id)
    assert (done.status, done.request_counts.completed) == (router_pb2.BATCH_STATUS_COMPLETED, 3)
    results = list(stub.GetBatchResults(router_pb2.GetBatchResultsRequest(batch_id=created.id),
                                        metadata=md("alice"), timeout=30))
    assert sorted(r.custom_id for r in results) == ["q0", "q1", "q2"]
    assert list(stub.GetBatchResults(router_pb2.GetBatchResultsRequest(batch_id=created.id), metadata=md("ops"),
                                     timeout=30)) == results  # the admin reads them
    assert tenants.batch("ops", created.id).id == created.id

    def listed(name: str) -> set[str]:
        return {b.id for b in stub.ListBatches(router_pb2.ListBatchesRequest(page_size=100), metadata=md(name),
                                               timeout=30).batches}
    bobs = stub.CreateBatch(router_pb2.CreateBatchRequest(jsonl=LINES.decode()), metadata=md("bob"), timeout=30).id
    assert created.id not in listed("bob") and bobs in listed("bob")
    assert bobs not in listed("alice") and created.id in listed("alice")
    assert {created.id, bobs} <= listed("ops")
    tenants.wait("bob", bobs)

    # Each request ran as its batch's tenant: the router's log line of every request names it.
    finished = [e for e in tenants.router.logs() if e.get("msg") == "request finished"
                and e.get("request_id", "").startswith(created.id)]
    assert len(finished) == 3 and {e["tenant"] for e in finished} == {"alice"}


def test_page_tokens_and_cursors_that_are_no_cursor_name_the_field(tenants):
    for token in ("99999999999999999999999999", "9" * 100_000, "-1", "abc", "0", "١٢"):
        refused = tenants.grpc_error("alice", "ListBatches", router_pb2.ListBatchesRequest(page_token=token))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "page_token" in refused.details(), token[:30]
    batch_id = tenants.router.stub.CreateBatch(router_pb2.CreateBatchRequest(jsonl=LINES.decode()),
                                               metadata=tenants.md("alice"), timeout=30).id
    refused = tenants.grpc_error("alice", "GetBatchResults",
                                 router_pb2.GetBatchResultsRequest(batch_id=batch_id, after_seq=(1 << 64) - 1))
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "after_seq" in refused.details()
    alice = tenants.http["alice"]
    for call, field in ((lambda: alice.batches.list(after="x" * 10_000), "after"),
                        (lambda: alice.files.list(after="x" * 10_000), "after"),
                        (lambda: alice.batches.list(limit=0), "limit"),
                        (lambda: alice.batches.list(limit=99999999999999999999999999), "limit"),
                        (lambda: alice.files.list(limit=10_001), "limit")):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.param == field and len(refused.value.message) < 500, refused.value.message


def test_an_id_too_long_to_echo_is_not_found_and_clipped(tenants):
    long_id = "b" * 100_000
    for rpc, request in (("GetBatch", router_pb2.GetBatchRequest(batch_id=long_id)),
                         ("CancelBatch", router_pb2.CancelBatchRequest(batch_id=long_id)),
                         ("GetBatchResults", router_pb2.GetBatchResultsRequest(batch_id=long_id))):
        refused = tenants.grpc_error("alice", rpc, request)
        assert refused.code() == grpc.StatusCode.NOT_FOUND, (rpc, refused.code())
        assert "(100000 chars)" in refused.details() and len(refused.details()) < 500
    # Other names a client sends come back clipped too: a model name (router), a chat role (tokenizer).
    for rpc, request, code in (
            ("Generate", router_pb2.GenerateRequest(text="hi", model="m" * 100_000), grpc.StatusCode.NOT_FOUND),
            ("Chat", router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(role="r" * 100_000, content="hi")]),
             grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as refused:
            list(getattr(tenants.router.stub, rpc)(request, metadata=tenants.md("alice"), timeout=30))
        assert refused.value.code() == code and "(100000 chars)" in refused.value.details(), refused.value.details()
    long_id = "f" * 10_000  # an HTTP request line is bounded too (uvicorn/h11): long, yet within it
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    for method, path in (("GET", f"/files/{long_id}"), ("GET", f"/files/{long_id}/content"),
                         ("DELETE", f"/files/{long_id}"), ("GET", f"/batches/{long_id}"),
                         ("POST", f"/batches/{long_id}/cancel")):
        reply = httpx.request(method, tenants.base + path, headers=headers, timeout=30)
        message = reply.json()["error"]["message"]
        assert reply.status_code == 404 and "(10000 chars)" in message and len(message) < 500, (path, message)


def test_the_batch_database_and_its_directory_are_private(tenants):
    db = tenants.router.db
    tenants.upload("alice")  # something written: the WAL file exists while the router runs
    assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700
    for path in (db, db.with_name(db.name + "-wal"), db.with_name(db.name + "-shm")):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


def test_the_prefix_cache_answers_no_tenant_about_another(tenants):
    """The issue's probe: alice's chat names a secret; bob (over gRPC) and the admin ops (over HTTP) send the same
    prompt, the right guess, and see no cached tokens; alice's own repeat still hits in full."""
    messages = [{"role": "user", "content": "The vault code of Mr 893005 is 45"}]

    def chat(name: str):
        return tenants.http[name].chat.completions.create(model="", messages=messages, max_tokens=1, temperature=0)

    first = chat("alice")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    request = router_pb2.ChatRequest(messages=[common_pb2.ChatMessage(**m) for m in messages],
                                     sampling=common_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    last = list(tenants.router.stub.Chat(request, metadata=tenants.md("bob"), timeout=60))[-1]
    assert last.usage.prompt_tokens == first.usage.prompt_tokens and last.usage.cached_prompt_tokens == 0
    assert chat("ops").usage.prompt_tokens_details.cached_tokens == 0  # an admin key reads files, not prompts
    again = chat("alice")  # the same tenant shares its own prefixes as before
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens > 0


def test_a_request_id_live_for_one_tenant_is_neither_refused_nor_revealed_to_another(tenants):
    """alice streams under the id `shared-7`; bob sends the same id meanwhile and is served (no ALREADY_EXISTS that
    would tell him alice has it live), both get their whole replies, and each id is still refused to its own tenant
    while live."""
    def generate(name: str, max_tokens: int):
        return tenants.router.stub.Generate(router_pb2.GenerateRequest(
            request_id="shared-7", prompt_token_ids=common_pb2.TokenIds(ids=[5, 6, 7]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)),
            metadata=tenants.md(name), timeout=120)

    alice = generate("alice", 200)
    first = next(alice)  # alice's request is live from here until her stream ends
    with pytest.raises(grpc.RpcError) as own:
        list(generate("alice", 2))
    assert own.value.code() == grpc.StatusCode.ALREADY_EXISTS and "'shared-7' is already live" in own.value.details()
    bob = list(generate("bob", 2))
    assert sum(len(c.token_ids) for c in bob) == 2 and bob[-1].usage.completion_tokens == 2
    rest = list(alice)
    assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == 200
