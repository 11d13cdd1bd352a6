"""The cluster under test: a running router's URL, or one that `kvshare up` starts for the run."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.serve.launcher import UpConfig


@dataclass(frozen=True)
class Target:
    url: str  # the router
    model: str | None  # the model spec, when the bench started the cluster and so knows it


def up_config(up_args: str) -> UpConfig:
    """`kvshare up ARGS` as an UpConfig, parsed by `kvshare up`'s own parser.

    Ports default to free ones (`--port 0`) rather than `kvshare up`'s 8080, which may be
    taken; an explicit --port in ARGS still wins.
    """
    from kvshare.serve.launcher import UpConfig

    return UpConfig.from_args(["--port", "0", *shlex.split(up_args)])


@contextmanager
def cluster_target(target: str | None, up_args: str | None, log: Path) -> Iterator[Target]:
    """`target` as given, or a cluster started with `kvshare up` ARGS (its output to `log`),
    which is shut down (pool files removed) when the block exits."""
    if target is not None:
        yield Target(target, None)
        return
    # Imported here: benchmarking a running cluster needs nothing from kvshare.serve.
    from kvshare.preflight import check_up
    from kvshare.serve.launcher import Cluster

    config = up_config(up_args or "")
    check_up(config)
    with log.open("a") as stream, Cluster(config, log=stream) as cluster:
        yield Target(cluster.url, config.model)
