"""The batch lifecycle: statuses, the transitions allowed between them, and their proto enum values."""

from __future__ import annotations

from kimiserve.v1 import router_pb2

VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
COMPLETED, FAILED, EXPIRED = "completed", "failed", "expired"
CANCELLING, CANCELLED = "cancelling", "cancelled"
STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED, FAILED, EXPIRED, CANCELLING, CANCELLED)
TERMINAL = frozenset({COMPLETED, FAILED, EXPIRED, CANCELLED})

# from -> the statuses it may move to. Terminal statuses have no way out.
TRANSITIONS: dict[str, frozenset[str]] = {
    VALIDATING: frozenset({IN_PROGRESS, FAILED, EXPIRED, CANCELLING}),
    IN_PROGRESS: frozenset({FINALIZING, FAILED, EXPIRED, CANCELLING}),
    FINALIZING: frozenset({COMPLETED, FAILED}),
    CANCELLING: frozenset({CANCELLED}),
}

TO_PB = {status: router_pb2.BatchStatus.Value(f"BATCH_STATUS_{status.upper()}") for status in STATUSES}


def check_transition(old: str, new: str) -> None:
    if new not in TRANSITIONS.get(old, frozenset()):
        raise ValueError(f"batch status {old!r} cannot move to {new!r}")
