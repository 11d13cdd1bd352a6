"""`kvshare bench concurrency`: the shared-prefix workload swept over concurrency and pool size.

Each point of the sweep (a concurrency on a cluster with one pool size) is a whole blocked
OFF/ON run of `SharedPrefix`, with its block setup (pool cleared, caches reset) between
blocks. A pool size is a cluster's: with `--up` the bench starts one cluster per pool size
(`kvshare up ARGS --pool-size SIZE`, the last --pool-size wins) and runs every concurrency on
it, warming each cluster's replicas up once; against `--target` only the running cluster's
pool is measured. Per point and condition: p50 and p99 TTFT, throughput, computed/ideal and
the pool hit rate, in a table, JSON (with every run's requests) and a PNG.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvshare.bench.design import CONDITIONS
from kvshare.bench.records import BenchRun
from kvshare.bench.report import FORMAT_VERSION, percent, ratio, seconds, to_json
from kvshare.bench.shared_prefix import SharedPrefix
from kvshare.bench.stats import BootstrapSpec
from kvshare.bench.summary import block_row, compare, pool_hit_rate
from kvshare.sizes import format_size
from kvshare.tables import Table


@dataclass(frozen=True)
class SweepPoint:
    concurrency: int
    pool_size: int | None  # bytes of the cluster's pool; None: the target's, unknown

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.pool_size is not None and self.pool_size < 1:
            raise ValueError(f"pool size must be >= 1 byte, got {self.pool_size}")

    @property
    def pool_label(self) -> str:
        return "target's" if self.pool_size is None else format_size(self.pool_size)


def sweep_points(concurrency: Sequence[int], pool_sizes: Sequence[int | None]) -> list[SweepPoint]:
    """Pool size outer, concurrency inner: one cluster per pool size runs every concurrency."""
    if not concurrency or not pool_sizes:
        raise ValueError("a sweep needs at least one concurrency and one pool size")
    if len(set(concurrency)) != len(concurrency) or len(set(pool_sizes)) != len(pool_sizes):
        raise ValueError("concurrency values and pool sizes must not repeat")
    return [SweepPoint(c, size) for size in pool_sizes for c in concurrency]


@dataclass(frozen=True)
class SweepRow:
    """One condition (OFF or ON) of one point: its blocks taken together."""

    concurrency: int
    pool_size: int | None
    condition: str
    requests: int  # measured requests with a TTFT
    p50_ttft_s: float | None
    p99_ttft_s: float | None
    requests_per_s: float  # requests over the blocks' summed spans
    output_tokens_per_s: float
    computed_over_ideal: float | None  # summed over the blocks
    pool_hit_rate: float | None


def sweep_rows(point: SweepPoint, run: BenchRun) -> list[SweepRow]:
    """One row per condition the run's design has, in OFF, ON order."""
    rows = []
    for condition in CONDITIONS:
        blocks = [b for b in run.blocks if b.block.condition == condition]
        if not blocks:
            continue
        summaries = [block_row(b) for b in blocks]
        measured = [r for b in blocks for r in b.records if r.measured]
        ttfts = [r.result.ttft_s for r in measured if r.result.ttft_s is not None]
        span = sum(s.span_s for s in summaries)
        output = sum(s.output_tokens_per_s * s.span_s for s in summaries)
        ideal = sum(s.ideal_tokens for s in summaries)
        rows.append(
            SweepRow(
                concurrency=point.concurrency,
                pool_size=point.pool_size,
                condition=condition,
                requests=len(ttfts),
                p50_ttft_s=float(np.percentile(ttfts, 50)) if ttfts else None,
                p99_ttft_s=float(np.percentile(ttfts, 99)) if ttfts else None,
                requests_per_s=sum(s.requests for s in summaries) / span if span else 0.0,
                output_tokens_per_s=output / span if span else 0.0,
                computed_over_ideal=(
                    sum(s.computed_tokens for s in summaries) / ideal if ideal else None
                ),
                pool_hit_rate=pool_hit_rate(measured),
            )
        )
    return rows


