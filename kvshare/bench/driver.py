"""One bench run end to end: connect, learn the replicas and the model, run the design, report."""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import socket
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console

from kvshare.bench.client import BenchClient, BenchError, served_models
from kvshare.bench.design import Design
from kvshare.bench.plots import plot_run, plot_sweep
from kvshare.bench.progress import RichObserver, new_progress
from kvshare.bench.records import BenchRun, RunInfo
from kvshare.bench.report import markdown, tables, unsettled_warning, write_json
from kvshare.bench.runner import Observer, Workload, run_design, warm_up
from kvshare.bench.stats import BootstrapSpec
from kvshare.bench.summary import Comparison, compare
from kvshare.bench.sweep import Sweep, sweep_markdown, sweep_table, write_sweep_json
from kvshare.bench.synthetic import PromptModel, load_prompt_model
from kvshare.serve.auth import AccessKeys
from kvshare.tables import print_table

_log = logging.getLogger(__name__)

# What a run can fail with that is the setup's fault, not a bug: bad parameters, a server that
# errs or is unreachable (aiohttp's connection errors are OSErrors), a request that times out.
BENCH_ERRORS = (ValueError, BenchError, OSError, aiohttp.ClientError, asyncio.TimeoutError)


@dataclass(frozen=True)
class BenchOptions:
    design: Design
    seed: int = 0
    bootstrap: BootstrapSpec = field(default_factory=BootstrapSpec)
    model: str | None = None  # model spec for the tokenizer; None: the id the server lists
    request_timeout_s: float = 3600.0  # one request, stream included
    command: str = ""
    settle_timeout_s: float = 10.0  # longest wait for the pool's stores to commit (runner.settle)
    warmup_tokens: int = 0  # warm-up requests of this many tokens first (runner.warm_up); 0: none

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0 or self.settle_timeout_s < 0:
            raise ValueError("request_timeout_s must be > 0 and settle_timeout_s >= 0")
        if self.warmup_tokens < 0:
            raise ValueError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")


@dataclass(frozen=True)
class Outputs:
    json: Path | None = None
    markdown: Path | None = None
    plot: Path | None = None


def client_machine() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }


async def run_bench(
    workload: Workload,
    url: str,
    options: BenchOptions,
    observer: Observer,
    model: PromptModel | None = None,
) -> BenchRun:
    """Run `workload` against the router at `url`; `model` defaults to options.model's tokenizer."""
    url = url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=options.request_timeout_s)
    # No connection cap: a workload bounds its own concurrency.
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as session:
        keys = AccessKeys.from_environment()
        served = await served_models(session, url, keys)
        if not served:
            raise ValueError(f"{url} serves no model")
        model = model or load_prompt_model(options.model or served[0])
        client = BenchClient(
            session, url, served[0], text_content=model.tokenizer is not None, keys=keys
        )
        replicas = tuple(await client.replicas())
        if not replicas:
            raise ValueError(f"{url} lists no replicas")
        started_at = datetime.now().astimezone().isoformat(timespec="seconds")
        switches = await client.pool_switches()
        try:
            warmup = ()
            if options.warmup_tokens:
                warmup = await warm_up(
                    client,
                    model,
                    len(replicas),
                    options.warmup_tokens,
                    options.seed,
                    restore=any(block.pool_enabled for block in options.design.blocks),
                    settle_timeout_s=options.settle_timeout_s,
                )
            blocks = await run_design(
                workload,
                client,
                options.design,
                seed=options.seed,
                model=model,
                replicas=replicas,
                observer=observer,
                settle_timeout_s=options.settle_timeout_s,
            )
        except BaseException:
            await _put_pool_back(client, switches, replicas, failed=True)
            raise
        await _put_pool_back(client, switches, replicas, failed=False)
    info = RunInfo(
        workload.name,
        workload.x_label,
        workload.params(),
        options.design,
        options.seed,
        options.settle_timeout_s,
        url,
        model.spec,
        replicas,
        options.command,
        started_at,
        client_machine(),
    )
    return BenchRun(info, blocks, warmup)


async def _put_pool_back(
    client: BenchClient, switches: list[bool | None], replicas: tuple[str, ...], failed: bool
) -> None:
    """Set the pool switches back to what the run found (its blocks switch the pool off and
    on; OFF-ON-ON-OFF ends with it off). If that fails, the run fails (BenchError), or, when
    it failed already, a warning says so beside the run's own error."""
    try:
        await client.set_pool_switches(switches, replicas)
    except BENCH_ERRORS as exc:
        found = ", ".join(
            f"replica {i}: {'unknown' if on is None else 'on' if on else 'off'}"
            for i, on in enumerate(switches)
        )
        message = (
            f"the bench could not set the pool switches back to what it found ({found}): "
            f"{exc}; set them with POST /admin/all/kv_pool"
        )
        if not failed:
            raise BenchError(message) from exc
        _log.warning("%s", message)


def run_with_progress(
    workload: Workload,
    url: str,
    options: BenchOptions,
    console: Console,
    model: PromptModel | None = None,
) -> BenchRun:
    with new_progress(console) as progress:
        return asyncio.run(
            run_bench(workload, url, options, RichObserver(progress, workload.name), model)
        )


def report(
    run: BenchRun, options: BenchOptions, outputs: Outputs, console: Console
) -> list[Comparison]:
    """Print the tables and write the files asked for; returns the comparisons."""
    comparisons = compare(run.blocks, run.info.design, options.bootstrap)
    for table in tables(run, comparisons, options.bootstrap):
        print_table(console, table)
    if warning := unsettled_warning(run):
        console.print(f"[yellow]{warning}[/yellow]")
    if outputs.json:
        write_json(outputs.json, run, comparisons, options.bootstrap)
        console.print(f"json: {outputs.json}")
    if outputs.plot:
        plot_run(run, comparisons, outputs.plot)
        console.print(f"plot: {outputs.plot}")
    if outputs.markdown:
        # The image link is relative to the Markdown file, so the two can move together.
        link = os.path.relpath(outputs.plot, outputs.markdown.parent) if outputs.plot else None
        outputs.markdown.write_text(markdown(run, comparisons, options.bootstrap, link))
        console.print(f"markdown: {outputs.markdown}")
    return comparisons


def report_sweep(
    sweep: Sweep, spec: BootstrapSpec, command: str, outputs: Outputs, console: Console
) -> None:
    """Print the sweep's table and write the files asked for."""
    rows = sweep.rows()
    print_table(console, sweep_table(rows))
    for run in sweep.runs:
        if warning := unsettled_warning(run):
            console.print(f"[yellow]{warning}[/yellow]")
    if outputs.json:
        write_sweep_json(outputs.json, sweep, spec)
        console.print(f"json: {outputs.json}")
    if outputs.plot:
        model = sweep.runs[0].info.model if sweep.runs else "-"
        plot_sweep(rows, f"kvshare concurrency sweep ({model})", outputs.plot)
        console.print(f"plot: {outputs.plot}")
    if outputs.markdown:
        link = os.path.relpath(outputs.plot, outputs.markdown.parent) if outputs.plot else None
        outputs.markdown.write_text(sweep_markdown(sweep, command, link))
        console.print(f"markdown: {outputs.markdown}")
