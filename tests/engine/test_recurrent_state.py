"""RecurrentStates' slot accounting: every slot is free, held by a sequence, a snapshot or a
copy aside, never two of these; snapshots and copies aside together never take more than
`num_snapshots` slots, so a sequence slot is always there for an admitted sequence; and a
snapshot holds the bytes of the state it was taken from."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.recurrent_state import RecurrentStates
from kvshare.models.presets import SHAPE_PRESETS

TINY = SHAPE_PRESETS["tiny-qwen3.5"]
SEQ_SLOTS, SNAPSHOTS = 3, 2

OPS = st.lists(
    st.tuples(
        st.sampled_from(["allocate", "release", "snapshot", "aside", "keep", "drop", "reset"]),
        st.integers(0, 5),
    ),
    max_size=40,
)


def states() -> RecurrentStates:
    return RecurrentStates(TINY, SEQ_SLOTS, SNAPSHOTS, torch.float32, torch.device("cpu"))


def check(s: RecurrentStates, held: list[int]) -> None:
    snapshots = list(s.snapshots.values())
    parts = [*s.free, *held, *snapshots, *s.aside]
    assert sorted(parts) == list(range(SEQ_SLOTS + SNAPSHOTS)), "a slot lost or in two places"
    assert len(snapshots) + len(s.aside) <= SNAPSHOTS


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_slots_are_never_lost_or_shared(ops: list[tuple[str, int]]) -> None:
    s = states()
    held: list[int] = []  # slots of running sequences (at most SEQ_SLOTS, as the scheduler)
    aside: list[tuple[bytes, int]] = []
    for op, n in ops:
        key = bytes([n])
        if op == "allocate" and len(held) < SEQ_SLOTS:
            held.append(s.allocate())
        elif op == "release" and held:
            s.release(held.pop(n % len(held)))
        elif op == "snapshot" and held:
            slot = s.snapshot(key, held[n % len(held)])
            assert slot is None or s.find(key) == slot
        elif op == "aside" and held:
            slot = s.copy_aside(held[n % len(held)])
            if slot is not None:
                assert s.find(key) is None or s.snapshots[key] != slot
                aside.append((key, slot))
        elif op in ("keep", "drop") and aside:
            key, slot = aside.pop(n % len(aside))
            s.keep(key, slot) if op == "keep" else s.drop_aside(slot)
            assert (s.find(key) is not None) == (op == "keep" or key in s.snapshots)
        elif op == "reset":
            s.reset_snapshots()
        check(s, held)


def test_a_copy_aside_is_found_only_once_kept_and_holds_the_source_bytes() -> None:
    s = states()
    source = s.allocate()
    s.rows[source] = torch.arange(s.slot_bytes, dtype=torch.uint8)
    slot = s.copy_aside(source)
    assert slot is not None and s.find(b"k") is None
    s.rows[source].zero_()  # the sequence's step moves its own state on
    s.keep(b"k", slot)
    assert s.find(b"k") == slot
    assert torch.equal(s.rows[slot], torch.arange(s.slot_bytes, dtype=torch.uint8))


def test_copies_aside_make_room_by_evicting_snapshots_and_never_take_a_sequence_slot() -> None:
    s = states()
    seqs = [s.allocate() for _ in range(SEQ_SLOTS)]
    assert s.snapshot(b"old", seqs[0]) is not None
    first = s.copy_aside(seqs[1])
    second = s.copy_aside(seqs[2])  # evicts "old": two slots of snapshots at most
    assert first is not None and second is not None and s.find(b"old") is None
    assert s.copy_aside(seqs[0]) is None  # nothing left to evict
    assert s.snapshot(b"new", seqs[0]) is None
    s.drop_aside(first)
    s.release(seqs[0])
    assert s.allocate() is not None


def test_keeping_a_boundary_already_snapshotted_frees_the_copy() -> None:
    s = states()
    seq = s.allocate()
    slot = s.copy_aside(seq)
    kept = s.snapshot(b"k", seq)  # another sequence reached the boundary meanwhile
    assert slot is not None and kept is not None
    s.keep(b"k", slot)
    assert s.find(b"k") == kept and slot in s.free
    check(s, [seq])
