"""Request ids: what a client may send, the form the batch runner gives its own requests, the ids of a request's
sequences, and the registry of live ids.

A client id travels back in gRPC trailing metadata and in every log line, so it must be printable ASCII of bounded
length, checked before any work. The batch runner's ids have a reserved form that no client id may take: a client
could otherwise collide with a batch line on purpose, stall it, or read its tokens.

A request of n > 1 choices runs its sequences as "ID:0" .. "ID:n-1" (sequence_ids). Those are ordinary printable
ids a client could also send, so the registry (LiveIds) claims a request's id and all its sequence ids together, at
once, before anything is sent: while "ID" with n = 2 is live, a client request "ID:1" of the same tenant is refused
(and the other way round). Ids are private to a tenant: another tenant's request "ID" runs, under an alias on the
shards, so no two live sequences ever share an id on a shard, whoever chose it.
"""

from __future__ import annotations

import re

from kimiserve.limits import MAX_REQUEST_ID_CHARS
from router.errors import AlreadyExists, InvalidArgument

_BATCH_FORM = re.compile(r"batch_[0-9a-f]{32}:")


def batch_request_id(batch_id: str, custom_id: str, attempt: int) -> str:
    return f"{batch_id}:{custom_id}:{attempt}"


def check_client_request_id(request_id: str) -> str:
    """Returns the id, or raises InvalidArgument naming what is wrong with it."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request id of {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS}",
                              "request_id")
    bad = next((i for i, c in enumerate(request_id) if not " " <= c <= "~"), None)
    if bad is not None:
        raise InvalidArgument(f"request id holds {request_id[bad]!r} at index {bad}; only printable ASCII "
                              f"(0x20-0x7e) is allowed", "request_id")
    if _BATCH_FORM.match(request_id):
        raise InvalidArgument("request ids of the form 'batch_<32 hex digits>:...' are reserved for batch requests",
                              "request_id")
    return request_id


def sequence_ids(request_id: str, count: int) -> list[str]:
    """The shard ids of a request's `count` sequences: the request id itself when it is alone."""
    return [request_id] if count == 1 else [f"{request_id}:{i}" for i in range(count)]


class Claim:
    """The ids one request of one tenant holds: its own, and its sequences' until each is released, each with the
    id its sequence runs under on the shards."""

    def __init__(self, tenant: str, request_id: str, shard_ids: dict[str, str]):
        self.tenant, self.request_id, self.shard_ids = tenant, request_id, shard_ids
        self.open = set(shard_ids)


class LiveIds:
    """Every id live in this router, interactive and batch, each mapped to the claim that holds it.

    Ids are private to their tenant: a clash with a live id of the same tenant is refused, while another tenant's
    live id is neither refused nor revealed. Shards know no tenants, so the ids sequences run under there are one
    namespace: a sequence whose id another tenant's live sequence holds runs under an alias (`ID~k`, the first k
    free), and only this registry knows it.

    Single-threaded (the router's event loop), so a claim is atomic. A sequence id is released when its sequence
    ends (before its last chunk is handed on, so the client may reuse it at once); the request id goes with its last
    sequence. Releases name their claim, so a late release never frees an id a newer request has claimed since."""

    def __init__(self) -> None:
        self._client: dict[tuple[str, str], Claim] = {}  # (tenant, request or sequence id) -> its claim
        self._shard: dict[str, Claim] = {}  # shard-side sequence id -> its claim

    def claim(self, tenant: str, request_id: str, sequences: list[str]) -> Claim:
        """Claims the request id and its sequence ids for `tenant`, all or none; AlreadyExists names the first one
        the tenant holds live already."""
        for wanted in (request_id, *sequences):
            if (tenant, wanted) in self._client:
                owner = self._client[tenant, wanted].request_id
                whose = "" if owner == wanted else f" (a sequence of live request {owner!r})"
                raise AlreadyExists(f"request {request_id!r}: id {wanted!r} is already live{whose}; a request's id "
                                    "and its sequence ids (ID:0, ID:1, ... for n > 1) must be unique among live "
                                    "requests")
        claim = Claim(tenant, request_id, {sid: self._free_shard_id(sid) for sid in sequences})
        for claimed in (request_id, *sequences):
            self._client[tenant, claimed] = claim
        for shard_id in claim.shard_ids.values():
            self._shard[shard_id] = claim
        return claim

    def _free_shard_id(self, sequence_id: str) -> str:
        if sequence_id not in self._shard:
            return sequence_id
        k = 1
        while f"{sequence_id}~{k}" in self._shard:
            k += 1
        return f"{sequence_id}~{k}"

    def holds(self, shard_id: str) -> bool:
        """Whether a live sequence runs under this shard-side id."""
        return shard_id in self._shard

    def release(self, claim: Claim, sequence_id: str) -> None:
        """Idempotent: releasing a sequence twice, or one the claim does not hold, changes nothing."""
        if sequence_id not in claim.open:
            return
        claim.open.discard(sequence_id)
        if self._shard.get(claim.shard_ids[sequence_id]) is claim:
            del self._shard[claim.shard_ids[sequence_id]]
        for done in (sequence_id, claim.request_id) if not claim.open else (sequence_id,):
            if self._client.get((claim.tenant, done)) is claim:
                del self._client[claim.tenant, done]
