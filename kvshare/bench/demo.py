"""`kvshare demo`: start the default cluster, compare pool OFF and ON, print what it shows.

Small enough for 2 CPU cores in a few minutes: a cross-replica comparison at three context
lengths (OFF-ON-ON-OFF) and alternate-placement sessions (OFF-ON-ON-OFF), then the headline:
the ON/OFF TTFT ratio at the longest context, with its bootstrap interval.
"""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console

from kvshare.bench.cluster import cluster_target
from kvshare.bench.cross_replica import CrossReplica
from kvshare.bench.design import DEFAULT_DESIGN, Design
from kvshare.bench.driver import BenchOptions, Outputs, report, run_with_progress
from kvshare.bench.records import BenchRun
from kvshare.bench.report import estimate
from kvshare.bench.sessions import ALTERNATE, Sessions
from kvshare.bench.stats import BootstrapSpec
from kvshare.bench.summary import SESSION, TTFT, Comparison

DEMO_CROSS_REPLICA = CrossReplica(lengths=(512, 1024, 2048), requests_per_block=2,
                                  question_tokens=16, output_tokens=4)
DEMO_SESSIONS = Sessions(sessions=2, context_tokens=1024, turns=4, question_tokens=16,
                         output_tokens=8, placements=(ALTERNATE,))


def run_demo(out: Path, up_args: str, seed: int, console: Console) -> None:
    out.mkdir(parents=True, exist_ok=True)
    log = out / "cluster.log"
    started = time.monotonic()
    console.print(f"[bold]starting the cluster[/bold] (kvshare up {up_args or 'with its defaults'}; "
                  f"its output goes to {log})")
    command = "kvshare demo" + (f" --up={up_args!r}" if up_args else "")
    with cluster_target(None, up_args, log) as target:
        console.print(f"cluster up at {target.url} after {time.monotonic() - started:.0f} s")
        options = BenchOptions(Design.parse(DEFAULT_DESIGN), seed, BootstrapSpec(seed=seed),
                               target.model, command=command)
        runs = [run_with_progress(workload, target.url, options, console)
                for workload in (DEMO_CROSS_REPLICA, DEMO_SESSIONS)]
    lines = []
    for run in runs:
        stem = out / run.info.workload
        outputs = Outputs(stem.with_suffix(".json"), stem.with_suffix(".md"), stem.with_suffix(".png"))
        lines.append(headline(run, report(run, options, outputs, console)))
    console.print(f"\n[bold]kvshare demo[/bold] ({time.monotonic() - started:.0f} s in all)")
    for line in lines:
        console.print(line)


def headline(run: BenchRun, comparisons: list[Comparison]) -> str:
    """One line: the ON/OFF ratio of the run's most telling point, with its interval."""
    if run.info.workload == CrossReplica.name:
        ttft = [c for c in comparisons if c.metric == TTFT and c.x is not None]
        point = max(ttft, key=lambda c: c.x or 0)
        what = f"cross-replica TTFT at {point.x} context tokens"
    else:
        point = next(c for c in comparisons if c.metric == SESSION)
        what = f"{point.series} session time ({run.info.params['turns']} turns)"
    saved = f" ({100 * (1 - point.ratio.value):.0f}% less)" if point.ratio else ""
    return (f"{what}: OFF {estimate(point.off)} s, ON {estimate(point.on)} s, "
            f"ON/OFF {estimate(point.ratio)}{saved} (median [95% interval])")
