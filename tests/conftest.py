"""Shared fixtures. GPU-only tests carry the `cuda` marker and skip without CUDA."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

from tests.kvpool.pool_fixture import PoolFactory


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def collect_engines_after_each_module() -> Iterator[None]:
    """Engines sit in reference cycles (engine, scheduler, connector), and a cycle is freed
    only when the collector runs, which counts objects, not bytes: one module's engines,
    each with a 1 GiB CPU KV cache by default, could still be held while the next module
    builds its own. A collection after each module bounds the suite's memory (CI has 24
    GiB)."""
    yield
    gc.collect()


@pytest.fixture
def pools() -> Iterator[PoolFactory]:
    """Real pool daemons on short private paths, stopped and removed after the test."""
    factory = PoolFactory()
    yield factory
    factory.close()
