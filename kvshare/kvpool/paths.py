"""Where the pool lives by default: one per-user runtime folder for the socket, its
lock file and the published address, and /dev/shm for the arena. Every part that talks
to the pool imports these defaults from here, so they cannot drift apart.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from kvshare.kvpool.ownership import ADDRESS_FILE, read_address

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolPaths:
    runtime_dir: str
    socket_path: str
    arena_path: str

    @property
    def address_path(self) -> str:
        """The file in which a running daemon publishes its address."""
        return os.path.join(self.runtime_dir, ADDRESS_FILE)


def default_runtime_dir(environ: Mapping[str, str] | None = None) -> str:
    """`$XDG_RUNTIME_DIR/kvshare` if that variable names an absolute path, else
    `/tmp/kvshare-<uid>` (an unset or empty variable never turns into `/kvshare`)."""
    env = os.environ if environ is None else environ
    xdg_runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg_runtime):
        return os.path.join(xdg_runtime, "kvshare")
    return f"/tmp/kvshare-{os.getuid()}"


def default_pool_paths(environ: Mapping[str, str] | None = None) -> PoolPaths:
    """Return the default paths for the current user.

    Socket: `<runtime folder>/pool.sock`. Arena: `/dev/shm/kvshare-<uid>-<random>.arena`
    (or in the runtime folder when there is no /dev/shm): a name no other user can
    predict, so none can create it first. Each call draws a new arena name.
    """
    runtime_dir = default_runtime_dir(environ)
    arena_dir = SHM_DIR if os.path.isdir(SHM_DIR) else runtime_dir
    return PoolPaths(
        runtime_dir=runtime_dir,
        socket_path=os.path.join(runtime_dir, "pool.sock"),
        arena_path=os.path.join(arena_dir, f"kvshare-{os.getuid()}-{secrets.token_hex(8)}.arena"),
    )


def default_pool_address(environ: Mapping[str, str] | None = None) -> str:
    """The address for a client given none: what the running daemon published in the
    runtime folder (`kvshare up` or `kvshare pool`), else the default socket."""
    paths = default_pool_paths(environ)
    return read_address(paths.address_path) or f"unix:{paths.socket_path}"


def ensure_private_dir(path: str) -> None:
    """Make `path` a directory that only the current user can enter (0700).

    Creates it if missing, then `check_private_dir`; read or search permission for
    others on our own directory is removed.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = check_private_dir(path)
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)


def check_private_dir(path: str) -> os.stat_result:
    """ValueError unless `path` is a real directory (not a symlink) owned by the current
    user and writable by no one else: another user could have planted it, or files in
    it, e.g. under /tmp."""
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}): "
            "refusing to use it; use a folder only you can write, e.g. mode 0700"
        )
    return info