@dataclass(frozen=True)
class Sweep:
    params: dict[str, Any]  # the workload's, less its concurrency, and the sweep's lists
    points: tuple[SweepPoint, ...]
    runs: tuple[BenchRun, ...]  # one per point, in the same order

    def __post_init__(self) -> None:
        if len(self.points) != len(self.runs):
            raise ValueError("a sweep needs one run per point")

    def rows(self) -> list[SweepRow]:
        return [row for point, run in zip(self.points, self.runs) for row in sweep_rows(point, run)]


def run_sweep(
    workload: SharedPrefix,
    concurrency: Sequence[int],
    pool_sizes: Sequence[int | None],
    open_cluster: Callable[[int | None], AbstractContextManager[str]],
    run_point: Callable[[SharedPrefix, str, bool], BenchRun],
    on_point: Callable[[Sweep], None] | None = None,
) -> Sweep:
    """`open_cluster(pool size)` yields a router URL; `run_point(workload, url, warm_up)` runs
    one point there, warming the replicas up only at a cluster's first point. `on_point`
    gets the sweep so far after each point (so a sweep stopped midway can keep its points)."""
    points = sweep_points(concurrency, pool_sizes)
    params = {k: v for k, v in workload.params().items() if k != "concurrency"}
    params |= {"concurrency": list(concurrency), "pool_sizes": list(pool_sizes)}
    runs: list[BenchRun] = []
    for pool_size in pool_sizes:
        with open_cluster(pool_size) as url:
            for i, c in enumerate(concurrency):
                runs.append(run_point(dataclasses.replace(workload, concurrency=c), url, i == 0))
                if on_point is not None:
                    on_point(Sweep(params, tuple(points[: len(runs)]), tuple(runs)))
    return Sweep(params, tuple(points), tuple(runs))


def sweep_table(rows: Sequence[SweepRow]) -> Table:
    headers = (
        "pool size",
        "pool",
        "concurrency",
        "requests",
        "p50 TTFT s",
        "p99 TTFT s",
        "req/s",
        "out tok/s",
        "computed/ideal",
        "pool hit",
    )
    cells = tuple(
        (
            "target's" if r.pool_size is None else format_size(r.pool_size),
            r.condition,
            str(r.concurrency),
            str(r.requests),
            seconds(r.p50_ttft_s),
            seconds(r.p99_ttft_s),
            f"{r.requests_per_s:.2f}",
            f"{r.output_tokens_per_s:.1f}",
            ratio(r.computed_over_ideal),
            percent(r.pool_hit_rate),
        )
        for r in rows
    )
    return Table("concurrency sweep (shared-prefix, each point a blocked run)", headers, cells)


def sweep_json(sweep: Sweep, spec: BootstrapSpec) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "workload": "concurrency",
        "params": sweep.params,
        "rows": [dataclasses.asdict(r) for r in sweep.rows()],
        "runs": [
            {
                **dataclasses.asdict(point),
                "run": to_json(run, compare(run.blocks, run.info.design, spec), spec),
            }
            for point, run in zip(sweep.points, sweep.runs)
        ],
    }


def write_sweep_json(path: Path, sweep: Sweep, spec: BootstrapSpec) -> None:
    path.write_text(json.dumps(sweep_json(sweep, spec), indent=1) + "\n")


def sweep_markdown(sweep: Sweep, command: str, plot_link: str | None) -> str:
    first = sweep.runs[0].info if sweep.runs else None
    params = ", ".join(f"{k}={v}" for k, v in sweep.params.items())
    lines = [
        "# kvshare bench: concurrency sweep",
        "",
        f"- command: `{command}`",
        *([f"- date: {first.started_at}", f"- model: {first.model}"] if first else []),
        *([f"- design per point: {first.design.label}, seed {first.seed}"] if first else []),
        f"- parameters: {params}",
        "- each point is a whole blocked run of shared-prefix at that concurrency; a row pools "
        "the blocks of one condition: TTFT percentiles of its measured requests, throughput "
        "over the blocks' summed spans, computed/ideal over their summed tokens",
        "",
        sweep_table(sweep.rows()).markdown(),
    ]
    if plot_link is not None:
        lines += ["", f"![concurrency sweep]({plot_link})"]
    return "\n".join(lines) + "\n"
