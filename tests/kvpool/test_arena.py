from __future__ import annotations

import gc
import os
import stat
from collections.abc import Iterator

import pytest

from kvshare.kvpool.arena import Arena, ArenaGeometry
from kvshare.kvpool.page import PAGE_ALIGN, slot_bytes_for

MIB = 1024 * 1024


@pytest.fixture
def arena_path(tmp_path: object) -> Iterator[str]:
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(folder, f"kvshare-test-{os.getpid()}-{id(tmp_path)}.arena")
    yield path
    if os.path.exists(path):
        os.unlink(path)


def test_arena_file_has_exactly_the_configured_size_and_mode_0600(arena_path: str) -> None:
    """docs/architecture.md F9: never rounded up."""
    size = 3 * MIB + 12288
    arena = Arena.create(arena_path, size, MIB)
    info = os.stat(arena_path)
    assert info.st_size == size == arena.size_bytes
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert len(arena.view(0, size)) == size
    arena.close()
    arena.unlink()
    assert not os.path.exists(arena_path)


def test_geometry_accounts_for_every_byte() -> None:
    geometry = ArenaGeometry(3 * MIB + 12288, MIB)
    assert geometry.slab_count == 3
    assert geometry.unused_bytes == 12288
    assert geometry.slab_count * geometry.slab_bytes + geometry.unused_bytes == geometry.size_bytes
    slot = slot_bytes_for(8192)
    pages = geometry.slab_count * (geometry.slab_bytes // slot)
    assert pages * slot <= geometry.size_bytes
    assert [geometry.slab_offset(i) for i in range(3)] == [0, MIB, 2 * MIB]
    with pytest.raises(ValueError):
        geometry.slab_offset(3)


@pytest.mark.parametrize(("size", "slab"), [(MIB, 2 * MIB), (MIB, 0), (MIB, PAGE_ALIGN + 1)])
def test_geometry_rejects_unusable_sizes(size: int, slab: int) -> None:
    with pytest.raises(ValueError):
        ArenaGeometry(size, slab)


def test_create_refuses_an_existing_file(arena_path: str) -> None:
    Arena.create(arena_path, MIB, MIB).close()
    with pytest.raises(FileExistsError):
        Arena.create(arena_path, MIB, MIB)


def test_create_refuses_more_than_the_filesystem_holds(arena_path: str) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        Arena.create(arena_path, 1 << 60, MIB)
    assert not os.path.exists(arena_path)


def test_open_maps_the_same_memory(arena_path: str) -> None:
    owner = Arena.create(arena_path, 2 * MIB, MIB)
    other = Arena.open(arena_path, MIB)
    assert other.size_bytes == 2 * MIB
    assert other.geometry == owner.geometry
    owner.view(MIB + 5, 3)[:] = b"abc"
    assert bytes(other.view(MIB + 5, 3)) == b"abc"
    other.close()
    owner.close()


def test_view_rejects_ranges_outside_the_arena(arena_path: str) -> None:
    arena = Arena.create(arena_path, MIB, MIB)
    for offset, nbytes in [(-1, 1), (MIB - 1, 2), (0, MIB + 1)]:
        with pytest.raises(ValueError):
            arena.view(offset, nbytes)
    arena.close()
    with pytest.raises(ValueError):
        arena.view(0, 1)


def test_tensor_aliases_the_mapping_and_survives_close(arena_path: str) -> None:
    arena = Arena.create(arena_path, MIB, MIB)
    tensor = arena.as_tensor()
    assert tensor.numel() == MIB
    tensor[100:104] = 7
    assert bytes(arena.view(100, 4)) == b"\x07" * 4
    arena.close()
    gc.collect()
    # The mapping outlives close() while the tensor lives: reading it must not fault.
    assert int(tensor[100:104].sum()) == 28
    peer = Arena.open(arena_path, MIB)
    tensor[200] = 9
    assert peer.view(200, 1)[0] == 9
    peer.close()
