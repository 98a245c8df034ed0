"""How adapterctl's read commands print: a table (``-o table``, the default), a table with
more columns (``-o wide``), or JSON / YAML (``-o json|yaml``).

A listing is a list of rows; each row is a dict of JSON values (numbers as numbers, times as
RFC 3339 strings or null, lists and maps whole). ``-o json|yaml`` prints the rows as they are:
a list of objects whose keys are the table's column keys (wide columns included), so scripts
read the same fields the table shows, untruncated. A command that prints several listings
(``status``, ``rollout history``) prints one object holding them.

Tables are never cut to the terminal: when stdout is not a terminal (a pipe, a file), every
cell is printed whole on one line, however wide the table gets.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = [
    "OUTPUT_FORMATS",
    "PIPE_WIDTH",
    "Column",
    "Listing",
    "check_format",
    "print_payload",
    "print_tables",
    "rfc3339",
    "stdout_console",
]

OUTPUT_FORMATS = ("table", "wide", "json", "yaml")
# The console width used when stdout is not a terminal: wide enough that no cell is cut.
PIPE_WIDTH = 1_000_000


def check_format(output: str) -> str:
    """``output`` lower-cased; ValueError naming ``--output`` when it is no known format."""
    fmt = output.strip().lower()
    if fmt not in OUTPUT_FORMATS:
        raise ValueError(f"--output: {output!r} is not one of {', '.join(OUTPUT_FORMATS)}")
    return fmt


def stdout_console() -> Console:
    """A console on the current stdout: the terminal's width on a terminal, else unbounded."""
    console = Console()
    if console.is_terminal:
        return console
    return Console(width=PIPE_WIDTH)


def rfc3339(seconds: int, nanos: int = 0) -> str | None:
    """A protobuf Timestamp's seconds as ``2026-01-02T03:04:05Z``; None when unset."""
    if not seconds and not nanos:
        return None
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
    return str(value)


@dataclass(frozen=True)
class Column:
    """A table column: its header, the row key it shows, and how (default: the value as
    text, ``-`` for none). ``wide`` columns show only with ``-o wide``."""

    header: str
    key: str
    render: Callable[[dict[str, Any]], str] | None = None
    wide: bool = False

    def text(self, row: dict[str, Any]) -> str:
        return self.render(row) if self.render is not None else _cell(row.get(self.key))


@dataclass
class Listing:
    columns: Sequence[Column]
    rows: list[dict[str, Any]]
    title: str | None = None
    # A rich style per row (``""``: none), e.g. red for a lagging node.
    styles: list[str] = field(default_factory=list)

    def table(self, wide: bool) -> Table:
        shown = [c for c in self.columns if wide or not c.wide]
        table = Table(
            *(c.header for c in shown),
            title=escape(self.title) if self.title is not None else None,
        )
        for n, row in enumerate(self.rows):
            style = self.styles[n] if n < len(self.styles) else ""
            table.add_row(*(escape(c.text(row)) for c in shown), style=style or None)
        return table


def print_payload(payload: Any, fmt: str) -> None:
    """JSON (indented, keys in the rows' order) or YAML; one YAML document."""
    if fmt == "json":
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
    else:
        sys.stdout.write(yaml.safe_dump(payload, sort_keys=False, allow_unicode=True))


def print_tables(listings: Sequence[Listing | None], fmt: str, payload: Any) -> None:
    """The listings as tables (``None`` entries skipped), or ``payload`` as JSON / YAML."""
    if fmt in ("json", "yaml"):
        print_payload(payload, fmt)
        return
    console = stdout_console()
    for listing in listings:
        if listing is not None:
            console.print(listing.table(wide=fmt == "wide"))
