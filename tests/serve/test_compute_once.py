"""The cluster computes a shared prefix once: concurrent requests for the same document wait
for the one computing it, in the same replica (its blocks) and across replicas (its pool
chunks), under round-robin and cache-aware routing.

`kvshare bench shared-prefix` with the pool ON, 2 documents x 2,048 tokens, 8 users,
concurrency 4, over two replicas of a tiny random model with 64-token chunks. The ideal:
each document's first request computes its whole prompt, every other request its question
plus at most one chunk. Without waiting, the requests in flight together for one document
each compute it (2.6x the ideal measured under round-robin).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.cli import main
from kvshare.serve.launcher import Cluster, UpConfig
from kvshare.serve.policies import PolicyConfig
from kvshare.serve.router import RouterConfig, build_router_app
from kvshare.serve.routing_keys import RoutingKeys
from tests.serve.inprocess import BackgroundServer

MODEL = "shape:tiny-llama"
CHUNK = 64
DOCUMENTS, USERS, CONCURRENCY, DOC_TOKENS, QUESTION_TOKENS = 2, 8, 4, 2048, 32
MAX_RATIO = 1.15


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Pool + 2 replicas behind a round-robin router."""
    config = UpConfig(
        replicas=2,
        model=MODEL,
        port=0,
        policy="round-robin",
        pool_size=64 << 20,
        chunk_tokens=CHUNK,
        engine_args=("--kv-cache-memory", "16MiB", "--dtype", "float32"),
        router_args=("--health-interval", "0.5"),
    )
    log_path = tmp_path_factory.mktemp("once") / "cluster.log"
    with log_path.open("w") as log, Cluster(config, log=log) as running:
        yield running
    sys.__stderr__.write("".join(log_path.read_text(errors="replace").splitlines(True)[-40:]))


@pytest.fixture(scope="module")
def cache_aware(cluster: Cluster) -> Iterator[str]:
    """A second router over the same replicas, with the cache-aware policy."""
    config = RouterConfig(
        tuple(cluster.replica_urls), "cache-aware", PolicyConfig(chunk_tokens=CHUNK)
    )
    server = BackgroundServer(build_router_app(config, RoutingKeys(None, config.block_tokens)))
    yield server.url
    server.close()


def computed_over_ideal(report: Path) -> tuple[int, int]:
    """(prompt tokens computed in the cluster, the ideal) from a bench --json report."""
    requests = json.loads(report.read_text())["requests"]
    assert len(requests) == USERS
    assert all(r["usage"]["prompt_tokens"] == DOC_TOKENS + QUESTION_TOKENS for r in requests)
    computed = sum(r["usage"]["kv"]["computed_tokens"] for r in requests)
    ideal = DOCUMENTS * (DOC_TOKENS + QUESTION_TOKENS) + (USERS - DOCUMENTS) * (
        QUESTION_TOKENS + CHUNK
    )
    return computed, ideal


@pytest.mark.parametrize("policy", ["round-robin", "cache-aware"])
def test_concurrent_requests_compute_each_shared_document_once(
    policy: str, cluster: Cluster, cache_aware: str, tmp_path: Path
) -> None:
    url = cluster.url if policy == "round-robin" else cache_aware
    report = tmp_path / "shared.json"
    argv = ["bench", "shared-prefix", "--target", url, "--model", MODEL, "--design", "ON"]
    argv += ["--documents", str(DOCUMENTS), "--users", str(USERS)]
    argv += ["--concurrency", str(CONCURRENCY), "--doc-tokens", str(DOC_TOKENS)]
    argv += ["--question-tokens", str(QUESTION_TOKENS), "--resamples", "10", "--json", str(report)]
    assert main(argv) == 0
    computed, ideal = computed_over_ideal(report)
    assert computed <= MAX_RATIO * ideal, (
        f"{policy}: computed {computed} = {computed / ideal:.2f}x the ideal {ideal}"
    )
