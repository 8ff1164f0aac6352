"""The batch RPCs of the Router service (thin: decode, call the runner, encode; errors mapped in one place).

They are attached to the RouterService instance that router/main.py registers, so one Router service serves both
the interactive and the batch RPCs. Each RPC acts as the caller's tenant (kimiserve/tenants.py grpc_tenant): another
tenant's batch is NOT_FOUND."""

from __future__ import annotations

import logging

import grpc

from kimiserve.tenants import grpc_tenant
from kimiserve.text import clip
from kimiserve.v1 import router_pb2
from router.batch import states
from router.batch.runner import BatchRunner
from router.batch.store import BatchRow
from router.errors import RouterError

log = logging.getLogger(__name__)
RPCS = ("CreateBatch", "GetBatch", "ListBatches", "CancelBatch", "GetBatchResults")


def batch_to_pb(row: BatchRow) -> router_pb2.Batch:
    pb = router_pb2.Batch(
        id=row.id, status=states.TO_PB[row.status], metadata=row.metadata,
        request_counts=router_pb2.BatchRequestCounts(total=row.total, completed=row.completed, failed=row.failed),
        usage=router_pb2.BatchUsage(prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens),
        errors=[router_pb2.BatchError(**e) for e in row.errors], completion_window_s=row.completion_window_s,
        max_concurrency=row.max_concurrency, created_at_ms=row.created_at_ms, expires_at_ms=row.expires_at_ms)
    for status, at_ms in row.reached_ms.items():
        if status != states.VALIDATING:
            setattr(pb, f"{status}_at_ms", at_ms)
    return pb


class BatchService:
    def __init__(self, runner: BatchRunner):
        self.runner = runner

    def attach(self, servicer) -> None:
        """Serve the batch RPCs from `servicer` (the RouterService registered with the gRPC server)."""
        for name in RPCS:
            setattr(servicer, name, getattr(self, name))

    async def _fail(self, context, rpc: str, batch_id: str, e: Exception) -> None:
        code = e.code if isinstance(e, RouterError) else grpc.StatusCode.INTERNAL
        facts = {"rpc": rpc, "batch_id": clip(batch_id, 256), "tenant": grpc_tenant(context).name}
        if code == grpc.StatusCode.INTERNAL:
            log.exception("batch rpc failed", extra=facts)
        else:
            log.info("batch rpc refused", extra={**facts, "status": code.name, "error": str(e)})
        # A bug's text (which may quote input, or be huge) goes to the log only; named errors say what was wrong.
        await context.abort(code, str(e) if isinstance(e, RouterError) else
                            "internal error; the router's log has the details")

    async def CreateBatch(self, request, context):
        try:
            return batch_to_pb(self.runner.create(request, grpc_tenant(context)))
        except Exception as e:  # noqa: BLE001 - mapped to a status in one place
            await self._fail(context, "CreateBatch", "", e)

    async def GetBatch(self, request, context):
        try:
            return batch_to_pb(self.runner.get(request.batch_id, grpc_tenant(context)))
        except Exception as e:  # noqa: BLE001
            await self._fail(context, "GetBatch", request.batch_id, e)

    async def ListBatches(self, request, context):
        try:
            rows, token = self.runner.page(request.page_size, request.page_token, grpc_tenant(context))
            return router_pb2.ListBatchesResponse(batches=[batch_to_pb(r) for r in rows], next_page_token=token)
        except Exception as e:  # noqa: BLE001
            await self._fail(context, "ListBatches", "", e)

    async def CancelBatch(self, request, context):
        try:
            return batch_to_pb(self.runner.cancel(request.batch_id, grpc_tenant(context)))
        except Exception as e:  # noqa: BLE001
            await self._fail(context, "CancelBatch", request.batch_id, e)

    async def GetBatchResults(self, request, context):
        try:
            async for blob in self.runner.results(request.batch_id, request.after_seq, request.follow,
                                                  grpc_tenant(context)):
                yield router_pb2.BatchResult.FromString(blob)
        except Exception as e:  # noqa: BLE001
            await self._fail(context, "GetBatchResults", request.batch_id, e)
