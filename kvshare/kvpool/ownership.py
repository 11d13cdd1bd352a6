"""Which daemon owns which pool files, and removing what dead daemons left behind.

A daemon holds an exclusive flock on `<socket>.lock` for as long as it runs; the file
records its pid, socket and arena. The kernel drops a flock when its process dies,
however it dies (SIGKILL included), so a lock file that can be locked belongs to a dead
daemon: its socket, its arena and the lock file itself are leftovers. The arena file is
flocked by its daemon too, so a second daemon given the same arena path sees it is live.

Removal protocol: a file is unlinked only by a process that holds the flock on the
inode the path names at that moment; so no one unlinks a live daemon's file, or the
fresh file of a daemon that replaced a stale one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
from dataclasses import dataclass

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
# Where `kvshare pool` writes the address clients use when given none.
ADDRESS_FILE = "pool.address"


class PoolInUseError(ValueError):
    """The socket or arena path belongs to a live pool daemon."""


@dataclass(frozen=True)
class DaemonRecord:
    """What a daemon's lock file says about it."""

    pid: int
    socket_path: str
    arena_path: str

    @property
    def lock_path(self) -> str:
        return lock_path_for(self.socket_path)


def lock_path_for(socket_path: str) -> str:
    return socket_path + LOCK_SUFFIX


def lock_exclusive(path: str, create: bool) -> int | None:
    """Open `path` (a regular file of this user, never through a symlink) and take an
    exclusive flock without waiting. Returns the descriptor, which holds the lock until
    closed; None if another process holds it. FileNotFoundError if `path` does not exist
    and not `create`; ValueError if it is not a regular file of this user.

    The flock is taken on an inode; if the path no longer names that inode once it is
    held (a concurrent remover got there first), this tries again on the new one.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    while True:
        fd = os.open(path, flags, 0o600)
        try:
            opened = os.fstat(fd)
            check_owned_file(path, opened)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                current = os.lstat(path)
            except FileNotFoundError:
                current = None
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if current is not None and (current.st_dev, current.st_ino) == (
            opened.st_dev,
            opened.st_ino,
        ):
            return fd
        os.close(fd)
        if current is None and not create:
            raise FileNotFoundError(path)


def check_owned_file(path: str, info: os.stat_result) -> None:
    """ValueError unless `info` (of `path`) is a regular file owned by this user."""
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file")
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")


def write_record(fd: int, record: DaemonRecord) -> None:
    body = json.dumps({"pid": record.pid, "socket": record.socket_path, "arena": record.arena_path})
    os.ftruncate(fd, 0)
    os.pwrite(fd, body.encode(), 0)


def read_record(fd: int, lock_path: str) -> DaemonRecord | None:
    """The record in an open lock file; None if it is empty or not one of ours."""
    raw = os.pread(fd, 65536, 0)
    try:
        fields = json.loads(raw)
        record = DaemonRecord(int(fields["pid"]), str(fields["socket"]), str(fields["arena"]))
    except (ValueError, TypeError, KeyError):
        return None
    return record if record.lock_path == lock_path else None


def remove_if_unlocked(path: str) -> bool | None:
    """Unlink `path` if no live process holds its flock: True if removed, False if it
    was not there, None if it is live (left alone)."""
    try:
        fd = lock_exclusive(path, create=False)
    except FileNotFoundError:
        return False
    if fd is None:
        return None
    try:
        os.unlink(path)
    finally:
        os.close(fd)
    return True


def remove_leftovers(record: DaemonRecord) -> list[str]:
    """Remove a dead daemon's socket and arena (the caller holds its lock file).
    Returns the paths removed; an arena now held by a live daemon is left alone."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(record.socket_path).st_mode):
            os.unlink(record.socket_path)
            removed.append(record.socket_path)
    try:
        if remove_if_unlocked(record.arena_path):
            removed.append(record.arena_path)
    except ValueError as error:
        log.warning("leaving %s: %s", record.arena_path, error)
    return removed


def claim_socket(socket_path: str, arena_path: str) -> int:
    """Lock `<socket>.lock` for this process and record this daemon in it; returns the
    descriptor that holds the lock. A dead owner's socket and arena are removed first;
    a live owner means PoolInUseError."""
    lock_path = lock_path_for(socket_path)
    fd = lock_exclusive(lock_path, create=True)
    if fd is None:
        raise PoolInUseError(
            f"a pool daemon is already serving at {socket_path} ({lock_path} is held)"
        )
    try:
        previous = read_record(fd, lock_path)
        if previous is not None:
            for path in remove_leftovers(previous):
                log.warning("removed %s, left by pool daemon %d that died", path, previous.pid)
        write_record(fd, DaemonRecord(os.getpid(), socket_path, arena_path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def release_socket(fd: int, socket_path: str) -> None:
    """Remove the lock file (still holding its lock, per the removal protocol), then unlock."""
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path_for(socket_path))
    finally:
        os.close(fd)


@dataclass(frozen=True)
class CleanupReport:
    removed: tuple[str, ...]
    live: tuple[DaemonRecord, ...]


def clean_folder(folder: str) -> CleanupReport:
    """Remove the leftovers of every dead daemon whose lock file is in `folder` (socket,
    arena, lock file), and the address file if the socket it names is gone. Live
    daemons are left alone and listed."""
    removed: list[str] = []
    live: list[DaemonRecord] = []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return CleanupReport((), ())
    for name in names:
        if name.endswith(LOCK_SUFFIX):
            _clean_lock(os.path.join(folder, name), removed, live)
    address_path = os.path.join(folder, ADDRESS_FILE)
    address = read_address(address_path)
    if address is not None and not os.path.exists(address.removeprefix("unix:")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address_path)
            removed.append(address_path)
    return CleanupReport(tuple(removed), tuple(live))


def _clean_lock(lock_path: str, removed: list[str], live: list[DaemonRecord]) -> None:
    try:
        fd = lock_exclusive(lock_path, create=False)
    except (FileNotFoundError, ValueError):
        return
    if fd is None:
        with open(lock_path, "rb") as held:
            record = read_record(held.fileno(), lock_path)
        if record is not None:
            live.append(record)
        return
    try:
        record = read_record(fd, lock_path)
        if record is None:
            return  # not a pool daemon's lock file
        removed.extend(remove_leftovers(record))
        os.unlink(lock_path)
        removed.append(lock_path)
    finally:
        os.close(fd)


def read_address(path: str) -> str | None:
    """The pool address in an address file; None if absent or not a `unix:` address."""
    try:
        with open(path, encoding="utf-8") as file:
            address = file.read().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return address if address.startswith("unix:") and len(address) > len("unix:") else None


def publish_address(folder: str, socket_path: str) -> str:
    """Write `unix:<socket>` to the folder's address file, atomically; returns its path."""
    path = os.path.join(folder, ADDRESS_FILE)
    temporary = f"{path}.{os.getpid()}.tmp"
    fd = os.open(
        temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        os.write(fd, f"unix:{socket_path}\n".encode())
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return path


def unpublish_address(folder: str, socket_path: str) -> None:
    """Remove the address file if it still names `socket_path` (another daemon may have
    published since), and the folder if nothing else is left in it."""
    path = os.path.join(folder, ADDRESS_FILE)
    if read_address(path) == f"unix:{socket_path}":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
