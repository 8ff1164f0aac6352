"""The batch RPCs of the Router service (thin: decode, call the runner, encode; errors by the router's one table).

Each RPC acts as the caller's tenant (kimiserve/tenants.py grpc_tenant): another
tenant's batch is NOT_FOUND."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from kimiserve.tenants import grpc_tenant
from kimiserve.text import clip
from kimiserve.v1 import router_pb2
from router.batch import states
from router.batch.runner import BatchRunner
from router.batch.store import BatchRow
from router.errors import refusal

log = logging.getLogger(__name__)


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


def _answered(rpc: str):
    """A batch RPC whose every failure is answered by the router's error table (router/errors.py refusal): named
    errors with their status and text, a bug as INTERNAL with its traceback in the log only."""

    def decorate(method):
        async def fail(self, request, context, e: Exception) -> None:
            code, message = refusal(e)
            facts = {"rpc": rpc, "batch_id": clip(getattr(request, "batch_id", ""), 256),
                     "tenant": grpc_tenant(context).name}
            if code == grpc.StatusCode.INTERNAL:
                log.exception("batch rpc failed", extra=facts)
            else:
                log.info("batch rpc refused", extra={**facts, "status": code.name, "error": message})
            await context.abort(code, message)

        if inspect.isasyncgenfunction(method):
            @functools.wraps(method)
            async def streaming(self, request, context):
                try:
                    async for reply in method(self, request, context):
                        yield reply
                except Exception as e:  # noqa: BLE001 - mapped to a status in one place
                    await fail(self, request, context, e)
            return streaming

        @functools.wraps(method)
        async def unary(self, request, context):
            try:
                return await method(self, request, context)
            except Exception as e:  # noqa: BLE001 - mapped to a status in one place
                await fail(self, request, context, e)
        return unary

    return decorate


class BatchRpcs:
    """The batch half of the Router service: router/service.py RouterService inherits these methods, so one Router
    service serves both the interactive and the batch RPCs."""

    runner: BatchRunner

    @_answered("CreateBatch")
    async def CreateBatch(self, request, context):
        return batch_to_pb(self.runner.create(request, grpc_tenant(context)))

    @_answered("GetBatch")
    async def GetBatch(self, request, context):
        return batch_to_pb(self.runner.get(request.batch_id, grpc_tenant(context)))

    @_answered("ListBatches")
    async def ListBatches(self, request, context):
        rows, token = self.runner.page(request.page_size, request.page_token, grpc_tenant(context))
        return router_pb2.ListBatchesResponse(batches=[batch_to_pb(r) for r in rows], next_page_token=token)

    @_answered("CancelBatch")
    async def CancelBatch(self, request, context):
        return batch_to_pb(self.runner.cancel(request.batch_id, grpc_tenant(context)))

    @_answered("GetBatchResults")
    async def GetBatchResults(self, request, context):
        async for blob in self.runner.results(request.batch_id, request.after_seq, request.follow,
                                              grpc_tenant(context)):
            yield router_pb2.BatchResult.FromString(blob)
