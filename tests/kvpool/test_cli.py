"""`kvshare pool` / `kvshare pool-stats`, and the per-user default paths."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import stat
import subprocess
import sys

import pytest

from kvshare.kvpool.cli import READY_PREFIX, main, register, run_pool
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.paths import default_pool_paths, ensure_private_dir
from tests.kvpool.pool_fixture import MIB, PoolFactory, child_env


def test_register_adds_both_subcommands() -> None:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["pool", "--size", "4GiB"])
    assert args.func is run_pool and args.slab_size == "1GiB" and args.socket is None
    args = parser.parse_args(["pool-stats", "--json"])
    assert args.json is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "lots"], "not a size"),
        (["--size", "4XiB"], "unknown size unit"),
        (["--size", "1MiB", "--slab-size", "2MiB"], "smaller than one slab"),
        (["--size", "4MiB", "--slab-size", "1000"], "multiple of 4096"),
    ],
)
def test_bad_sizes_exit_2_with_a_clear_message(
    pools: PoolFactory, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    socket_path = os.path.join(pools.folder, "never.sock")
    assert main(["pool", "--socket", socket_path, "--arena", socket_path + ".arena", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(socket_path)


def test_a_second_daemon_on_the_same_socket_refuses(
    pools: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = pools.start()
    other_arena = os.path.join(pools.folder, "other.arena")
    argv = [
        "pool",
        "--size",
        "4MiB",
        "--slab-size",
        "1MiB",
        "--socket",
        pool.config.socket_path,
        "--arena",
        other_arena,
    ]
    assert main(argv) == 1
    assert "already serving" in capsys.readouterr().err
    assert not os.path.exists(other_arena)
    assert os.path.exists(pool.config.arena_path)
    client = PoolClient(pool.address)
    assert client.stats()["arena_path"] == pool.config.arena_path
    client.close()


def test_pool_stats_prints_json_and_tables(
    pools: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = pools.start(pools.config(size_bytes=3 * MIB, slab_bytes=MIB))
    client = PoolClient(pool.address)
    stored = [bytes([n]) * 16 for n in range(5)]
    client.reserve(stored, 4096)
    client.commit(stored, [b""] * 5)
    client.close()

    assert main(["pool-stats", "--socket", pool.config.socket_path, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["arena_bytes"], stats["slab_count"], stats["committed"]) == (3 * MIB, 3, 5)
    assert stats["classes"][0]["committed"] == 5

    assert main(["pool-stats", "--socket", pool.config.socket_path]) == 0
    tables = capsys.readouterr().out
    assert "page classes" in tables and "committed" in tables and "3.00 MiB" not in tables
    assert "3 MiB" in tables
    # Piped (capsys is not a terminal): Markdown rows with every cell whole, long paths too.
    assert f"| arena | {pool.config.arena_path} (3 MiB) |" in tables
    assert "| committed | 5 |" in tables


def test_pool_stats_without_a_daemon_exits_1(
    pools: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["pool-stats", "--socket", os.path.join(pools.folder, "none.sock")]) == 1
    assert "pool-stats" in capsys.readouterr().err


def test_default_socket_lives_in_a_private_runtime_folder(pools: PoolFactory) -> None:
    runtime = os.path.join(pools.folder, "xdg")
    os.makedirs(runtime, mode=0o755)
    arena = os.path.join(pools.folder, "pool.arena")
    env = dict(child_env(), XDG_RUNTIME_DIR=runtime)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvshare.kvpool.cli",
            "pool",
            "--size",
            "2MiB",
            "--slab-size",
            "1MiB",
            "--arena",
            arena,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        ready = process.stdout.readline()
        socket_path = os.path.join(runtime, "kvshare", "pool.sock")
        assert ready.startswith(READY_PREFIX) and f"socket={socket_path}" in ready
        assert "size=2 MiB" in ready
        assert stat.S_IMODE(os.stat(os.path.dirname(socket_path)).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(arena).st_mode) == 0o600
    finally:
        process.terminate()
        assert process.wait(10) == 0
        process.stdout.close()
    assert not os.path.exists(socket_path) and not os.path.exists(arena)
    assert not os.path.exists(os.path.dirname(socket_path)), "runtime folder left behind"


def test_default_pool_paths() -> None:
    uid = os.getuid()
    with_xdg = default_pool_paths({"XDG_RUNTIME_DIR": "/run/user/1234"})
    assert with_xdg.runtime_dir == "/run/user/1234/kvshare"
    assert with_xdg.socket_path == "/run/user/1234/kvshare/pool.sock"
    for environ in ({}, {"XDG_RUNTIME_DIR": ""}, {"XDG_RUNTIME_DIR": "relative/dir"}):
        without = default_pool_paths(environ)
        assert without.runtime_dir == f"/tmp/kvshare-{uid}"
        assert without.socket_path == f"/tmp/kvshare-{uid}/pool.sock"
    # The arena's name is unpredictable: no other user can create it first.
    arenas = {default_pool_paths({}).arena_path for _ in range(2)}
    expected_dir = "/dev/shm" if os.path.isdir("/dev/shm") else without.runtime_dir
    assert len(arenas) == 2
    for arena in arenas:
        assert os.path.dirname(arena) == expected_dir
        assert re.fullmatch(rf"kvshare-{uid}-[0-9a-f]{{16}}\.arena", os.path.basename(arena))


def test_ensure_private_dir_creates_tightens_and_refuses(pools: PoolFactory) -> None:
    fresh = os.path.join(pools.folder, "a", "b")
    ensure_private_dir(fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    os.chmod(fresh, 0o755)
    ensure_private_dir(fresh)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    for writable in (0o770, 0o777, 0o1777):  # others could have planted files in it
        os.chmod(fresh, writable)
        with pytest.raises(ValueError, match="writable by group or others"):
            ensure_private_dir(fresh)
    not_a_dir = os.path.join(pools.folder, "file")
    open(not_a_dir, "w").close()
    with pytest.raises((ValueError, FileExistsError)):
        ensure_private_dir(not_a_dir)
    link = os.path.join(pools.folder, "link")
    os.symlink(fresh, link)
    with pytest.raises(ValueError):
        ensure_private_dir(link)


def _pool_argv(socket_path: str, arena_path: str, *more: str) -> list[str]:
    return [
        "pool",
        "--size",
        "4MiB",
        "--slab-size",
        "1MiB",
        "--socket",
        socket_path,
        "--arena",
        arena_path,
        *more,
    ]


def test_pool_stats_finds_the_running_pool_without_an_address(
    pools: PoolFactory, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = pools.start()
    address_file = os.path.join(pools.runtime_dir, "pool.address")
    with open(address_file) as file:
        assert file.read().strip() == pool.address
    monkeypatch.setenv("XDG_RUNTIME_DIR", pools.folder)
    assert main(["pool-stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["arena_path"] == pool.config.arena_path
    assert pool.stop() == 0
    assert not os.path.exists(pools.runtime_dir), "address file or runtime folder left behind"
    assert main(["pool-stats", "--json"]) == 1


def test_a_second_daemon_on_a_live_arena_refuses_and_the_first_keeps_serving(
    pools: PoolFactory,
) -> None:
    pool = pools.start()
    arena = pool.config.arena_path
    inode = os.stat(arena).st_ino
    other_socket = os.path.join(pools.folder, "other.sock")
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshare.kvpool.cli",
            *_pool_argv(other_socket, arena, "--no-runtime-dir"),
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "in use by another live pool daemon" in second.stderr
    assert os.stat(arena).st_ino == inode
    assert not os.path.exists(other_socket) and not os.path.exists(other_socket + ".lock")
    client = PoolClient(pool.address)
    reservation = client.reserve([bytes(16)], 4096)
    client.commit([bytes(16)], [b""])
    assert len(reservation.pages) == 1 and len(client.lookup([bytes(16)]).pages) == 1
    client.close()


def test_a_socket_in_a_folder_others_can_write_is_refused(pools: PoolFactory) -> None:
    shared = os.path.join(pools.folder, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    socket_path = os.path.join(shared, "pool.sock")
    argv = _pool_argv(socket_path, os.path.join(pools.folder, "x.arena"), "--no-runtime-dir")
    result = subprocess.run(
        [sys.executable, "-m", "kvshare.kvpool.cli", *argv],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "writable by group or others" in result.stderr
    assert os.listdir(shared) == []


def test_the_next_start_removes_what_a_killed_daemon_left(pools: PoolFactory) -> None:
    """SIGKILL leaves socket, lock file and arena; a later daemon with other paths in the
    same runtime folder (as the next `kvshare up`) removes them."""
    killed = pools.start()
    os.kill(killed.pid, signal.SIGKILL)
    killed.wait(10)
    leftovers = [
        killed.config.socket_path,
        killed.config.socket_path + ".lock",
        killed.config.arena_path,
    ]
    assert all(os.path.exists(path) for path in leftovers)
    pools.start()
    assert not any(os.path.exists(path) for path in leftovers)


def test_cleanup_removes_dead_daemons_files_and_leaves_live_ones(
    pools: PoolFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    live = pools.start()
    killed = pools.start()
    killed.kill()
    leftovers = [
        killed.config.socket_path,
        killed.config.socket_path + ".lock",
        killed.config.arena_path,
    ]
    assert main(["pool", "--cleanup", "--runtime-dir", pools.runtime_dir]) == 0
    out = capsys.readouterr().out
    for path in leftovers:
        assert f"removed {path}" in out and not os.path.exists(path)
    assert f"left alone the live daemon (pid {live.pid})" in out
    assert os.path.exists(live.config.arena_path) and os.path.exists(live.config.socket_path)
    assert main(["pool", "--cleanup", "--socket", live.config.socket_path]) == 1
    assert "refusing to clean it" in capsys.readouterr().err
    client = PoolClient(live.address)
    assert client.stats()["arena_path"] == live.config.arena_path
    client.close()
