"""The arena: one shared-memory file of exactly the configured size, mapped by the
daemon and by every replica, and its geometry (how it is cut into slabs).

The daemon creates the file (owner-only, 0600), holds an exclusive flock on it while
it lives (so a second daemon given the same path can tell it is in use), and unlinks it
at shutdown; clients open the existing file by path and check who owns it. The file is sized with ftruncate to exactly the
configured bytes, never rounded (docs/architecture.md F9). Slabs of `slab_bytes` are cut from the
start; a last partial slab is unused and accounted for as `unused_bytes`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvshare.kvpool.page import PAGE_ALIGN

if TYPE_CHECKING:
    import torch

DEFAULT_SLAB_BYTES = 1024**3


@dataclass(frozen=True)
class ArenaGeometry:
    """How an arena of `size_bytes` is cut into slabs of `slab_bytes`.

    Slab i covers [i * slab_bytes, (i + 1) * slab_bytes); slabs are PAGE_ALIGN-aligned.
    """

    size_bytes: int
    slab_bytes: int

    def __post_init__(self) -> None:
        if self.slab_bytes <= 0 or self.slab_bytes % PAGE_ALIGN != 0:
            raise ValueError(
                f"slab size must be a positive multiple of {PAGE_ALIGN} bytes, got {self.slab_bytes}"
            )
        if self.size_bytes < self.slab_bytes:
            raise ValueError(
                f"arena size {self.size_bytes} is smaller than one slab ({self.slab_bytes} bytes)"
            )

    @property
    def slab_count(self) -> int:
        return self.size_bytes // self.slab_bytes

    @property
    def unused_bytes(self) -> int:
        """Bytes after the last full slab: mapped, never handed out."""
        return self.size_bytes - self.slab_count * self.slab_bytes

    def slab_offset(self, slab: int) -> int:
        if not 0 <= slab < self.slab_count:
            raise ValueError(f"slab {slab} out of range [0, {self.slab_count})")
        return slab * self.slab_bytes


class Arena:
    """A shared mapping of the arena file.

    Contract: `view` and `as_tensor` alias the shared memory (no copies). `close` never
    invalidates a live view or tensor: while any exists, the mapping stays until the
    last one is garbage-collected, so a stale reader can read stale bytes but never
    fault.
    """

    def __init__(
        self, path: str, geometry: ArenaGeometry, mapping: mmap.mmap, lock_fd: int | None = None
    ) -> None:
        self.path = path
        self.geometry = geometry
        self._mapping: mmap.mmap | None = mapping
        # The creator's descriptor holding the file's flock; closed by `close`.
        self._lock_fd = lock_fd

    @property
    def size_bytes(self) -> int:
        return self.geometry.size_bytes

    @classmethod
    def create(
        cls,
        path: str,
        size_bytes: int,
        slab_bytes: int = DEFAULT_SLAB_BYTES,
        preallocate: bool = False,
    ) -> Arena:
        """Create the file (FileExistsError if it exists) with mode 0600 and exactly
        `size_bytes`, map it, and hold its flock until `close`.

        `preallocate` allocates every page now (fallocate): the memory is reserved, no
        writer can die of SIGBUS on a full tmpfs later, and registering the mapping with
        CUDA no longer has to fault the pages in one by one.
        """
        geometry = ArenaGeometry(size_bytes, slab_bytes)
        _check_free_space(path, size_bytes)
        fd = _create_locked(path)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size_bytes)
            if preallocate:
                os.posix_fallocate(fd, 0, size_bytes)
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        return cls(path, geometry, mapping, lock_fd=fd)

    @classmethod
    def open(cls, path: str, slab_bytes: int, owner_uids: frozenset[int] | None = None) -> Arena:
        """Map an existing arena file; its size is read from the file. With `owner_uids`,
        the file must be a regular file owned by one of them (else PermissionError):
        memory someone else controls is never mapped."""
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if owner_uids is not None and (
                not stat.S_ISREG(info.st_mode) or info.st_uid not in owner_uids
            ):
                raise PermissionError(
                    f"arena {path} is owned by uid {info.st_uid}, not by this user or root: "
                    "refusing to map it"
                )
            size_bytes = info.st_size
            geometry = ArenaGeometry(size_bytes, slab_bytes)
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, geometry, mapping)

    def view(self, offset: int, nbytes: int) -> memoryview:
        """Return a writable view of [offset, offset + nbytes) of the arena."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size_bytes:
            raise ValueError(
                f"range [{offset}, {offset + nbytes}) outside arena of {self.size_bytes}"
            )
        return memoryview(self._require_mapping())[offset : offset + nbytes]

    def as_tensor(self) -> torch.Tensor:
        """Return a uint8 tensor over the whole mapping (no copy).

        The tensor holds a memoryview of the mapping, which keeps the mapping alive
        (torch.frombuffer on the mmap itself would not, and `close` would unmap it).
        """
        import torch

        return torch.frombuffer(memoryview(self._require_mapping()), dtype=torch.uint8)

    def close(self) -> None:
        """Drop this object's mapping; unmapped now, or when the last view/tensor dies."""
        mapping, self._mapping = self._mapping, None
        lock_fd, self._lock_fd = self._lock_fd, None
        if lock_fd is not None:
            os.close(lock_fd)
        if mapping is None:
            return
        # If views or tensors still alias the mapping, close() refuses, and the mmap
        # object unmaps itself when the last of them is collected.
        with contextlib.suppress(BufferError):
            mapping.close()

    def unlink(self) -> None:
        """Remove the arena file; existing mappings stay valid. The creator calls it before
        `close`: a path is unlinked only while its flock is held (see kvpool.ownership)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _require_mapping(self) -> mmap.mmap:
        if self._mapping is None:
            raise ValueError(f"arena {self.path} is closed")
        return self._mapping


def _create_locked(path: str) -> int:
    """Create `path` (FileExistsError if it exists) already flocked by the returned
    descriptor: the file is made under a random name, locked, then hard-linked to
    `path`, so no other process ever sees it at `path` unlocked and takes it for a
    dead daemon's."""
    temporary = f"{path}.{secrets.token_hex(8)}.tmp"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temporary, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.link(temporary, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(temporary)
    return fd


def _check_free_space(path: str, size_bytes: int) -> None:
    """Refuse an arena the filesystem cannot hold: on tmpfs, writing past the free space
    would kill the writer with SIGBUS instead of failing cleanly."""
    stats = os.statvfs(os.path.dirname(os.path.abspath(path)))
    available = stats.f_bavail * stats.f_frsize
    if size_bytes > available:
        raise ValueError(
            f"arena of {size_bytes} bytes does not fit in {os.path.dirname(path) or '.'}: "
            f"{available} bytes available"
        )
