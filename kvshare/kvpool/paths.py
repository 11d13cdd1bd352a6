"""Where the pool lives by default: one per-user runtime folder for the socket, and
/dev/shm for the arena. Every part that talks to the pool imports these defaults
from here, so they cannot drift apart.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class PoolPaths:
    runtime_dir: str
    socket_path: str
    arena_path: str


def default_pool_paths(environ: Mapping[str, str] | None = None) -> PoolPaths:
    """Return the default paths for the current user.

    Runtime folder: `$XDG_RUNTIME_DIR/kvshare` if set, else `/tmp/kvshare-<uid>`.
    Socket: `<runtime folder>/pool.sock`. Arena: `/dev/shm/kvshare-<uid>-pool.arena`,
    or in the runtime folder when there is no /dev/shm.
    """
    env = os.environ if environ is None else environ
    uid = os.getuid()
    xdg_runtime = env.get("XDG_RUNTIME_DIR")
    runtime_dir = os.path.join(xdg_runtime, "kvshare") if xdg_runtime else f"/tmp/kvshare-{uid}"
    arena_dir = SHM_DIR if os.path.isdir(SHM_DIR) else runtime_dir
    return PoolPaths(
        runtime_dir=runtime_dir,
        socket_path=os.path.join(runtime_dir, "pool.sock"),
        arena_path=os.path.join(arena_dir, f"kvshare-{uid}-pool.arena"),
    )


def ensure_private_dir(path: str) -> None:
    """Make `path` a directory that only the current user can enter (0700).

    Creates it if missing. An existing one must be a real directory (not a symlink)
    owned by the current user, else ValueError: another user could have planted it,
    e.g. under /tmp. Wider permissions on our own directory are tightened.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{path} is not a directory")
    if info.st_uid != os.getuid():
        raise ValueError(f"{path} is owned by uid {info.st_uid}, not by this user ({os.getuid()})")
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)
