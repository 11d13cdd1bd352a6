"""`kvshare validate` from the command line: its cluster, its own pool, and what it prints."""

from __future__ import annotations

import argparse
from types import TracebackType

import pytest

from kvshare.serve import launcher
from kvshare.serve.launcher import UpConfig
from kvshare.validate import cli as validate_cli


class _FakeCluster:
    """Records the config `kvshare validate` starts its cluster with; starts nothing."""

    def __init__(self, config: UpConfig, started: list[UpConfig]) -> None:
        started.append(config)
        self.url = f"http://127.0.0.1:{config.port}"
        self.pool_address = "unix:/nonexistent.sock"

    def __enter__(self) -> _FakeCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        return None

    def stop_pool(self) -> None: ...

    def start_pool(self) -> None: ...


def _args(**overrides: object) -> argparse.Namespace:
    values = {"target": None, "pool": None, "up": None, "pool_size": "2GiB"}
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("up", [None, "", "--replicas 3"])
def test_the_cluster_it_starts_takes_free_ports(monkeypatch: pytest.MonkeyPatch, up: str | None) -> None:
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
