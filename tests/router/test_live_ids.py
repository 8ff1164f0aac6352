"""The live-id registry (router/request_ids.py): a request's id and its derived sequence ids are claimed together,
so no client id can take a sequence id of a live request of its tenant, nor the other way round; another tenant's
live ids are neither refused nor revealed, and its sequences run under aliases on the shards."""

from __future__ import annotations

import pytest

from router.errors import AlreadyExists
from router.request_ids import LiveIds, sequence_ids


def test_sequence_ids_are_the_request_id_alone_or_numbered():
    assert sequence_ids("r", 1) == ["r"]
    assert sequence_ids("r", 3) == ["r:0", "r:1", "r:2"]


@pytest.mark.parametrize("request_id, n, taken", [
    ("r:1", 1, "r:1"),  # a client id equal to a live derived id
    ("r", 1, "r"),  # the live request's own id
    ("r:0", 2, "r:0"),  # a request whose own id is a live derived id
])
def test_a_clash_with_a_live_request_or_its_sequences_is_refused(request_id, n, taken):
    live = LiveIds()
    live.claim("a", "r", sequence_ids("r", 2))
    with pytest.raises(AlreadyExists, match=f"id '{taken}' is already live"):
        live.claim("a", request_id, sequence_ids(request_id, n))
    assert not live.holds("r:0:0")


def test_a_derived_id_cannot_be_claimed_while_a_client_holds_it():
    live = LiveIds()
    live.claim("a", "r:1", ["r:1"])
    with pytest.raises(AlreadyExists, match="'r:1' is already live"):
        live.claim("a", "r", sequence_ids("r", 2))
    assert not live.holds("r") and not live.holds("r:0")  # all or nothing


def test_the_request_id_is_freed_with_its_last_sequence_and_release_is_idempotent():
    live = LiveIds()
    claim = live.claim("a", "r", sequence_ids("r", 2))
    live.release(claim, "r:0")
    live.release(claim, "r:0")
    assert live.holds("r:1") and not live.holds("r:0")
    with pytest.raises(AlreadyExists, match="id 'r' is already live"):
        live.claim("a", "r", ["r"])
    live.release(claim, "r:1")
    assert not live.holds("r:1")
    live.claim("a", "r", ["r"])


def test_a_late_release_never_frees_a_newer_claim_of_the_same_id():
    live = LiveIds()
    old = live.claim("a", "r", ["r"])
    live.release(old, "r")
    new = live.claim("a", "r", ["r"])  # the client reused the id as soon as it saw the last chunk
    live.release(old, "r")  # the first request's cleanup runs late
    assert live.holds("r")
    live.release(new, "r")
    assert not live.holds("r")


def test_another_tenants_live_ids_are_not_refused_and_run_under_free_aliases():
    live = LiveIds()
    first = live.claim("a", "r", sequence_ids("r", 2))
    assert first.shard_ids == {"r:0": "r:0", "r:1": "r:1"}
    other = live.claim("b", "r", sequence_ids("r", 2))  # the same ids, another tenant: no AlreadyExists
    assert other.shard_ids == {"r:0": "r:0~1", "r:1": "r:1~1"}
    third = live.claim("c", "r:1", ["r:1"])
    assert third.shard_ids == {"r:1": "r:1~2"}
    assert all(live.holds(i) for i in ("r:0", "r:1", "r:0~1", "r:1~1", "r:1~2"))
    live.release(other, "r:0")
    assert not live.holds("r:0~1") and live.holds("r:0"), "each release frees its own shard id only"
    with pytest.raises(AlreadyExists):
        live.claim("b", "r:1", ["r:1"])  # still live for b
    live.release(first, "r:0")
    live.release(first, "r:1")
    assert live.claim("b", "r:0", ["r:0"]).shard_ids == {"r:0": "r:0"}, "a freed id is used as it is again"
