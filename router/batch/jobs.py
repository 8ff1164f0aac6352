"""One batch's run: a state machine over the stored status, and the dispatch of its requests.

    VALIDATING  --parse ok-->  IN_PROGRESS  --all results-->  FINALIZING  --counts check-->  COMPLETED
        |  parse/dup error -> FAILED            | window passed -> EXPIRED (open requests: "batch_expired")
        +--------- CancelBatch --------------> CANCELLING -> CANCELLED (open requests: "batch_cancelled")

Each step reads the status from the store and moves it on, so a job started on a batch in any non-terminal status
(after a restart, or taken over from a router whose lease ran out) continues from there. Requests without a result
are dispatched in input order, at most `max_concurrency` at once, each at batch priority in admission; each result
is committed as soon as its request finishes. A request that fails gets an error result; only shard
unavailability is retried (the request was not the problem).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kimiserve.tenants import Tenant
from kimiserve.v1 import router_pb2
from router.admission import BATCH, PRIORITY
from router.batch import states
from router.batch.config import BatchConfig
from router.batch.execute import BatchExecutor, RequestFailed
from router.batch.metrics import BatchMetrics
from router.batch.parse import BatchIssue, ParsedRequest, parse_inline, parse_jsonl
from router.batch.store import BatchRow, BatchStore, NewResult, RequestRow
from router.errors import AlreadyExists, Overloaded, RouterError, ShardUnavailable
from router.request_ids import batch_request_id

log = logging.getLogger(__name__)
CANCEL, EXPIRE, SHUTDOWN, ERROR = "cancel", "expire", "shutdown", "error"
RETRYABLE = (ShardUnavailable, Overloaded, AlreadyExists)
PAGE = 256
MAX_PASSES = 3


def now_ms() -> int:
    return int(time.time() * 1000)


def error_result(custom_id: str, code: str, message: str, request_id: str = "", param: str | None = None
                 ) -> router_pb2.BatchResult:
    return router_pb2.BatchResult(custom_id=custom_id, request_id=request_id,
                                  error=router_pb2.BatchRequestError(code=code, message=message, param=param or ""))


@dataclass(frozen=True)
class JobContext:
    """What a job uses of the runner that owns it, handed in (so this module never imports the runner, which
    creates jobs): the store, the executor, metrics, settings, and the runner's two callbacks."""

    store: BatchStore
    executor: BatchExecutor
    metrics: BatchMetrics
    cfg: BatchConfig
    notify: Callable[[str], None]  # the batch's stored state changed (wakes its watchers)
    job_ended: Callable[[BatchJob], None]  # the job's task is over, whatever the reason


