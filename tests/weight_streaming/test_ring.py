"""The native engine on its own: ring reuse and ordering, asynchronous copies, and every guard's named error."""

from __future__ import annotations

import pytest
import torch

from shard_svc.weight_streaming.errors import (ByteSizeMismatchError, MissingSlotError, NotHostTensorError,
                                        ShortSlotMapError, SlotBusyError, SlotMapError)

ALIGN = 256
SLOT = 4 * ALIGN


def layer_tensors(layer: int) -> list[torch.Tensor]:
    """Two tensors per layer whose bytes say which layer they belong to."""
    return [torch.full((64,), float(layer), dtype=torch.float32), torch.full((32,), layer, dtype=torch.int32) * 10]


@pytest.fixture
def ring(native):
    """3 slots; layers 0..5 each with two tensors at offsets 0 and 256."""
    engine = native.StreamEngine(3, SLOT, "cpu")
    tensors = {}
    for layer in range(6):
        a, b = layer_tensors(layer)
        ids = [engine.add_host(a, f"l{layer}.a"), engine.add_host(b, f"l{layer}.b")]
        engine.set_members(layer, ids)
        engine.set_slot_map(layer, ids, [0, ALIGN], [a.nbytes, b.nbytes])
        tensors[layer] = (ids, a, b)
    return engine, tensors


def slot_layer(engine, slot: int) -> tuple[float, int]:
    buf = engine.slot(slot)
    return float(buf[:256].view(torch.float32)[0]), int(buf[ALIGN:ALIGN + 128].view(torch.int32)[0])


def test_ring_assigns_slots_round_robin_and_reuses_them(ring):
    engine, _ = ring
    addresses = [engine.slot(s).data_ptr() for s in range(3)]
    order = []
    for layer in range(6):
        if layer >= 3:
            engine.acquire(layer - 3)
            engine.release(layer - 3)
        order.append(engine.fetch(layer))
    assert order == [0, 1, 2, 0, 1, 2]
    for layer in range(3, 6):
        slot = engine.acquire(layer)
        assert slot_layer(engine, slot) == (float(layer), layer * 10)
        engine.release(layer)
    assert [engine.slot(s).data_ptr() for s in range(3)] == addresses  # fixed-address slots


def test_acquire_waits_for_the_copy(native):
    engine = native.StreamEngine(2, 64 << 20, "cpu")
    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB: the worker thread is still copying when acquire runs
    hid = engine.add_host(big, "big")
    engine.set_members(0, [hid])
    engine.set_slot_map(0, [hid], [0], [big.nbytes])
    slot = engine.fetch(0)
    assert engine.acquire(0) == slot
    assert torch.equal(engine.slot(slot).view(torch.float32), big)
    engine.release(0)
    stats = engine.stats()
    assert stats["bytes"] == big.nbytes and stats["copies"] == 1 and stats["copy_s"] > 0


def test_a_slot_in_use_is_never_overwritten(ring):
    engine, _ = ring
    engine.fetch(0)
    engine.acquire(0)  # a kernel may be reading slot 0
    engine.fetch(1)
    engine.fetch(2)
    with pytest.raises(SlotBusyError, match="compute has not released"):
        engine.fetch(3)
    assert slot_layer(engine, 0) == (0.0, 0)  # untouched
    engine.release(0)
    assert engine.fetch(3) == 0


def test_an_unused_prefetch_is_not_overwritten(ring):
    engine, _ = ring
    for layer in range(3):
        engine.fetch(layer)
    with pytest.raises(SlotBusyError, match="never acquired"):
        engine.fetch(3)
    engine.drain()  # an aborted pass: prefetched slots become free
    assert engine.occupancy() == 0
    assert engine.fetch(3) == 0


def test_layer_fetched_twice_is_refused(ring):
    engine, _ = ring
    engine.fetch(0)
    with pytest.raises(SlotBusyError, match="already in slot"):
        engine.fetch(0)


def test_byte_size_mismatch_is_checked_before_any_copy(native):
    engine = native.StreamEngine(2, SLOT, "cpu")
    a, b = torch.ones(64), torch.ones(64)
    ids = [engine.add_host(a, "layer0.a"), engine.add_host(b, "layer0.b")]
    engine.set_members(0, ids)
    engine.set_slot_map(0, ids, [0, ALIGN], [a.nbytes, b.nbytes - 4])  # b's region is one float short
    engine.slot(0).fill_(7)
    with pytest.raises(ByteSizeMismatchError, match=r"layer0\.b.*256 bytes.*252 bytes"):
        engine.fetch(0)
    assert bool((engine.slot(0) == 7).all())  # not even `a` was copied
    with pytest.raises(MissingSlotError):
        engine.acquire(0)  # the failed fetch left no slot claiming layer 0


