"""Batch errors, each carrying the gRPC status it is answered with (mapped in router/batch/service.py)."""

import grpc

from router.errors import InvalidArgument, NotFound, RouterError

__all__ = ["BatchNotFound", "BatchStateError", "BatchStoreError", "DuplicateResult", "InvalidArgument"]


class BatchNotFound(NotFound):
    """No batch with that id."""


class BatchStateError(RouterError):
    """The batch's status does not allow the operation (e.g. cancelling a completed batch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BatchStoreError(RouterError):
    """The SQLite store cannot be used as required (e.g. WAL journaling unavailable on its filesystem)."""


class DuplicateResult(RouterError):
    """A second result for a request that already has one: a bug, refused by the store's unique key."""
