"""Results out: JSON with every request, a Markdown summary, and the same tables in rich."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare.bench.design import CONDITIONS
from kvshare.bench.records import BenchRun, RequestRecord
from kvshare.bench.stats import Agreement, BootstrapSpec, Estimate
from kvshare.bench.summary import SESSION, BlockRow, Comparison, block_row
from kvshare.serve.server_timing import median_phases
from kvshare.sizes import format_size
from kvshare.spec import DEFAULT_CHUNK_TOKENS
from kvshare.tables import Table

FORMAT_VERSION = 1


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def estimate(value: Estimate | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value.value:.{digits}f} [{value.low:.{digits}f}, {value.high:.{digits}f}]"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def agreement(value: Agreement | None) -> str:
    return "-" if value is None else f"{value.distance:.2f} (p {value.p_value:.2f})"


def size(value: int | None) -> str:
    return "-" if value is None else format_size(value)


def comparison_table(
    run: BenchRun, comparisons: Sequence[Comparison], spec: BootstrapSpec
) -> Table:
    level = f"{100 * spec.level:g}%"
    headers = (
        "metric",
        "series",
        run.info.x_label,
        f"OFF median [{level}]",
        f"ON median [{level}]",
        f"ON/OFF [{level}]",
        "block medians",
        "blocks apart OFF/ON: KS (p)",
        "n OFF/ON",
        "pool hit OFF/ON",
    )
    rows = tuple(
        (
            c.metric,
            c.series,
            "-" if c.x is None else str(c.x),
            estimate(c.off),
            estimate(c.on),
            estimate(c.ratio),
            " ".join(seconds(m) for m in c.block_medians),
            f"{agreement(c.agreement[0])}/{agreement(c.agreement[1])}",
            f"{c.counts[0]}/{c.counts[1]}",
            f"{percent(c.hit_rates[0])}/{percent(c.hit_rates[1])}",
        )
        for c in comparisons
    )
    return Table(
        f"{run.info.workload}: ON vs OFF (seconds; design {run.info.design.label})", headers, rows
    )


def blocks_table(rows: Sequence[BlockRow]) -> Table:
    headers = (
        "block",
        "pool",
        "requests",
        "median TTFT",
        "span s",
        "req/s",
        "tok/s",
        "out tok/s",
        "pool hit",
        "loaded",
        "stored",
        "settle s",
        "computed/ideal",
        "no content",
    )
    cells = tuple(
        (
            str(r.index),
            r.condition,
            str(r.requests),
            seconds(r.median_ttft_s),
            f"{r.span_s:.2f}",
            f"{r.requests_per_s:.2f}",
            f"{r.tokens_per_s:.0f}",
            f"{r.output_tokens_per_s:.1f}",
            percent(r.pool_hit_rate),
            size(r.loaded_bytes),
            size(r.stored_bytes),
            f"{r.settle_s:.2f}",
            ratio(r.computed_over_ideal),
            str(r.no_content),
        )
        for r in rows
    )
    return Table("blocks (in run order)", headers, cells)


def warmup_table(records: Sequence[RequestRecord]) -> Table:
    cells = tuple(
        (r.tag.label, str(r.replica), seconds(r.result.ttft_s), seconds(r.result.total_s))
        for r in records
    )
    headers = ("request", "replica", "TTFT", "total")
    return Table("warm-up before block 0 (not in the results)", headers, cells)


def timing_table(records: Sequence[RequestRecord]) -> Table | None:
    """Per condition, the medians (ms) of the measured requests' client TTFT and of each
    phase their responses' Server-Timing named; None when no response carried one."""
    timed = [r for r in records if r.measured and r.result.server_timing]
    if not timed:
        return None
    phases = list(dict.fromkeys(name for r in timed for name in r.result.server_timing))
    cells = []
    for condition in CONDITIONS:
        group = [r for r in timed if r.condition == condition]
        if not group:
            continue
        ttfts = [1e3 * r.result.ttft_s for r in group if r.result.ttft_s is not None]
        medians = median_phases(r.result.server_timing for r in group)
        cells.append(
            (
                condition,
                str(len(group)),
                f"{statistics.median(ttfts):.1f}" if ttfts else "-",
                *(f"{medians[p]:.1f}" if p in medians else "-" for p in phases),
            )
        )
    return Table(
        "where the time to first token went (median ms; Server-Timing phases, each from the "
        "end of the one before it on its host)",
        ("pool", "requests", "client TTFT", *phases),
        tuple(cells),
    )


