"""/v1/files and /v1/batches over the router's durable batch jobs (router/batch): an uploaded JSONL file becomes a
batch through the same runner as the CreateBatch RPC, and the output / error files are rendered from the batch's
stored results in OpenAI's line shapes. Files, batches and their output / error files belong to the tenant that
created them (see Batches)."""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Callable

from kimiserve.kimi_chat import ToolCall
from kimiserve.tenants import Tenant
from kimiserve.text import clip
from kimiserve.v1 import router_pb2
from router.batch import states
from router.batch.errors import BatchNotFound
from router.batch.files import BatchInput, FileNotFound, FileStore, StoredFile
from router.batch.parse import CHAT, RESPONSES, URLS
from router.batch.runner import BatchRunner
from router.batch.store import BatchRow
from router.errors import InvalidArgument, PermissionDenied, error_body, http_status
from router.flow import Reply
from router.http import replies, responses, schemas
from router.openai_body import BodyError
from router.openai_responses import ResponsesOptions, responses_request

NON_HTTP_ERRORS = ("batch_cancelled", "batch_expired")  # OpenAI's `error` field: failures that are not an HTTP answer
OUTPUT, ERRORS = "output", "errors"
GENERATED_PURPOSES = (f"batch_{OUTPUT}", f"batch_{ERRORS}")
_GENERATED = r"file-(batch_[0-9a-f]{32})-(output|errors)"  # a batch's output / error file, rendered when read
_WINDOW = re.compile(r"^([1-9][0-9]*)h$")


