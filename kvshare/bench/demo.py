"""`kvshare demo`: start the default cluster, compare pool OFF and ON, print what it shows.

Small enough for 2 quiet CPU cores in about four minutes: a cross-replica comparison at
2,048 context tokens and 4-turn sessions that alternate replicas, each run as back-to-back
OFF/ON pairs of short blocks (Design.paired). The headline ratios are geometric means of the
pairs' ratios with a Student-t interval over pairs: a machine that gets busier or quieter
during the run moves both blocks of a pair alike, and what it moves between pairs widens the
interval instead of hiding outside it. The cross-replica context is shared per block
(prefilled once on replica A, in pool-on blocks), so the time goes into measured requests.
Each workload's results are written as soon as it ends: a demo stopped during the sessions
keeps the cross-replica figures.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from rich.console import Console

from kvshare.bench.cluster import cluster_target
from kvshare.bench.cross_replica import CrossReplica
from kvshare.bench.design import OFF, ON, Design
from kvshare.bench.driver import BenchOptions, Outputs, report, run_with_progress
from kvshare.bench.records import BenchRun
from kvshare.bench.report import estimate
from kvshare.bench.runner import Workload
from kvshare.bench.sessions import ALTERNATE, Sessions
from kvshare.bench.stats import BootstrapSpec, Estimate, geometric_mean_interval
from kvshare.bench.summary import SESSION, TTFT, Comparison, condition_medians, paired_ratios

DEMO_CROSS_REPLICA = CrossReplica(
    lengths=(2048,), requests_per_block=2, question_tokens=16, output_tokens=4, shared_context=True
)
DEMO_SESSIONS = Sessions(
    sessions=1,
    context_tokens=1024,
    turns=4,
    question_tokens=16,
    output_tokens=8,
    placements=(ALTERNATE,),
)
# OFF/ON block pairs per workload: 5 x ~22 s and 5 x ~14 s on a quiet 2-core machine, where
# an OFF request at 2,048 tokens takes ~7 s (a loaded machine multiplies every figure).
DEMO_RUNS: tuple[tuple[Workload, Design], ...] = (
    (DEMO_CROSS_REPLICA, Design.paired(5)),
    (DEMO_SESSIONS, Design.paired(5)),
)
METHOD = (
    "OFF and ON: geometric mean of the condition's block medians; ON/OFF: geometric mean "
    "over back-to-back OFF/ON block pairs of the ratio of their block medians; [95% "
    "Student-t interval with the blocks or pairs as replicates]; n: samples per condition"
)


def run_demo(out: Path, up_args: str, seed: int, console: Console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "cluster.log"
    started = time.monotonic()
    load_at_start = os.getloadavg()[0]
    console.print(
        f"[bold]starting the cluster[/bold] (kvshare up {up_args or 'with its defaults'}; "
        f"its output goes to {log})"
    )
    command = "kvshare demo" + (f" --up={up_args!r}" if up_args else "")
    lines = []
    with cluster_target(None, up_args, log) as target:
        console.print(f"cluster up at {target.url} after {time.monotonic() - started:.0f} s")
        for workload, design in DEMO_RUNS:
            options = BenchOptions(
                design, seed, BootstrapSpec(seed=seed), target.model, command=command
            )
            run = run_with_progress(workload, target.url, options, console)
            stem = out / run.info.workload
            outputs = Outputs(
                stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png")
            )
            lines.append(headline(run, report(run, options, outputs, console)))
    console.print(
        f"\n[bold]kvshare demo[/bold]: {time.monotonic() - started:.0f} s in all on "
        f"{socket.gethostname()}, {os.cpu_count()} CPU cores, load average "
        f"{load_at_start:.1f} at start and {os.getloadavg()[0]:.1f} at end"
    )
    for line in lines:
        console.print(line)
    console.print(f"[dim]{METHOD}[/dim]")


def headline(run: BenchRun, comparisons: list[Comparison]) -> str:
    """One line: OFF and ON with their n, and the paired ON/OFF ratio of the run's most telling point."""
    if run.info.workload == CrossReplica.name:
        ttft = [c for c in comparisons if c.metric == TTFT and c.x is not None]
        point = max(ttft, key=lambda c: c.x or 0)
        what = f"cross-replica TTFT at {point.x} context tokens"
    else:
        point = next(c for c in comparisons if c.metric == SESSION)
        params = run.info.params
        what = f"{point.series} session time ({params['turns']} turns, {params['context_tokens']}-token document)"
    design = run.info.design
    ratios = paired_ratios(point, design)
    n_off, n_on = point.counts
    if len(ratios) < 2:
        return (
            f"{what}: OFF {estimate(point.off)} s (n={n_off}), ON {estimate(point.on)} s "
            f"(n={n_on}); ON/OFF {estimate(point.ratio)} (too few block pairs for a paired interval)"
        )
    off, on = (geometric_mean_interval(condition_medians(point, design, c)) for c in (OFF, ON))
    ratio = geometric_mean_interval(ratios)
    saved = Estimate(1 - ratio.value, 1 - ratio.high, 1 - ratio.low)
    return (
        f"{what}: OFF {estimate(off)} s (n={n_off}), ON {estimate(on)} s (n={n_on}); "
        f"ON/OFF {estimate(ratio)} over {len(ratios)} block pairs, "
        f"{_percent(saved.value)} less [{_percent(saved.low)}, {_percent(saved.high)}]"
    )


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"