def tables(run: BenchRun, comparisons: Sequence[Comparison], spec: BootstrapSpec) -> list[Table]:
    warmup = [warmup_table(run.warmup)] if run.warmup else []
    blocks = blocks_table([block_row(b) for b in run.blocks])
    timing = timing_table(run.records())
    return [
        *warmup,
        comparison_table(run, comparisons, spec),
        blocks,
        *([timing] if timing else []),
    ]


def unsettled_warning(run: BenchRun) -> str | None:
    if not (n := run.unsettled()):
        return None
    return (
        f"warning: {n} requests were sent after waiting the whole settle timeout "
        f"({run.info.settle_timeout_s:g} s) with pool stores still in flight: a replica is not "
        "committing what it stores, so pool hits are missing"
    )


def _record_json(record: RequestRecord) -> dict[str, Any]:
    return {
        "block": record.block,
        "condition": record.condition,
        **dataclasses.asdict(record.tag),
        "replica": record.replica,
        "start_s": record.start_s,
        "settle_s": record.settle_s,
        **dataclasses.asdict(record.result),
    }


def to_json(
    run: BenchRun, comparisons: Sequence[Comparison], spec: BootstrapSpec
) -> dict[str, Any]:
    info = dataclasses.asdict(run.info)
    info["design"] = run.info.design.label
    return {
        "format_version": FORMAT_VERSION,
        "info": info,
        "bootstrap": dataclasses.asdict(spec),
        "comparisons": [dataclasses.asdict(c) for c in comparisons],
        "blocks": [
            {
                "index": b.block.index,
                "condition": b.block.condition,
                "wall_s": b.wall_s,
                "summary": dataclasses.asdict(block_row(b)),
                "stats_before": list(b.stats_before),
                "stats_after": list(b.stats_after),
            }
            for b in run.blocks
        ],
        "requests": [_record_json(r) for r in run.records()],
        "warmup": [_record_json(r) for r in run.warmup],
    }


def write_json(
    path: Path, run: BenchRun, comparisons: Sequence[Comparison], spec: BootstrapSpec
) -> None:
    path.write_text(json.dumps(to_json(run, comparisons, spec), indent=1) + "\n")


def markdown(
    run: BenchRun, comparisons: Sequence[Comparison], spec: BootstrapSpec, plot_link: str | None
) -> str:
    info = run.info
    params = ", ".join(f"{k}={v}" for k, v in info.params.items())
    machine = ", ".join(f"{k} {v}" for k, v in info.machine.items())
    lines = [
        f"# kvshare bench: {info.workload}",
        "",
        f"- command: `{info.command}`",
        f"- date: {info.started_at}",
        f"- client machine: {machine}",
        f"- target: {info.target} ({len(info.replicas)} replicas: {', '.join(info.replicas)})",
        f"- model: {info.model}",
        f"- parameters: {params}",
        f"- design: {info.design.label}, seed {info.seed}; pooled medians per condition with "
        f"{100 * spec.level:g}% percentile-bootstrap intervals ({spec.resamples} resamples, "
        "stratified by block); ON/OFF is the ratio of pooled medians",
        "- TTFT: client-side, from sending the request to the first streamed chunk with content",
        "- computed/ideal: prompt tokens the replicas computed (usage.kv.computed_tokens) over "
        "the fewest possible: each document's or session's first prompt whole, then only new "
        f"tokens plus at most one partial {DEFAULT_CHUNK_TOKENS}-token pool chunk per request",
        "- settle: before a follow-up (and at block starts) the bench waits until the pool has no "
        f"store in flight, at most {info.settle_timeout_s:g} s",
    ]
    if any(c.metric == SESSION for c in comparisons):
        lines.append(
            "- session_s: a session's time waiting for answers (sum of its requests' total times)"
        )
    if warning := unsettled_warning(run):
        lines.append(f"- **{warning}**")
    for table in tables(run, comparisons, spec):
        lines += ["", table.markdown()]
    if plot_link is not None:
        lines += ["", f"![{info.workload}]({plot_link})"]
    return "\n".join(lines) + "\n"
