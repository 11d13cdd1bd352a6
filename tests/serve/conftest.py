"""One `kvshare up` cluster for the whole serve suite: pool + 2 SmolLM2 replicas on the CPU
+ the cache-aware router. Tests that break it (kill a replica, stop the pool) restore it.
Each prompt that measures reuse is unique, so tests do not depend on each other's caches."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.serve.launcher import Cluster, UpConfig

MODEL = "smollm2-135m"
# Two replicas share two cores: small caches, a small pool (22 pages of 11.5 MiB).
CLUSTER_CONFIG = UpConfig(
    replicas=2,
    model=MODEL,
    port=0,
    pool_size=256 << 20,
    engine_args=("--kv-cache-memory", "256MiB", "--max-num-batched-tokens", "1024"),
    router_args=("--health-interval", "0.5"),
    ready_timeout=300.0,
)


@pytest.fixture(scope="session")
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    log_path: Path = tmp_path_factory.mktemp("cluster") / "cluster.log"
    with log_path.open("w") as log, Cluster(CLUSTER_CONFIG, log=log) as running:
        yield running
    if request.session.testsfailed:  # the children's side of the story
        lines = log_path.read_text(errors="replace").splitlines()
        sys.__stderr__.write(
            f"\n--- last lines of {log_path} ---\n" + "\n".join(lines[-150:]) + "\n"
        )


def unique_text(words: int) -> str:
    """A prompt no other test sends: a fresh token prefix, so no cache holds it yet."""
    tag = uuid.uuid4().hex[:8]
    filler = (
        "the river crossed the valley near an old stone bridge where "
        "merchants gathered every morning to trade grain salt and copper "
    ).split()
    return f"Note {tag}: " + " ".join(filler[i % len(filler)] for i in range(words))
