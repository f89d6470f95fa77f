"""Specification of the CPU tier index's safety under faults (pure logic, a stepped clock):
owners, leases, the slot quarantine and a restarted index's quarantine."""

from __future__ import annotations

from actors.kv_index import (
    GRANT_LEASE_S,
    PIN_LEASE_S,
    RESTART_QUARANTINE_S,
    SLOT_QUARANTINE_S,
    KVIndex,
    OwnerRelease,
    StoreEndpoint,
)

SLOT = 1024
H = [bytes([i]) * 8 for i in range(16)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def index_with(clock: Clock, slots: int = 2, hold_grants_s: float = 0.0) -> KVIndex:
    index = KVIndex(clock=clock, hold_grants_s=hold_grants_s)
    index.register_store(StoreEndpoint("s0", "node", "i0", b"", 0, slots * SLOT))
    index.set_slot_bytes(SLOT)
    return index


def saved(index: KVIndex, hashes: list[bytes], owner: str = "a@1") -> list[int]:
    grant = index.allocate("s0", hashes, owner)
    assert grant is not None
    index.commit(grant, ok=True)
    return grant.slots


def test_release_owner_drops_the_owners_pins_only() -> None:
    index = index_with(Clock())
    saved(index, [H[0]])
    index.lookup("a@1/r1", [H[0]])
    index.lookup("a@10/r1", [H[0]])  # another owner whose name starts the same
    assert index.release_owner("a@1") == OwnerRelease(num_pins=1, num_grants=0, num_slots=0)
    assert index.get_stats().num_pinned == 1
    index.unpin("a@10/r1")
    assert index.get_stats().num_pinned == 0


def test_release_owner_quarantines_the_slots_of_its_open_grants() -> None:
    clock = Clock()
    index = index_with(clock, slots=1)
    grant = index.allocate("s0", [H[0]], "a@1")
    assert grant is not None and grant.slots == [0]
    assert index.release_owner("a@1") == OwnerRelease(num_pins=0, num_grants=1, num_slots=1)
    assert not index.contains(H[0])
    # The dead engine's WRITE may still land: the slot is not granted again yet...
    assert index.allocate("s0", [H[1]], "b@1").hashes == []  # type: ignore[union-attr]
    clock.now += SLOT_QUARANTINE_S
    # ...and is after the quarantine.
    assert index.allocate("s0", [H[1]], "b@1").slots == [0]  # type: ignore[union-attr]


def test_a_commit_after_release_owner_is_ignored() -> None:
    index = index_with(Clock())
    grant = index.allocate("s0", [H[0]], "a@1")
    assert grant is not None
    index.release_owner("a@1")
    index.commit(grant, ok=True)
    assert not index.contains(H[0])


def test_a_failed_commit_frees_its_slots_at_once() -> None:
    """ok=False means the worker's transfer has ended, so no quarantine is needed."""
    index = index_with(Clock(), slots=1)
    grant = index.allocate("s0", [H[0]], "a@1")
    assert grant is not None
    index.commit(grant, ok=False)
    assert index.allocate("s0", [H[1]], "a@1").slots == grant.slots  # type: ignore[union-attr]


def test_an_open_grant_past_its_lease_is_reclaimed_through_quarantine() -> None:
    clock = Clock()
    index = index_with(clock, slots=1)
    grant = index.allocate("s0", [H[0]], "a@1")
    assert grant is not None
    clock.now += GRANT_LEASE_S - 1
    assert index.get_stats().num_open_grants == 1
    clock.now += 1
    stats = index.get_stats()
    assert stats.num_open_grants == 0 and stats.num_expired_grants == 1 and stats.num_quarantined_slots == 1
    index.commit(grant, ok=True)  # too late: ignored
    assert not index.contains(H[0])
    clock.now += SLOT_QUARANTINE_S
    assert index.allocate("s0", [H[1]], "b@1").slots == grant.slots  # type: ignore[union-attr]


def test_a_pin_past_its_lease_is_dropped() -> None:
    clock = Clock()
    index = index_with(clock, slots=1)
    saved(index, [H[0]])
    index.lookup("a@1/r1", [H[0]])
    clock.now += PIN_LEASE_S - 1
    assert index.allocate("s0", [H[1]], "b@1").hashes == []  # type: ignore[union-attr]  # H[0] is pinned
    clock.now += 1
    assert index.allocate("s0", [H[1]], "b@1").hashes == [H[1]]  # type: ignore[union-attr]  # evicted
    assert index.get_stats().num_expired_pins == 1


def test_a_lapsed_pin_never_unpins_a_block_saved_again_under_its_hash() -> None:
    """Pins hold the blocks they pinned: after a store restart forgets a pinned block and the
    hash is saved again, the old lookup's unpin leaves the new block alone."""
    index = index_with(Clock())
    saved(index, [H[0]])
    index.lookup("a@1/r1", [H[0]])
    index.register_store(StoreEndpoint("s0", "node", "i1", b"", 0, 2 * SLOT))
    saved(index, [H[0]])
    index.lookup("b@1/r1", [H[0]])
    index.unpin("a@1/r1")
    assert index.get_stats().num_pinned == 1


def test_a_restarted_index_grants_nothing_during_its_quarantine() -> None:
    clock = Clock()
    index = index_with(clock, hold_grants_s=RESTART_QUARANTINE_S)
    assert index.allocate("s0", [H[0]], "a@1") is None
    assert index.lookup("a@1/r1", [H[0]]).locations == []  # lookups simply miss
    clock.now += RESTART_QUARANTINE_S
    assert index.allocate("s0", [H[0]], "a@1").hashes == [H[0]]  # type: ignore[union-attr]


def test_grant_ids_differ_across_index_lives() -> None:
    """A commit meant for a previous life's grant can never settle one of this life."""
    old, new = index_with(Clock()), index_with(Clock())
    stale = old.allocate("s0", [H[0]], "a@1")
    fresh = new.allocate("s0", [H[1]], "a@1")
    assert stale is not None and fresh is not None and stale.grant_id != fresh.grant_id
    new.commit(stale, ok=False)
    new.commit(fresh, ok=True)
    assert new.contains(H[1])


def test_allocate_sizes_the_stores_of_an_index_that_restarted_empty() -> None:
    index = KVIndex()
    index.register_store(StoreEndpoint("s0", "node", "i0", b"", 0, 4 * SLOT))
    grant = index.allocate("s0", [H[0]], "a@1", slot_bytes=SLOT)
    assert grant is not None and grant.hashes == [H[0]] and index.capacity("s0") == 4


def test_registering_the_known_incarnation_again_keeps_its_blocks() -> None:
    """A store and a restarted index may both announce the same incarnation."""
    index = index_with(Clock())
    saved(index, [H[0]])
    index.register_store(StoreEndpoint("s0", "node", "i0", b"", 0, 2 * SLOT))
    assert index.contains(H[0])


def test_clear_keeps_busy_slots_out_of_use_until_their_quarantine_ends() -> None:
    clock = Clock()
    index = index_with(clock, slots=2)
    saved(index, [H[0]])
    index.lookup("a@1/r1", [H[0]])  # a load may be reading slot 0
    index.clear()
    assert index.allocate("s0", [H[1], H[2]], "a@1").slots == [1]  # type: ignore[union-attr]
    clock.now += SLOT_QUARANTINE_S
    assert index.allocate("s0", [H[3]], "a@1").slots == [0]  # type: ignore[union-attr]


def test_a_forgotten_store_brings_no_quarantined_slot_back() -> None:
    clock = Clock()
    index = index_with(clock, slots=1)
    index.allocate("s0", [H[0]], "a@1")
    index.release_owner("a@1")  # slot 0 in quarantine
    index.forget_store("s0")
    index.register_store(StoreEndpoint("s0", "node", "i0", b"", 0, SLOT))
    clock.now += SLOT_QUARANTINE_S
    assert index.allocate("s0", [H[1]], "b@1").slots == [0]  # type: ignore[union-attr]
    assert index.allocate("s0", [H[2]], "b@1").hashes == []  # type: ignore[union-attr]  # slot 0 granted once