class BatchJob:
    def __init__(self, ctx: JobContext, batch_id: str):
        self.ctx, self.store, self.id = ctx, ctx.store, batch_id
        self.inflight: dict[int, asyncio.Task] = {}
        self.queued = 0  # requests without a result that are not running
        self.reason: str | None = None
        self._error: BaseException | None = None
        self._stopped = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"batch job {batch_id}")

    def stop(self, reason: str, error: BaseException | None = None) -> None:
        """CANCEL / EXPIRE: stop the running requests and close the batch; SHUTDOWN: stop dispatching and leave
        the batch to be resumed; ERROR: a bug or a store failure, fails the batch. The first reason wins."""
        if self.reason is None:
            self.reason, self._error = reason, error
            self._stopped.set()

    # ---- the state machine ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        try:
            while self.reason != SHUTDOWN:
                row = self.store.get(self.id)
                if row.terminal:
                    return
                step = {states.VALIDATING: self._validate, states.IN_PROGRESS: self._execute,
                        states.FINALIZING: self._finalize, states.CANCELLING: self._finish_cancel}[row.status]
                await step(row)
                if self.reason == ERROR:
                    raise self._error
                if self.reason != SHUTDOWN and self.store.get(self.id).status == row.status:
                    raise RuntimeError(f"batch {self.id}: step for status {row.status!r} did not move it on")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - docs/lessons.md#every-request-and-batch-ends
            log.exception("batch failed internally", extra={"batch_id": self.id})
            self._fail_internal(e)
        finally:
            self.ctx.job_ended(self)

    async def _validate(self, row: BatchRow) -> None:
        if now_ms() >= row.expires_at_ms:
            self._transition({states.VALIDATING}, states.EXPIRED)
            return
        kind, data = self.store.raw_input(self.id)
        try:  # in a thread: parsing tens of thousands of lines must not stall interactive streams
            parsed = await asyncio.to_thread(_parse, kind, data)
        except UnicodeDecodeError as e:
            parsed = None
            issues = [BatchIssue("invalid_input", f"the JSONL content is not UTF-8: {e}")]
        if parsed is not None:
            issues = parsed.issues
        if issues:
            self._transition({states.VALIDATING}, states.FAILED, errors=issues)
            log.warning("batch failed validation", extra={"batch_id": self.id,
                                                          "errors": [vars(i) for i in issues]})
            return

        def invalid_payload(r: ParsedRequest, seq: int) -> bytes:
            res = error_result(r.custom_id, *r.error, param=r.param)
            res.seq = seq
            return res.SerializeToString()

        if self.store.start(self.id, parsed.requests, invalid_payload, now_ms()):
            invalid = [r for r in parsed.requests if r.error]
            for r in invalid:
                self.ctx.metrics.request_finished(False, r.error[0], 0, 0, None)
                log.info("batch request invalid", extra={"batch_id": self.id, "custom_id": r.custom_id,
                                                         "line": r.line, "code": r.error[0], "error": r.error[1]})
            log.info("batch in progress", extra={"batch_id": self.id, "requests": len(parsed.requests),
                                                 "invalid_requests": len(invalid)})
            self.ctx.notify(self.id)

    async def _execute(self, row: BatchRow) -> None:
        delay_s = max(0.0, (row.expires_at_ms - now_ms()) / 1000)
        timer = asyncio.get_running_loop().call_later(delay_s, self.stop, EXPIRE)
        try:
            tenant = Tenant(row.tenant)  # its requests run as the tenant that created the batch
            for _ in range(MAX_PASSES):
                await self._dispatch_pass(row, tenant)
                if self.reason is not None or not self.store.unfinished(self.id):
                    break
            else:
                raise RuntimeError(f"batch {self.id}: requests still without a result after {MAX_PASSES} passes: "
                                   f"{[c for _, c in self.store.unfinished(self.id)][:20]}")
        finally:
            timer.cancel()
            await self._cancel_inflight()
        if self.reason == EXPIRE:
            self._close(states.IN_PROGRESS, states.EXPIRED, "batch_expired",
                        f"the completion window of {row.completion_window_s} s passed before this request finished")
        elif self.reason is None:
            self._transition({states.IN_PROGRESS}, states.FINALIZING)

    async def _dispatch_pass(self, row: BatchRow, tenant: Tenant) -> None:
        sem = asyncio.Semaphore(row.max_concurrency)
        after = -1
        self.queued = len(self.store.unfinished(self.id))
        while self.reason is None and (page := self.store.pending(self.id, after, PAGE)):
            for req in page:
                after = req.idx
                if not await self._acquire(sem):
                    break
                task = asyncio.create_task(self._one(req, tenant), name=f"batch request {self.id}:{req.custom_id}")
                self.inflight[req.idx] = task
                self.queued -= 1
                task.add_done_callback(lambda t, idx=req.idx: self._request_done(t, idx, sem))
        # Wait for the running requests, unless the batch is being closed (then they are cancelled).
        while self.inflight and self.reason in (None, SHUTDOWN):
            stopped = asyncio.ensure_future(self._stopped.wait())
            await asyncio.wait([*self.inflight.values(), stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()

    async def _acquire(self, sem: asyncio.Semaphore) -> bool:
        """A concurrency slot, or False once the job is stopping."""
        if self.reason is not None:
            return False
        acquire = asyncio.ensure_future(sem.acquire())
        stopped = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait([acquire, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if self.reason is None:
            return True
        if acquire.done() and not acquire.cancelled():
            sem.release()
        else:
            acquire.cancel()
        return False

    def _request_done(self, task: asyncio.Task, idx: int, sem: asyncio.Semaphore) -> None:
        self.inflight.pop(idx, None)
        sem.release()
        if not task.cancelled() and task.exception() is not None:  # the result could not be recorded
            self.stop(ERROR, task.exception())

    async def _cancel_inflight(self) -> None:
        tasks = list(self.inflight.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _finalize(self, row: BatchRow) -> None:
        missing = self.store.unfinished(self.id)
        if missing or self.store.result_count(self.id) != row.total:
            raise RuntimeError(f"batch {self.id}: {self.store.result_count(self.id)} results for {row.total} "
                               f"requests; without a result: {[c for _, c in missing][:20]}")
        self._transition({states.FINALIZING}, states.COMPLETED)

    async def _finish_cancel(self, row: BatchRow) -> None:
        self._close(states.CANCELLING, states.CANCELLED, "batch_cancelled",
                    "the batch was cancelled before this request finished")

    # ---- one request ------------------------------------------------------------------------------------------
    async def _one(self, req: RequestRow, tenant: Tenant) -> None:
        PRIORITY.set(BATCH)  # this task's context only: admission serves interactive requests first
        started = time.monotonic()
        cfg = self.ctx.cfg
        for attempt_here in range(1, cfg.max_attempts + 1):
            attempt = self.store.begin_attempt(self.id, req.idx)
            request_id = batch_request_id(self.id, req.custom_id, attempt)
            log.info("batch request started", extra={"batch_id": self.id, "custom_id": req.custom_id,
                                                     "request_id": request_id, "attempt": attempt})
            try:
                response = await self.ctx.executor.run(req.kind, req.payload, request_id, tenant)
                result = router_pb2.BatchResult(custom_id=req.custom_id, request_id=request_id, response=response)
            except RouterError as e:
                if isinstance(e, RETRYABLE) and attempt_here < cfg.max_attempts:
                    delay = cfg.retry_backoff_s * 2 ** (attempt_here - 1)
                    log.warning("batch request will be retried", extra={
                        "batch_id": self.id, "custom_id": req.custom_id, "request_id": request_id,
                        "error": str(e), "retry_in_s": delay})
                    await asyncio.sleep(delay)
                    continue
                result = error_result(req.custom_id, e.code.name.lower(), str(e), request_id, e.param)
            except RequestFailed as e:
                result = error_result(req.custom_id, e.code, str(e), request_id)
            except Exception as e:  # noqa: BLE001 - a bug fails this request, not its neighbours
                log.exception("batch request failed internally", extra={
                    "batch_id": self.id, "custom_id": req.custom_id, "request_id": request_id})
                result = error_result(req.custom_id, "internal", f"{type(e).__name__}: {e}", request_id)
            break
        self._record(req.idx, result, time.monotonic() - started)

    def _record(self, idx: int, result: router_pb2.BatchResult, seconds: float | None) -> None:
        ok = result.WhichOneof("outcome") == "response"
        usage = result.response.usage

        def payload(seq: int) -> bytes:
            result.seq = seq
            return result.SerializeToString()

        seq, = self.store.record(self.id, [NewResult(idx, ok, usage.prompt_tokens, usage.completion_tokens,
                                                     payload)])
        code = "ok" if ok else result.error.code
        self.ctx.metrics.request_finished(ok, code, usage.prompt_tokens, usage.completion_tokens, seconds)
        extra = {"batch_id": self.id, "custom_id": result.custom_id, "request_id": result.request_id, "seq": seq,
                 "outcome": "completed" if ok else "failed", "code": code}
        if ok:
            extra.update(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens)
        else:
            extra["error"] = result.error.message
        log.info("batch request finished", extra=extra)
        self.ctx.notify(self.id)

    # ---- closing ----------------------------------------------------------------------------------------------
    def _close(self, old: str, new: str, code: str, message: str) -> None:
        """Gives every request without a result an error result with `code`, then moves the batch old -> new."""
        if self.store.get(self.id).status != old:
            return
        open_requests = self.store.unfinished(self.id)
        results = []
        for idx, custom_id in open_requests:
            res = error_result(custom_id, code, message)
            results.append(NewResult(idx, False, 0, 0, lambda seq, res=res: _with_seq(res, seq)))
        if results:
            self.store.record(self.id, results)
            for _ in results:
                self.ctx.metrics.request_finished(False, code, 0, 0, None)
        self._transition({old}, new)
        log.info("batch closed", extra={"batch_id": self.id, "status": new, "closed_requests": len(results),
                                        "closed_custom_ids": [c for _, c in open_requests]})

    def _fail_internal(self, e: BaseException) -> None:
        try:
            row = self.store.get(self.id)
            if row.terminal:
                return
            old = row.status
            if old == states.CANCELLING:
                self._close(old, states.CANCELLED, "batch_cancelled", "the batch was cancelled")
                return
            message = f"internal error: {type(e).__name__}: {e}"
            results = [NewResult(idx, False, 0, 0, lambda seq, c=c: _with_seq(error_result(c, "internal", message),
                                                                          seq))
                       for idx, c in self.store.unfinished(self.id)]
            if results:
                self.store.record(self.id, results)
            self._transition({old}, states.FAILED, errors=[BatchIssue("internal", message)])
        except Exception:  # noqa: BLE001 - the store itself failed: leave the batch to be resumed on restart
            log.exception("could not mark the batch failed; it stays resumable", extra={"batch_id": self.id})

    def _transition(self, old: set[str], new: str, errors: list[BatchIssue] = ()) -> None:
        if self.store.transition(self.id, old, new, now_ms(), errors=errors):
            log.info("batch status", extra={"batch_id": self.id, "status": new})
            self.ctx.notify(self.id)


def _parse(kind: str, data: bytes):
    if kind == "jsonl":
        return parse_jsonl(data.decode("utf-8"))
    return parse_inline(list(router_pb2.BatchInlineRequests.FromString(data).requests))


def _with_seq(result: router_pb2.BatchResult, seq: int) -> bytes:
    result.seq = seq
    return result.SerializeToString()
