"""Batch errors, each carrying the gRPC status it is answered with (mapped in router/batch/service.py)."""

import grpc

from router.errors import InvalidArgument, NotFound, RouterError

__all__ = ["BatchNotFound", "BatchStateError", "BatchStoreError", "BatchStoreFull", "BatchStoreReadOnly",
           "DuplicateResult", "FileInUse", "InvalidArgument"]


class BatchNotFound(NotFound):
    """No batch with that id."""


class BatchStateError(RouterError):
    """The batch's status does not allow the operation (e.g. cancelling a completed batch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class FileInUse(RouterError):
    """An uploaded file is the input of a batch that has not ended: it is kept until the batch ends."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class BatchStoreError(RouterError):
    """The SQLite store cannot be used as required (e.g. WAL journaling unavailable on its filesystem)."""


class BatchStoreFull(BatchStoreError):
    """The disk holding the store is full: nothing can be recorded until space is freed (retry later)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class BatchStoreReadOnly(BatchStoreError):
    """The store's file or filesystem became read-only (e.g. remounted after disk errors)."""

    code = grpc.StatusCode.UNAVAILABLE


class DuplicateResult(RouterError):
    """A second result for a request that already has one: a bug, refused by the store's unique key."""
