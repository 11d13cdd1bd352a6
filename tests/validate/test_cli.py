"""`kvshare validate` from the command line: its cluster, its own pool, and what it prints."""

from __future__ import annotations

import argparse
from types import TracebackType

import pytest
import torch

from kvshare.cli import main
from kvshare.serve import launcher
from kvshare.serve.launcher import UpConfig
from kvshare.validate import cli as validate_cli
from kvshare.validate import corruption
from kvshare.validate.capacity import pool_geometry
from kvshare.validate.corruption import run_corruption_check
from tests.kvpool.pool_fixture import MIB, PoolFactory

GIB = 1 << 30


class _FakeCluster:
    """Records the config `kvshare validate` starts its cluster with; starts nothing."""

    def __init__(self, config: UpConfig, started: list[UpConfig]) -> None:
        started.append(config)
        self.url = f"http://127.0.0.1:{config.port}"
        self.pool_address = "unix:/nonexistent.sock"

    def __enter__(self) -> _FakeCluster:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def stop_pool(self) -> None: ...

    def start_pool(self) -> None: ...


def _args(**overrides: object) -> argparse.Namespace:
    values = {"target": None, "pool": None, "up": None, "pool_size": "2GiB"}
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("up", [None, "", "--replicas 3"])
def test_the_cluster_it_starts_takes_free_ports(
    monkeypatch: pytest.MonkeyPatch, up: str | None
) -> None:
    started: list[UpConfig] = []
    monkeypatch.setattr(launcher, "Cluster", lambda config, log=None: _FakeCluster(config, started))
    with validate_cli._environment(_args(up=up), ["regression"]) as (_, target):
        assert target == "http://127.0.0.1:0"
    assert [c.port for c in started] == [0]


def test_an_explicit_port_in_up_args_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[UpConfig] = []
    monkeypatch.setattr(launcher, "Cluster", lambda config, log=None: _FakeCluster(config, started))
    with validate_cli._environment(_args(up="--port 9300"), ["regression"]):
        pass
    assert started[0].port == 9300


def test_a_gemma3_27b_corruption_run_gets_a_pool_that_holds_all_its_pages() -> None:
    """The H200 failure: 17 pages of 124 MiB do not fit the default 2 GiB (8 slabs of 2 pages)."""
    (need,) = corruption.pool_needs("gemma3-27b", torch.bfloat16)
    assert (need.payload_bytes, need.pages) == (124 * MIB, 17)
    assert need.pages_held(2 * GIB, 256 * MIB) == 16
    size, slab = pool_geometry([need], 2 * GIB)
    assert need.pages_held(size, slab) >= 17 and size <= 3 * GIB


def test_checks_size_the_pool_they_start_from_what_they_store(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tiny-gemma3 pages (384 KiB) overflow a 1 MiB pool: 17 corrupted pages, 6-chunk prefixes."""
    code = main(
        ["validate", "bytes", "corruption", "faults", "--pool-size", "1MiB", "--trials", "2"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "not found by lookup" not in out


def test_a_given_pool_too_small_for_a_check_is_refused_not_failed(
    pools: PoolFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pool = pools.start(pools.config(size_bytes=2 * MIB, slab_bytes=MIB))
    assert main(["validate", "corruption", "--pool", pool.address]) == 2
    out = capsys.readouterr().out
    assert "holds 4 of the 17 pages of 384 KiB this check keeps at once" in out
    assert "failed" not in out


def test_corruption_on_a_pool_that_evicts_its_pages_is_inconclusive(pools: PoolFactory) -> None:
    pool = pools.start(pools.config(size_bytes=2 * MIB, slab_bytes=MIB))
    result = run_corruption_check(pool.address, pages=16)
    assert not result.failures and result.skipped.startswith(
        "inconclusive: the pool evicted page 0"
    )


def test_piped_output_has_progress_lines_and_a_markdown_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["validate", "pool-fill", "faults", "--pool-size", "8MiB"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["validate pool-fill: started", lines[1]] and lines[1].startswith(
        "validate pool-fill: passed ("
    )
    assert "validate faults: started" in lines
    assert any(line.startswith("validate faults.daemon_restart: passed (") for line in lines)
    assert "| check | status | counts | seconds |" in lines
    row = next(line for line in lines if line.startswith("| pool-fill | passed |"))
    # Every count, whole; 16 MiB: the pool grew to hold the 8 pages of 1 MiB of the faults check.
    assert "verified_bytes=" in row and "arena_bytes=16777216 |" in row
