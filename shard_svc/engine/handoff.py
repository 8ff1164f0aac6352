"""Handing a running sequence to another shard when this one drains (SIGTERM, a rolling restart).

A Kimi sequence's whole state is one fixed-size KDA state per linear-attention layer (recurrent matrix and
short-convolution window) plus the MLA latent cache of the tokens it has read, so it can leave one shard and go on
at another exactly. The draining shard stops each movable sequence between two steps, copies its state to host
memory (shard_svc/state/host_copy.py), packs it as one safetensors blob and ends the sequence with a Moved event;
the blob waits in `exports` until the router fetches it (ExportState) or STATE_HOLD_SECONDS pass. The router relays
it to a peer (ImportState), which unpacks it, checks it against its own pools and holds it in `imports` until the
continuation's Submit (prompt plus every token already sent, `imported_state` set) restores it into the slot and
blocks the scheduler admits the sequence with. The continuation then prefills only what the state does not hold:
the one token sent last (or, for a sequence moved mid-prefill, the rest of its prompt). Sampling needs nothing
more: penalties and a response_format are replayed over the prior output, and seeded draws are keyed by position.

Not moved (the receiver recomputes instead, and the router counts it): a queued sequence (no state yet), one whose
KV pages sit on the host (host KV offload), one whose whole prompt came from the prefix cache and has not drawn its
first token (its state holds every token of the continuation: there would be nothing left to read), and every
sequence of a tensor-parallel shard group (each rank holds a slice of the state).

What it costs per token of context: the MLA latent (kv_lora_rank + rope dims) in the cache dtype for every MLA layer
(docs/failover.md has the figures); per sequence, the KDA state, fixed whatever the length.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import safetensors.torch

from shard_svc.errors import InvalidRequest, KimiServeError
from shard_svc.state.host_copy import HostState

log = logging.getLogger(__name__)

STATE_HOLD_SECONDS = 60.0  # a state nobody fetched (exports) or restored (imports) is dropped after this
CHUNK_BYTES = 1 << 20  # per SequenceStateChunk: well inside gRPC's 4 MiB default message limit
PARTS = ("recurrent", "conv", "kv")


class HandoffError(KimiServeError):
    """A sequence state cannot be taken: malformed, of another model, or more than the shard holds."""


class StatesFull(HandoffError):
    """The store holds as many states as it may."""


class StateUnavailable(KimiServeError):
    """A Submit asked for an imported state that is not held (dropped, or never imported). The shard itself serves
    on: the refusal names the field, so the router does not take it for a draining shard."""

    param = "imported_state"


@dataclass
class SequenceState:
    """A sequence's state after its first len(tokens) tokens, in host memory."""

    tokens: list[int]
    host: HostState

    @property
    def nbytes(self) -> int:
        return self.host.nbytes

    def pack(self) -> PackedState:
        return PackedState(self.tokens, safetensors.torch.save(self.host.parts()))


@dataclass
class PackedState:
    """A sequence state as it travels: its tokens and one safetensors blob of its tensors."""

    tokens: list[int]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def unpack(self, what: str) -> SequenceState:
        """HandoffError naming `what` when the blob is not exactly the state's tensors."""
        try:
            tensors = safetensors.torch.load(self.data)
        except Exception as e:  # noqa: BLE001 - any parse failure is a malformed state
            raise HandoffError(f"{what}: its {len(self.data)} bytes are not a safetensors file: {e}") from e
        if sorted(tensors) != sorted(PARTS):
            raise HandoffError(f"{what}: holds tensors {sorted(tensors)}; a sequence state holds {list(PARTS)}")
        return SequenceState(list(self.tokens), HostState(*(tensors[name] for name in PARTS)))

    def chunks(self) -> list[bytes]:
        return [self.data[i:i + CHUNK_BYTES] for i in range(0, len(self.data), CHUNK_BYTES)]


def check_continues(request_id: str, prompt: list[int], state: SequenceState) -> None:
    """InvalidRequest (param imported_state) unless the state's tokens begin the prompt and leave at least one
    token to read: the continuation draws its next token from that read."""
    n = len(state.tokens)
    if n >= len(prompt) or prompt[:n] != state.tokens:
        at = next((i for i, (a, b) in enumerate(zip(prompt, state.tokens)) if a != b), min(n, len(prompt)))
        raise InvalidRequest(f"request {request_id!r}: its imported state holds {n} tokens that must begin its "
                             f"prompt of {len(prompt)} tokens and be fewer; they differ from position {at}",
                             "imported_state")


T = TypeVar("T", SequenceState, PackedState)


class StateStore(Generic[T]):
    """States by request id, each held until taken or `hold_s` old, at most `max_states` at once. Thread-safe: gRPC
    handlers and the engine thread both use it."""

    def __init__(self, name: str, max_states: int | None = None, hold_s: float = STATE_HOLD_SECONDS):
        self.name, self.max_states, self.hold_s = name, max_states, hold_s
        self._states: dict[str, tuple[T, float]] = {}
        self._changed = threading.Condition()
        self.expired = 0  # states dropped unclaimed, for the metric

    def put(self, request_id: str, state: T) -> None:
        with self._changed:
            self._expire()
            if request_id in self._states:
                raise HandoffError(f"a state is already held for request {request_id!r} ({self.name})")
            if self.max_states is not None and len(self._states) >= self.max_states:
                raise StatesFull(f"{self.name}: {len(self._states)} states held, at most {self.max_states}; "
                                   f"request {request_id!r}'s is refused")
            self._states[request_id] = (state, time.monotonic() + self.hold_s)
            self._changed.notify_all()

    def take(self, request_id: str) -> T | None:
        with self._changed:
            self._expire()
            entry = self._states.pop(request_id, None)
            self._changed.notify_all()
            return entry[0] if entry is not None else None

    def __len__(self) -> int:
        with self._changed:
            self._expire()
            return len(self._states)

    def wait_empty(self, timeout: float) -> list[str]:
        """Waits until every state was taken or dropped, at most `timeout` seconds; returns the ids still held (then
        dropped)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._states and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(min(left, 1.0))
                self._expire()
            left_over = list(self._states)
            self._states.clear()
            return left_over

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self._states.items() if deadline <= now]:
            del self._states[rid]
            self.expired += 1
            log.warning("sequence state dropped unclaimed", extra={"request_id": rid, "store": self.name,
                                                                   "hold_s": self.hold_s})
