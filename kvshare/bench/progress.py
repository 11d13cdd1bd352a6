"""Live progress of a bench run in the terminal: one bar per block."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from kvshare.bench.design import Block
from kvshare.bench.records import BlockResult, RequestRecord
from kvshare.bench.report import seconds
from kvshare.bench.summary import block_row


def new_progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[note]}"),
        console=console,
    )


class RichObserver:
    """Implements runner.Observer on a rich Progress (which the caller starts and stops)."""

    def __init__(self, progress: Progress, name: str) -> None:
        self._progress = progress
        self._name = name
        self._task: TaskID | None = None

    def block_started(self, block: Block, planned_requests: int) -> None:
        self._task = self._progress.add_task(
            f"{self._name} block {block.index} pool {block.condition:>3}",
            total=planned_requests,
            note="",
        )

    def request_done(self, record: RequestRecord) -> None:
        assert self._task is not None  # the runner starts a block before its requests
        note = f"last TTFT {seconds(record.result.ttft_s)} s" if record.measured else ""
        self._progress.update(self._task, advance=1, note=note)

    def block_done(self, result: BlockResult) -> None:
        assert self._task is not None
        row = block_row(result)
        self._progress.update(self._task, note=f"median TTFT {seconds(row.median_ttft_s)} s")
