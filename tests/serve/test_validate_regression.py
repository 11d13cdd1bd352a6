"""`kvshare validate regression` passes on a healthy cluster and fails on a broken restore.

The broken cluster's replicas run the pool connector with its load ordering removed, the
copy delayed and checksums ignored (hidden test-only flags; with checksums on, the
unfinished copy fails verification and is recomputed, which hides the race from the
answers): the engine then computes on blocks the restore has not written yet, so answers
differ from the pool-off answers, and the check must say so.
"""

from __future__ import annotations

from dataclasses import replace

from kvshare.serve.launcher import Cluster
from kvshare.validate.regression import Prompt, default_prompts, run_regression_check
from tests.serve.conftest import CLUSTER_CONFIG


def prompts() -> list[Prompt]:
    everything = {p.name: p for p in default_prompts(seed=5)}
    return [everything["completion-900w"], everything["chat-0"]]


def test_regression_check_passes_on_a_healthy_cluster(cluster: Cluster) -> None:
    result = run_regression_check(cluster.url, prompts=prompts(), max_tokens=12)
    assert result.passed, result.failures
    assert result.counts["answers_equal"] == result.counts["answers_compared"] == 4
    assert result.counts["pool_hit_tokens"] > 0


def test_regression_check_fails_when_restores_are_not_waited_for() -> None:
    broken = replace(CLUSTER_CONFIG, engine_args=(
        *CLUSTER_CONFIG.engine_args, "--unsafe-break-stream-order", "load", "--unsafe-load-delay", "0.5",
        "--unsafe-skip-checksums"))
    with Cluster(broken) as running:
        result = run_regression_check(running.url, prompts=prompts(), max_tokens=12)
    assert not result.passed
    assert any("first differing token" in failure for failure in result.failures), result.failures
