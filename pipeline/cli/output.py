"""What ``vidx`` prints: tables for people, JSON for scripts (``--json``: that and nothing else on
stdout), progress bars on stderr only when stderr is a terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import typer

#: Width of a table written to a pipe or a file: wide enough that no row wraps (grep, awk, cut).
PIPE_WIDTH_CHARS = 10_000


@dataclass(frozen=True, slots=True)
class Column:
    header: str
    #: Right-aligned (numbers).
    right: bool = False
    #: In a narrow terminal, long values (URIs, links, reasons) fold onto more lines instead of
    #: being cut; short ones (ids, states, numbers) keep their width.
    fold: bool = False


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


def _cell(value: object) -> str:
    if value is None or value == "":
        return "-"
    return str(value)


def table(columns: Sequence[Column], rows: Iterable[Sequence[object]], *, empty: str) -> None:
    """Print ``rows`` under ``columns`` as aligned columns (``empty`` when there are none). On a
    terminal the table fits its width; elsewhere no row wraps."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    rows = list(rows)
    if not rows:
        typer.echo(empty)
        return
    terminal = sys.stdout.isatty()
    console = Console(width=None if terminal else PIPE_WIDTH_CHARS, highlight=False, markup=False, emoji=False)
    grid = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for column in columns:
        grid.add_column(
            column.header,
            justify="right" if column.right else "left",
            overflow="fold",
            no_wrap=not column.fold,
            min_width=len(column.header),
        )
    for row in rows:
        grid.add_row(*(Text(_cell(value)) for value in row))
    with console.capture() as captured:
        console.print(grid)
    typer.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def bars_on(as_json: bool) -> bool:
    """Progress bars are for people watching: never with ``--json``, never when stderr is redirected."""
    return not as_json and sys.stderr.isatty()


def progress_bar(total: int, *, as_json: bool, **options: Any) -> Any:
    """A tqdm bar on stderr (a silent one when ``bars_on`` says no)."""
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, disable=not bars_on(as_json), dynamic_ncols=True, **options)
