"""Tables as strings, shown the same way everywhere: a rich table in a terminal (cells
wrap rather than being cut), Markdown with every cell whole when piped or redirected."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table as RichTable


@dataclass(frozen=True)
class Table:
    """A table as strings, rendered the same way to the terminal and to Markdown."""

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if any(len(row) != len(self.headers) for row in self.rows):
            raise ValueError("every row needs one cell per header")

    def rich(self) -> RichTable:
        table = RichTable(title=self.title)
        for i, header in enumerate(self.headers):
            # fold: a narrow terminal wraps a cell over lines rather than cutting it short.
            table.add_column(header, justify="left" if i < 2 else "right", overflow="fold")
        for row in self.rows:
            table.add_row(*row)
        return table

    def markdown(self) -> str:
        lines = [
            f"### {self.title}",
            "",
            "| " + " | ".join(self.headers) + " |",
            "|" + "|".join("---" if i < 2 else "---:" for i in range(len(self.headers))) + "|",
        ]
        lines += [
            "| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in self.rows
        ]
        return "\n".join(lines)


def print_table(console: Console, table: Table) -> None:
    """A rich table in a terminal; Markdown, every cell whole, when piped or redirected."""
    if console.is_terminal:
        console.print(table.rich())
    else:
        console.print(table.markdown() + "\n", markup=False, highlight=False, soft_wrap=True)
