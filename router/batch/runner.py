"""The batch scheduler of one router: creates batches, claims the ones it should run (its own, and any whose
owner's lease ran out, which is how a restarted router resumes), runs each as a BatchJob, renews leases, notices
cancels made through other routers sharing the store, and keeps the batch metrics current.

Its operations take the caller's tenant (kimiserve/tenants.py): a batch of another tenant is BatchNotFound, word
for word as an id never issued, so ids say nothing across tenants; an admin reads every batch and changes its own.
Each batch's requests run as its tenant."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import AsyncIterator

from kimiserve.tenants import Tenant
from kimiserve.text import clip
from kimiserve.v1 import router_pb2
from router.admission import BATCH, Admission
from router.batch import states
from router.batch.config import BatchConfig
from router.batch.errors import BatchNotFound, BatchStateError, BatchStoreError, InvalidArgument
from router.batch.execute import BatchExecutor
from router.batch.jobs import CANCEL, SHUTDOWN, BatchJob, JobContext, now_ms
from router.batch.metrics import BatchMetrics
from router.batch.parse import MAX_METADATA_PAIRS
from router.batch.store import MAX_SEQ, BatchRow, BatchStore
from router.errors import PermissionDenied

log = logging.getLogger(__name__)
RESULTS_PAGE = 500
MAX_WINDOW_S = 7 * 86_400
MAX_PAGE_SIZE = 100


class BatchRunner:
    def __init__(self, store: BatchStore, executor: BatchExecutor, metrics: BatchMetrics, cfg: BatchConfig,
                 admission: Admission | None = None):
        self.store, self.executor, self.metrics, self.cfg = store, executor, metrics, cfg
        self._admission = admission
        self._jobs: dict[str, BatchJob] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._job_context = JobContext(store, executor, metrics, cfg, self.notify, self.job_ended)

    # ---- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch runner")
        log.info("batch runner started", extra={"db": str(self.store.path), "owner": self.cfg.owner,
                                                "statuses": self.store.status_counts()})

    async def stop(self, grace_s: float) -> None:
        """Stops dispatching; running requests get `grace_s` to finish (the rest run again after a restart)."""
        self._stopping = True
        if self._task:
            self._task.cancel()
        jobs = list(self._jobs.values())
        for job in jobs:
            job.stop(SHUTDOWN)
        if jobs:
            _, late = await asyncio.wait([j.task for j in jobs], timeout=grace_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        try:
            self.store.renew([j.id for j in jobs], self.cfg.owner, 0)  # others may take them over at once
        except BatchStoreError as e:  # their leases run out within lease_s instead; a stop must not fail
            log.error("batch leases not released: %s", e, extra={"batch_ids": [j.id for j in jobs]})
        for event in self._changed.values():
            event.set()
        log.info("batch runner stopped", extra={"released_batch_ids": [j.id for j in jobs]})

    async def _loop(self) -> None:
        store_error: str | None = None  # logged once when the store turns unwritable, once when it recovers
        while True:
            try:
                self._tick()
                if store_error is not None:
                    log.info("batch store writable again; batches resume", extra={"db": str(self.store.path)})
                    store_error = None
            except BatchStoreError as e:
                if str(e) != store_error:
                    log.error("batch store unwritable; batches wait until it is writable: %s", e,
                              extra={"db": str(self.store.path)})
                    store_error = str(e)
            except Exception:  # noqa: BLE001 - e.g. the store busy beyond its timeout; try again next tick
                log.exception("batch runner tick failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.cfg.tick_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def _tick(self) -> None:
        now = now_ms()
        lease_until = now + int(self.cfg.lease_s * 1000)
        self.store.renew(list(self._jobs), self.cfg.owner, lease_until)
        for batch_id in self.store.claimable(self.cfg.owner, now):
            if batch_id not in self._jobs and self.store.claim(batch_id, self.cfg.owner, now, lease_until):
                log.info("batch claimed", extra={"batch_id": batch_id, "owner": self.cfg.owner})
                self._jobs[batch_id] = BatchJob(self._job_context, batch_id)
        for job in list(self._jobs.values()):
            row = self.store.get(job.id)
            if row.status == states.CANCELLING and job.reason is None:  # cancelled through another router
                job.stop(CANCEL)
        self.metrics.set_statuses(self.store.status_counts())
        waiting = self._admission.waiting(BATCH) if self._admission is not None else 0
        self.metrics.queue_depth.set(sum(j.queued for j in self._jobs.values()) + waiting)
        self.metrics.running.set(sum(len(j.inflight) for j in self._jobs.values()) - waiting)
        self.metrics.update_throughput()
        if self._admission is not None:
            self._admission.kick()  # shard capacity may have changed

    def job_ended(self, job: BatchJob) -> None:
        self._jobs.pop(job.id, None)
        self.notify(job.id)

    def notify(self, batch_id: str) -> None:
        """Something about the batch changed: wake result followers and the scheduler."""
        event = self._changed.pop(batch_id, None)
        if event is not None:
            event.set()
        self._wake.set()

    # ---- the RPCs' operations ---------------------------------------------------------------------------------
    def create(self, req: router_pb2.CreateBatchRequest, tenant: Tenant) -> BatchRow:
        which = req.WhichOneof("input")
        if which is None:
            raise InvalidArgument("set inline or jsonl")
        raw = req.jsonl.encode("utf-8") if which == "jsonl" else req.inline.SerializeToString()
        window = req.completion_window_s or self.cfg.default_window_s
        if window > MAX_WINDOW_S:
            raise InvalidArgument(f"completion_window_s {window} is above the maximum {MAX_WINDOW_S}")
        concurrency = req.max_concurrency or self.cfg.default_max_concurrency
        if concurrency > self.cfg.max_concurrency_limit:
            raise InvalidArgument(f"max_concurrency {concurrency} is above the limit "
                                  f"{self.cfg.max_concurrency_limit}")
        if len(req.metadata) > MAX_METADATA_PAIRS:
            raise InvalidArgument(f"metadata has {len(req.metadata)} pairs; at most {MAX_METADATA_PAIRS}")
        batch_id = f"batch_{uuid.uuid4().hex}"
        now = now_ms()
        row = self.store.create(batch_id, which, raw, dict(req.metadata), window, concurrency, self.cfg.owner,
                                tenant.name, now, now + int(self.cfg.lease_s * 1000))
        log.info("batch created", extra={"batch_id": batch_id, "tenant": tenant.name, "input": which,
                                         "input_bytes": len(raw),
                                         "completion_window_s": window, "max_concurrency": concurrency,
                                         "metadata": dict(req.metadata)})
        self._wake.set()
        return row

    def get(self, batch_id: str, tenant: Tenant) -> BatchRow:
        """The batch, if `tenant` may see it; else BatchNotFound, the same as for an id never issued."""
        row = self.store.get(batch_id)
        if row is None or not tenant.reads(row.tenant):
            raise BatchNotFound(f"no batch {clip(batch_id)}")
        return row

    def _changeable(self, batch_id: str, tenant: Tenant) -> BatchRow:
        row = self.get(batch_id, tenant)
        if not tenant.changes(row.tenant):  # an admin reading another tenant's batch: it knows the batch exists
            raise PermissionDenied(f"batch {batch_id} belongs to tenant {row.tenant!r}; an admin key reads other "
                                   "tenants' batches but does not change them")
        return row

    def page(self, page_size: int, page_token: str, tenant: Tenant) -> tuple[list[BatchRow], str]:
        """`tenant`'s batches (an admin: everyone's), newest first, a page at a time."""
        size = page_size or 20
        if not 1 <= size <= MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
        before = _page_token(page_token)
        rows = self.store.page(size + 1, before, None if tenant.admin else tenant.name)
        more = len(rows) > size
        rows = rows[:size]
        return rows, (str(rows[-1].seq) if more else "")

    def cancel(self, batch_id: str, tenant: Tenant) -> BatchRow:
        row = self._changeable(batch_id, tenant)
        if row.status in (states.CANCELLING, states.CANCELLED):
            return row
        if row.terminal or row.status == states.FINALIZING:
            raise BatchStateError(f"batch {batch_id} is {row.status}; only a validating or in_progress batch "
                                  "can be cancelled")
        if not self.store.transition(batch_id, {states.VALIDATING, states.IN_PROGRESS}, states.CANCELLING,
                                     now_ms()):
            return self.cancel(batch_id, tenant)  # its status moved meanwhile (another router); decide again
        log.info("batch status", extra={"batch_id": batch_id, "status": states.CANCELLING, "by_tenant": tenant.name})
        job = self._jobs.get(batch_id)
        if job is not None:
            job.stop(CANCEL)
        self.notify(batch_id)
        return self.get(batch_id, tenant)

    async def results(self, batch_id: str, after_seq: int, follow: bool, tenant: Tenant) -> AsyncIterator[bytes]:
        """Serialized BatchResults with seq > after_seq, in seq order; with `follow`, until the batch is terminal."""
        self.get(batch_id, tenant)
        if after_seq > MAX_SEQ:  # a uint64 field; no result's seq is beyond SQLite's INTEGER
            raise InvalidArgument(f"after_seq {after_seq} is above the largest result seq there can be ({MAX_SEQ}); "
                                  "pass the seq of the last result received")
        while True:
            terminal = self.get(batch_id, tenant).terminal  # read before the results: a terminal batch has them all
            if follow and not terminal:
                event = self._changed.setdefault(batch_id, asyncio.Event())
            page = self.store.results(batch_id, after_seq, RESULTS_PAGE)
            for blob in page:
                yield blob
            after_seq += len(page)
            if len(page) == RESULTS_PAGE:
                continue
            if terminal or not follow or self._stopping:
                return
            try:  # the timeout also catches results recorded by another router sharing the store
                await asyncio.wait_for(event.wait(), self.cfg.tick_s * 2)
            except asyncio.TimeoutError:
                pass
            if self._stopping:  # the router is shutting down (the store closes): the client resumes with after_seq
                return


def _page_token(token: str) -> int | None:
    """A ListBatches page_token (a batch's seq, as next_page_token gives it), or InvalidArgument naming the field."""
    if not token:
        return None
    # Length first: int() of thousands of digits is refused by Python itself (ValueError), and slow before that.
    if not (len(token) <= len(str(MAX_SEQ)) and token.isascii() and token.isdigit() and 0 < int(token) <= MAX_SEQ):
        raise InvalidArgument(f"page_token {clip(token)} is not one this router issued (pass next_page_token of "
                              "the previous page, or nothing for the first)")
    return int(token)