def test_host_tensor_without_a_slot_is_refused(ring):
    engine, tensors = ring
    stray = engine.add_host(torch.zeros(8), "stray")
    with pytest.raises(MissingSlotError, match="stray has no device slot in layer 0"):
        engine.fetch(0, [tensors[0][0][0], stray])
    with pytest.raises(MissingSlotError, match="layer 9 has no slot map"):
        engine.fetch(9)


def test_acquire_of_an_unfetched_layer_is_refused(ring):
    engine, _ = ring
    engine.fetch(0)
    with pytest.raises(MissingSlotError, match=r"layer 1: no device slot holds it.*layer 0"):
        engine.acquire(1)


def test_short_slot_map_is_refused(native):
    engine = native.StreamEngine(2, SLOT, "cpu")
    ids = [engine.add_host(torch.ones(4), f"layer3.t{i}") for i in range(3)]
    engine.set_members(3, ids)
    with pytest.raises(ShortSlotMapError, match=r"covers 2 of its 3 tensors; missing: layer3\.t2"):
        engine.set_slot_map(3, ids[:2], [0, ALIGN], [16, 16])
    # A map that covered the layer, then the layer grew: the fetch re-checks.
    engine.set_members(3, ids[:2])
    engine.set_slot_map(3, ids[:2], [0, ALIGN], [16, 16])
    engine.set_members(3, ids)
    with pytest.raises(ShortSlotMapError):
        engine.fetch(3)


@pytest.mark.parametrize("offsets,sizes,match", [
    ([0, 100], [16, 16], "multiples of 256"),
    ([0, 3 * ALIGN], [16, 2 * ALIGN], "slot holds 1024 bytes"),
    ([0, ALIGN], [ALIGN + 4, 16], "overlaps"),
], ids=["misaligned", "past-the-end", "overlap"])
def test_malformed_slot_maps_are_refused(native, offsets, sizes, match):
    engine = native.StreamEngine(1, SLOT, "cpu")
    ids = [engine.add_host(torch.ones(4), f"t{i}") for i in range(2)]
    engine.set_members(0, ids)
    with pytest.raises(SlotMapError, match=match):
        engine.set_slot_map(0, ids, offsets, sizes)


def test_non_contiguous_host_tensor_is_refused(native):
    engine = native.StreamEngine(1, SLOT, "cpu")
    with pytest.raises(NotHostTensorError, match="not contiguous"):
        engine.add_host(torch.ones(8, 8).t(), "transposed")


def test_on_demand_copies_and_validity(ring):
    engine, tensors = ring
    (a_id, b_id), _, _ = tensors[4]
    engine.fetch(4, [a_id])  # dense part only
    slot = engine.acquire(4)
    with pytest.raises(MissingSlotError, match=r"l4\.b of layer 4 has not been copied"):
        engine.check_valid(4, [b_id])
    engine.slot(slot)[ALIGN:2 * ALIGN].fill_(0xAB)  # what a previous occupant might have left
    assert engine.fetch_into(4, [b_id, a_id]) == tensors[4][2].nbytes  # a is already there
    engine.check_valid(4, [a_id, b_id])
    assert slot_layer(engine, slot) == (4.0, 40)
    engine.release(4)
    with pytest.raises(MissingSlotError):
        engine.fetch_into(4, [b_id])  # released: no slot to copy into


def test_adjacent_tensors_coalesce_into_one_copy(native):
    engine = native.StreamEngine(1, 2 * ALIGN, "cpu")
    arena = torch.arange(128, dtype=torch.float32)  # two 256-byte tensors back to back in one host arena
    ids = [engine.add_host(arena[:64], "a"), engine.add_host(arena[64:], "b")]
    engine.set_members(0, ids)
    engine.set_slot_map(0, ids, [0, ALIGN], [ALIGN, ALIGN])
    engine.fetch(0)
    engine.acquire(0)
    engine.release(0)
    stats = engine.stats()
    assert stats["tensors"] == 2 and stats["copies"] == 1 and stats["bytes"] == 2 * ALIGN
    assert torch.equal(engine.slot(0).view(torch.float32), arena)


def test_a_cuda_engine_needs_dedicated_streams(native):
    from shard_svc.weight_streaming.errors import NativeBuildError

    with pytest.raises(NativeBuildError, match="two dedicated streams"):
        native.StreamEngine(1, SLOT, "cuda:0")  # checked before any device work: runs on a CPU machine too