class Batches:
    """Every operation takes the caller's tenant (kimiserve/tenants.py). A file or batch it may not read does not
    exist for it: 404 with the message an id never issued gets, so ids and errors say nothing across tenants. An
    admin reads everything and changes only its own (another tenant's: 403)."""

    def __init__(self, runner: BatchRunner, files: FileStore, model: Callable[[], str]):
        self.runner, self.files, self.model = runner, files, model

    # ---- files ------------------------------------------------------------------------------------------------
    def upload(self, purpose: str, filename: str, content: bytes, tenant: Tenant) -> schemas.FileObject:
        if purpose != "batch":
            raise InvalidArgument(f"purpose must be 'batch' (the only use of files here), got {clip(purpose)}",
                                  "purpose")
        try:
            content.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"file {clip(filename)} is not UTF-8 text (byte {e.start})", "file") from None
        f = StoredFile(f"file-{uuid.uuid4().hex}", purpose, filename, len(content), int(time.time() * 1000),
                       tenant.name)
        self.files.add(f, content)
        return _file_object(f)

    def _uploaded(self, file_id: str, tenant: Tenant) -> StoredFile | None:
        """The uploaded file `file_id` if `tenant` may read it; None if there is none it may read."""
        stored = self.files.get(file_id)
        return stored if stored is not None and tenant.reads(stored.tenant) else None

    def _changeable(self, file_id: str, tenant: Tenant) -> StoredFile:
        stored = self._uploaded(file_id, tenant)
        if stored is None:
            raise FileNotFound(f"no file {clip(file_id)}")
        if not tenant.changes(stored.tenant):  # an admin, who may read it: it knows the file exists
            raise PermissionDenied(f"file {file_id} belongs to tenant {stored.tenant!r}; an admin key reads other "
                                   "tenants' files but does not change them or run batches from them")
        return stored

    def file(self, file_id: str, tenant: Tenant) -> schemas.FileObject:
        stored = self._uploaded(file_id, tenant)
        if stored is not None:
            return _file_object(stored)
        batch_id, which = self._generated(file_id)
        row = self.runner.get(batch_id, tenant)
        return schemas.FileObject(id=file_id, bytes=len(self._render(row, which)), created_at=_s(row.created_at_ms),
                                  filename=f"{batch_id}_{which}.jsonl", purpose=f"batch_{which}")

    def files_page(self, limit: int, after: str | None, order: str, purpose: str | None,
                   tenant: Tenant) -> schemas.FileList:
        """Uploaded files of `tenant` (an admin: everyone's), OpenAI's list shape. A batch's output and error files
        are not listed: they are reached from the batch (output_file_id, error_file_id), so filtering on their
        purposes is refused rather than answered with an empty list."""
        if purpose in GENERATED_PURPOSES:
            raise InvalidArgument(f"purpose={purpose!r}: a batch's output and error files are not listed; read "
                                  "output_file_id / error_file_id of GET /v1/batches/{batch_id}", "purpose")
        try:
            stored, more = self.files.page(limit, after, order == "desc", purpose,
                                           None if tenant.admin else tenant.name)
        except FileNotFound as e:
            raise BodyError(f"after: {e}", "after") from None
        data = [_file_object(f) for f in stored]
        return schemas.FileList.of(data, more)

    def delete(self, file_id: str, tenant: Tenant) -> schemas.FileDeleted:
        """Deletes an uploaded file (refused while a batch created from it has not ended: FileInUse). A batch's
        output and error files are its results, kept as long as the batch is: deleting one is refused."""
        if self._uploaded(file_id, tenant) is None and re.fullmatch(_GENERATED, file_id):
            batch_id = self._generated(file_id)[0]
            self.runner.get(batch_id, tenant)  # BatchNotFound when it has no such batch
            raise InvalidArgument(f"file {file_id!r} is rendered from the results of batch {batch_id!r} and lasts "
                                  "as long as the batch; it cannot be deleted on its own", "file_id")
        self._changeable(file_id, tenant)
        self.files.delete(file_id)
        return schemas.FileDeleted(id=file_id)

    def content(self, file_id: str, tenant: Tenant) -> bytes:
        if self._uploaded(file_id, tenant) is not None:
            return self.files.content(file_id)
        batch_id, which = self._generated(file_id)
        return self._render(self.runner.get(batch_id, tenant), which)

    def _generated(self, file_id: str) -> tuple[str, str]:
        match = re.fullmatch(_GENERATED, file_id)
        if match is None:
            raise FileNotFound(f"no file {clip(file_id)}")
        return match.group(1), match.group(2)

    # ---- batches ----------------------------------------------------------------------------------------------
    def create(self, body: dict, tenant: Tenant) -> schemas.BatchObject:
        file_id, endpoint, window = body.get("input_file_id"), body.get("endpoint"), body.get("completion_window")
        if endpoint not in URLS:
            raise InvalidArgument(f"endpoint must be one of {list(URLS)}, got {clip(endpoint)}", "endpoint")
        match = _WINDOW.match(window) if isinstance(window, str) else None
        if match is None:
            raise InvalidArgument(f"completion_window must be hours like '24h', got {clip(window)}",
                                  "completion_window")
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise InvalidArgument("metadata must be an object of strings", "metadata")
        if not isinstance(file_id, str) or self._uploaded(file_id, tenant) is None:
            raise FileNotFound(f"no file {clip(file_id)}; upload it with POST /v1/files (purpose=batch) first")
        self._changeable(file_id, tenant)
        req = router_pb2.CreateBatchRequest(jsonl=self.files.content(file_id).decode("utf-8"), metadata=metadata,
                                            completion_window_s=int(match.group(1)) * 3600)
        row = self.runner.create(req, tenant)
        self.files.link(row.id, BatchInput(file_id, endpoint, window))
        return self.batch(row.id, tenant)

    def batch(self, batch_id: str, tenant: Tenant) -> schemas.BatchObject:
        return self._object(self.runner.get(batch_id, tenant))

    def cancel(self, batch_id: str, tenant: Tenant) -> schemas.BatchObject:
        return self._object(self.runner.cancel(batch_id, tenant))

    def page(self, limit: int, after: str | None, tenant: Tenant) -> schemas.BatchList:
        """`tenant`'s batches (an admin: everyone's), newest first, after the batch `after` (the last id of the
        previous page), which must be one the tenant sees."""
        try:
            token = str(self.runner.get(after, tenant).seq) if after else ""
        except BatchNotFound as e:
            raise BodyError(f"after: {e} (the `after` cursor names the last batch of a page)", "after") from None
        rows, next_token = self.runner.page(limit, token, tenant)
        data = [self._object(r) for r in rows]
        return schemas.BatchList.of(data, bool(next_token))

    def _object(self, row: BatchRow) -> schemas.BatchObject:
        source = self.files.input_of(row.id) or BatchInput("", "", f"{row.completion_window_s // 3600}h")
        done = row.terminal
        stamps = {f"{s}_at": _s(ms) for s, ms in row.reached_ms.items() if s != states.VALIDATING}
        return schemas.BatchObject(
            id=row.id, endpoint=source.endpoint, input_file_id=source.input_file_id, status=row.status,
            completion_window=source.completion_window, created_at=_s(row.created_at_ms),
            expires_at=_s(row.expires_at_ms), metadata=row.metadata or None,
            errors=schemas.BatchErrors(data=[schemas.BatchErrorItem(**e) for e in row.errors]) if row.errors else None,
            output_file_id=f"file-{row.id}-{OUTPUT}" if done and row.completed else None,
            error_file_id=f"file-{row.id}-{ERRORS}" if done and row.failed else None,
            request_counts=schemas.RequestCounts(total=row.total, completed=row.completed, failed=row.failed),
            **stamps)

    # ---- output files -----------------------------------------------------------------------------------------
    def _render(self, row: BatchRow, which: str) -> bytes:
        kinds = self.files.request_kinds(row.id)
        # A Responses line's response repeats fields of its body (instructions, tools, ...) and follows its include:
        # parsed again here.
        options = {custom_id: responses_request(json.loads(body))[1]
                   for custom_id, body in self.files.request_payloads(row.id, RESPONSES).items()}
        lines = []
        for result in _results(self.runner, row.id):
            ok = result.WhichOneof("outcome") == "response"
            if ok != (which == OUTPUT):
                continue
            line = {"id": f"batch_req_{row.id}_{result.seq}", "custom_id": result.custom_id, "response": None,
                    "error": None}
            if ok:
                line["response"] = {"status_code": 200, "request_id": result.request_id,
                                    "body": self._body(kinds.get(result.custom_id), result, row,
                                                       options.get(result.custom_id))}
            elif result.error.code in NON_HTTP_ERRORS:
                line["error"] = {"code": result.error.code, "message": result.error.message}
            else:
                status = _http_status(result.error.code)
                line["response"] = {"status_code": status, "request_id": result.request_id, "body": error_body(
                    status, result.error.message, result.error.code, result.error.param or None)}
            lines.append(json.dumps(line, ensure_ascii=False))
        return "".join(line + "\n" for line in lines).encode("utf-8")

    def _body(self, kind: str | None, result: router_pb2.BatchResult, row: BatchRow,
              opts: ResponsesOptions | None) -> dict:
        r = result.response
        reply = Reply(token_ids=list(r.token_ids), text=r.text, reasoning=r.reasoning_text,
                      tool_calls=[ToolCall(c.id, c.name, c.arguments) for c in r.tool_calls],
                      finish_reason=r.finish_reason, usage=r.usage)
        if kind == RESPONSES:
            return responses.finished_response(
                responses.Head(f"resp_{result.request_id}", _s(row.created_at_ms), self.model(), opts.echo,
                               opts.encrypted_reasoning), reply, result.request_id)
        head = dict(created=_s(row.created_at_ms), model=self.model(), request_id=result.request_id)
        if kind == CHAT:
            return replies.chat_completion(f"chatcmpl-{result.request_id}", replies=[reply], logprobs=False,
                                           **head).model_dump()
        return replies.completion(f"cmpl-{result.request_id}", replies=[reply], per_prompt=1, echoes=[""],
                                  logprobs=False, **head).model_dump()


def _results(runner: BatchRunner, batch_id: str):
    """Every stored result, in seq order (the store is read synchronously: no follow)."""
    after = 0
    while True:
        page = runner.store.results(batch_id, after, 500)
        for blob in page:
            yield router_pb2.BatchResult.FromString(blob)
        after += len(page)
        if len(page) < 500:
            return


def _http_status(code: str) -> int:
    return 400 if code == "invalid_request" else http_status(code)


def _file_object(f: StoredFile) -> schemas.FileObject:
    return schemas.FileObject(id=f.id, bytes=f.bytes, created_at=_s(f.created_at_ms), filename=f.filename,
                              purpose=f.purpose)


def _s(ms: int) -> int:
    return ms // 1000
