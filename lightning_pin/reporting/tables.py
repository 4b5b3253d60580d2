"""The one console table printer of lightning-pin: rich when it is installed (the ``app`` extra),
plain aligned text otherwise. The run report, ``lightning-pin diff`` and the sweep summary print
through it.

In a terminal, rich fits the table to the window (long names wrap inside their cells); in a log or
a pipe the table keeps its natural width, so no number is ever cut or folded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Optional, Union

__all__ = ["Column", "plain_lines", "print_table"]


@dataclasses.dataclass(frozen=True)
class Column:
    """One column of a table.

    Args:
        header: Its heading.
        justify: ``"left"`` or ``"right"`` (numbers), in rich and in plain text alike.
        style: A rich style for every cell of the column (``"bold"``); plain text ignores it.
        no_wrap: Never fold its cells over several lines (rich only).
    """

    header: str
    justify: Literal["left", "right"] = "left"
    style: Optional[str] = None
    no_wrap: bool = False


def print_table(
    columns: Sequence[Union[str, Column]],
    rows: Sequence[Sequence[str]],
    title: Optional[str] = None,
    *,
    show_header: bool = True,
    row_styles: Optional[Sequence[Optional[str]]] = None,
    footer: Sequence[tuple[str, Optional[str]]] = (),
) -> None:
    """Print ``rows`` under ``columns`` (rich when installed, else :func:`plain_lines`), then ``footer``.

    Args:
        columns: One :class:`Column`, or a header string for a left-justified column, per cell of a row.
        rows: The cells, already formatted as text; a cell may span several lines (``"\\n"``).
        title: Printed above the table.
        show_header: Print the column headers.
        row_styles: A rich style per row (``"dim"``, ``"red"``) or None; plain text ignores them.
        footer: ``(text, style)`` lines printed after the table, as they are (never read as rich markup).

    Raises:
        ValueError: a row has a different number of cells than there are columns, or
            ``row_styles`` has a different length than ``rows``.
    """
    columns = _columns(columns)
    _check(columns, rows, row_styles)
    try:
        from rich.console import Console
        from rich.measure import Measurement
        from rich.table import Table
    except ImportError:
        print("\n".join(plain_lines(columns, rows, title, show_header=show_header)))
        for text, _ in footer:
            print(text)
        return
    table = Table(title=title, show_header=show_header)
    for column in columns:
        table.add_column(column.header, justify=column.justify, style=column.style, no_wrap=column.no_wrap)
    for i, row in enumerate(rows):
        table.add_row(*row, style=None if row_styles is None else row_styles[i])
    console = Console()
    if not console.is_terminal:
        # A log or a pipe: the table's natural width, not rich's default of 80 columns.
        natural = Measurement.get(console, console.options.update(width=1000), table).maximum
        console = Console(width=max(console.width, natural))
    console.print(table)
    for text, style in footer:
        console.print(text, style=style, markup=False, soft_wrap=True)


def plain_lines(
    columns: Sequence[Union[str, Column]],
    rows: Sequence[Sequence[str]],
    title: Optional[str] = None,
    *,
    show_header: bool = True,
) -> list[str]:
    """The table as aligned plain-text lines: the title, then the header and rows indented by two.

    Example::

        >>> from lightning_pin.reporting.tables import Column, plain_lines
        >>> columns = ["tensor", Column("changed", justify="right")]
        >>> lines = plain_lines(columns, [["head.weight", "48"], ["head.bias", "3"]], title="a.ckpt -> b.ckpt")
        >>> print("\\n".join(lines))
        a.ckpt -> b.ckpt
          tensor       changed
          head.weight       48
          head.bias          3

    Raises:
        ValueError: a row has a different number of cells than there are columns.
    """
    columns = _columns(columns)
    _check(columns, rows, None)
    cells = [[cell.replace("\n", " ") for cell in row] for row in rows]
    if show_header:
        cells.insert(0, [c.header for c in columns])
    widths = [max([0] + [len(row[i]) for row in cells]) for i in range(len(columns))]
    lines = [] if title is None else title.splitlines()
    for row in cells:
        padded = (c.rjust(w) if col.justify == "right" else c.ljust(w) for c, w, col in zip(row, widths, columns))
        lines.append(("  " + "  ".join(padded)).rstrip())
    return lines


def _columns(columns: Sequence[Union[str, Column]]) -> list[Column]:
    return [c if isinstance(c, Column) else Column(str(c)) for c in columns]


def _check(columns: Sequence[Column], rows: Sequence[Sequence[str]], row_styles: Optional[Sequence[object]]) -> None:
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(
                f"row {i} has {len(row)} cells but the table has {len(columns)} columns "
                f"({', '.join(c.header for c in columns)})"
            )
    if row_styles is not None and len(row_styles) != len(rows):
        raise ValueError(f"row_styles has {len(row_styles)} entries for {len(rows)} rows: give one per row")
