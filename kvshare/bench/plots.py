"""PNG plots: median TTFT (log axis) with its bootstrap interval, OFF and ON.

Workloads with points along x (context length, turn) get one curve per (series, condition);
those without (shared-prefix) get the TTFT distribution per condition as an empirical CDF.
A concurrency sweep gets four panels (p50 TTFT, p99 TTFT, throughput, computed/ideal)
against concurrency, one curve per (pool size, condition).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from kvshare.bench.design import CONDITIONS, OFF
from kvshare.bench.records import BenchRun
from kvshare.bench.summary import TTFT, Comparison, samples
from kvshare.bench.sweep import SweepRow
from kvshare.sizes import format_size

_PLAIN = FuncFormatter(lambda value, _: f"{value:g}")  # 1024, not 2^10
_STYLE = {OFF: {"linestyle": "--", "marker": "o"}, "ON": {"linestyle": "-", "marker": "s"}}


def plot_run(run: BenchRun, comparisons: Sequence[Comparison], path: Path) -> None:
    plot_figure(run, comparisons).savefig(path, dpi=120)


def plot_figure(run: BenchRun, comparisons: Sequence[Comparison]) -> Figure:
    # A bare Figure renders with the Agg canvas: no pyplot, no global figure registry, no display.
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    curves = [c for c in comparisons if c.metric == TTFT and c.x is not None]
    if curves:
        _curves(ax, curves, log_x=run.info.workload == "cross-replica")
        ax.set_xlabel(run.info.x_label)
    else:
        _ecdf(ax, run)
    ax.set_title(f"kvshare {run.info.workload} ({run.info.model}, {run.info.design.label})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _curves(ax: Axes, curves: Sequence[Comparison], log_x: bool) -> None:
    for series in dict.fromkeys(c.series for c in curves):
        for condition in CONDITIONS:
            points = [
                (c, c.off if condition == OFF else c.on) for c in curves if c.series == series
            ]
            points = [(c, e) for c, e in points if e is not None]
            if not points:
                continue
            xs = np.array([c.x for c, _ in points], dtype=float)
            ys = np.array([e.value for _, e in points])
            err = np.array(
                [[e.value - e.low for _, e in points], [e.high - e.value for _, e in points]]
            )
            ax.errorbar(
                xs,
                ys,
                yerr=err,
                capsize=3,
                label=f"{series}, pool {condition}",
                **_STYLE[condition],
            )
            # Values on the points: a log axis labels few ticks, and a point may fall between them.
            n = 0 if condition == OFF else 1
            for (c, e), x in zip(points, xs):
                ax.annotate(
                    f"{e.value:.3g} s (n={c.counts[n]})",
                    (x, e.value),
                    textcoords="offset points",
                    xytext=(6, 4 if condition == OFF else -12),
                    fontsize=8,
                )
        for c in curves:
            if c.series == series and c.ratio is not None and c.on is not None:
                r = c.ratio
                ax.annotate(
                    f"ON/OFF {r.value:.3g} [{r.low:.3g}, {r.high:.3g}]",
                    (float(c.x or 0), c.on.value),
                    textcoords="offset points",
                    xytext=(6, -24),
                    fontsize=8,
                )
    xs = sorted({c.x for c in curves if c.x is not None})
    if log_x:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(_PLAIN)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(xs) == 1:  # one point per curve: room for its labels on the right
        ax.set_xlim(xs[0] / 1.5 if log_x else xs[0] - 1, xs[0] * 2.5 if log_x else xs[0] + 2)
    _log_seconds(ax, "y")
    ax.set_ylabel("median TTFT, s (95% interval)")


def _ecdf(ax: Axes, run: BenchRun) -> None:
    values = samples(run.records())
    for condition in CONDITIONS:
        ttfts = np.sort([s.value for s in values if s.metric == TTFT and s.condition == condition])
        if len(ttfts):
            ax.step(
                ttfts,
                np.arange(1, len(ttfts) + 1) / len(ttfts),
                where="post",
                label=f"pool {condition}",
                linestyle=_STYLE[condition]["linestyle"],
            )
    _log_seconds(ax, "x")
    ax.set_xlabel("TTFT, s")
    ax.set_ylabel("fraction of requests")


def _one_two_five(value: float, _: object) -> str:
    """Labels for a log axis: 0.1, 0.2, 0.5, 1, 2, 5, ... and nothing at the other ticks."""
    mantissa = value / 10 ** math.floor(math.log10(value)) if value > 0 else 0.0
    return f"{value:g}" if round(mantissa, 6) in (1.0, 2.0, 5.0) else ""


def _log_seconds(ax: Axes, which: str) -> None:
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis = ax.xaxis if which == "x" else ax.yaxis
    axis.set_major_formatter(FuncFormatter(_one_two_five))
    axis.set_minor_formatter(FuncFormatter(_one_two_five))


# (SweepRow field, panel title, log y axis)
SWEEP_PANELS: tuple[tuple[str, str, bool], ...] = (
    ("p50_ttft_s", "p50 TTFT, s", True),
    ("p99_ttft_s", "p99 TTFT, s", True),
    ("requests_per_s", "throughput, requests/s", False),
    ("computed_over_ideal", "computed / ideal prompt tokens", False),
)


def plot_sweep(rows: Sequence[SweepRow], title: str, path: Path) -> None:
    sweep_figure(rows, title).savefig(path, dpi=120)


def sweep_figure(rows: Sequence[SweepRow], title: str) -> Figure:
    fig = Figure(figsize=(10, 7), layout="constrained")
    fig.suptitle(title)
    curves = list(dict.fromkeys((r.pool_size, r.condition) for r in rows))
    xs = sorted({r.concurrency for r in rows})
    for ax, (field, label, log_y) in zip(fig.subplots(2, 2).flat, SWEEP_PANELS):
        for pool_size, condition in curves:
            points = [
                (r.concurrency, getattr(r, field))
                for r in rows
                if (r.pool_size, r.condition) == (pool_size, condition)
            ]
            points = [(x, y) for x, y in sorted(points) if y is not None]
            if not points:
                continue
            pool = "target's pool" if pool_size is None else f"pool {format_size(pool_size)}"
            ax.plot(
                [x for x, _ in points],
                [y for _, y in points],
                label=f"{pool}, {condition}",
                **_STYLE[condition],
            )
            # Values on the points: a log axis spanning less than from 1 to 2 x 10^k (a
            # p99 of 14.6 s, say) shows no tick label at all.
            for x, y in points:
                ax.annotate(
                    f"{y:.3g}",
                    (x, y),
                    textcoords="offset points",
                    xytext=(6, 4 if condition == OFF else -12),
                    fontsize=8,
                )
        if len(xs) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.xaxis.set_major_formatter(_PLAIN)
        if log_y:
            _log_seconds(ax, "y")
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    fig.axes[0].legend(fontsize=8)
    return fig
