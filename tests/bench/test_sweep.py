"""`kvshare bench concurrency` without a cluster: one cluster per pool size, a warm-up at
each cluster's first point only, rows per condition, the table and the plot's panels."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvshare.bench.design import Design
from kvshare.bench.driver import BenchOptions, run_bench
from kvshare.bench.plots import SWEEP_PANELS, sweep_figure
from kvshare.bench.records import BenchRun
from kvshare.bench.shared_prefix import SharedPrefix
from kvshare.bench.stats import BootstrapSpec
from kvshare.bench.sweep import Sweep, SweepPoint, run_sweep, sweep_points, sweep_table
from kvshare.bench.synthetic import load_prompt_model
from kvshare.cli import main
from tests.bench.fake_server import RunningFake
from tests.bench.test_workloads import RecordingObserver

MIB = 1 << 20


def test_each_pool_size_gets_one_cluster_and_one_warm_up(fake: RunningFake) -> None:
    model = load_prompt_model("shape:tiny-llama")  # token ids: no tokenizer to load
    fake.cluster.commit_delay_s = 0.0
    opened: list[int | None] = []
    calls: list[tuple[int, str, bool]] = []

    @contextmanager
    def open_cluster(pool_size: int | None) -> Iterator[str]:
        opened.append(pool_size)
        yield fake.url

    def run_point(workload: SharedPrefix, url: str, warm_up: bool) -> BenchRun:
        calls.append((workload.concurrency, url, warm_up))
        options = BenchOptions(
            Design.parse("OFF-ON"), bootstrap=BootstrapSpec(50), warmup_tokens=8 if warm_up else 0
        )
        return asyncio.run(run_bench(workload, url, options, RecordingObserver(), model))

    base = SharedPrefix(documents=2, users=4, concurrency=1, doc_tokens=40, question_tokens=4)
    partials: list[Sweep] = []
    sweep = run_sweep(
        base, (1, 3), (8 * MIB, 32 * MIB), open_cluster, run_point, on_point=partials.append
    )

    # After each point the sweep so far: its points and runs, the final sweep's prefix.
    assert [len(p.runs) for p in partials] == [1, 2, 3, 4]
    for partial in partials:
        n = len(partial.runs)
        assert partial.points == sweep.points[:n] and partial.runs == sweep.runs[:n]
        assert partial.params == sweep.params
    assert opened == [8 * MIB, 32 * MIB]
    assert calls == [(1, fake.url, True), (3, fake.url, False)] * 2
    assert [len(run.warmup) for run in sweep.runs] == [4, 0, 4, 0]  # 2 prefills, 2 restores
    assert sweep.points == (
        SweepPoint(1, 8 * MIB),
        SweepPoint(3, 8 * MIB),
        SweepPoint(1, 32 * MIB),
        SweepPoint(3, 32 * MIB),
    )
    assert sweep.params == {
        **{k: v for k, v in base.params().items() if k != "concurrency"},
        "concurrency": [1, 3],
        "pool_sizes": [8 * MIB, 32 * MIB],
    }
    rows = sweep.rows()
    assert [(r.pool_size, r.concurrency, r.condition) for r in rows] == [
        (size, c, condition)
        for size in (8 * MIB, 32 * MIB)
        for c in (1, 3)
        for condition in ("OFF", "ON")
    ]
    for r in rows:
        assert r.requests == 4 and r.p50_ttft_s is not None and r.p99_ttft_s is not None
        assert r.p50_ttft_s <= r.p99_ttft_s and r.requests_per_s > 0
        assert r.computed_over_ideal is not None and r.computed_over_ideal > 0
        assert r.pool_hit_rate == 0.0 or r.condition == "ON"
    table = sweep_table(rows)
    assert len(table.rows) == 8 and table.rows[0][:3] == ("8 MiB", "OFF", "1")

    # The plot: one panel per metric, one curve per (pool size, condition), the rows' values.
    fig = sweep_figure(rows, "t")
    for ax, (field, _, _) in zip(fig.axes, SWEEP_PANELS):
        curves = {line.get_label(): line for line in ax.get_lines()}
        assert set(curves) == {f"pool {s}, {c}" for s in ("8 MiB", "32 MiB") for c in ("OFF", "ON")}
        line = curves["pool 32 MiB, ON"]
        expected = [
            getattr(r, field) for r in rows if r.pool_size == 32 * MIB and r.condition == "ON"
        ]
        assert list(line.get_xdata()) == [1, 3] and list(line.get_ydata()) == expected
        # Each point's value is written beside it (a narrow log axis has no tick labels).
        assert {f"{v:.3g}" for v in expected} <= {t.get_text() for t in ax.texts}


def test_points_must_be_distinct_and_pool_sizes_need_a_cluster_the_bench_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(ValueError, match="must not repeat"):
        sweep_points((1, 1), (None,))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        sweep_points((0,), (None,))
    argv = ["bench", "concurrency", "--target", "http://127.0.0.1:9", "--pool-sizes", "1MiB"]
    assert main(argv) == 2
    assert "--pool-sizes needs --up" in capsys.readouterr().out
