"""The one plain-text table renderer of the package (no rich, no colour): the
settings table of an OverlapConfig, the per-pass table of a model's layers and
the cost model's report all print through `table`.

    text = table("title", [Column("layer"), Column("ms", right=True), Column("notes", wrap=True)],
                 [("qkv", "1.0", "a long note ...")], rules_after={0})

Columns take the width of their longest cell; when the table is wider than
`width`, wrapping columns give up width first (down to their `min_width`), then
the widest others; a cell wider than its column continues on the next lines.
"""

from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass
from typing import Collection, Sequence

WIDTH = 160
_GAP = "  "
_RULE = "─"


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # right-justified (numbers)
    wrap: bool = False  # gives up width first; its text wraps at spaces
    min_width: int = 0


def _fit(columns: Sequence[Column], natural: list[int], width: int) -> list[int]:
    widths = list(natural)
    excess = 1 + sum(widths) + len(_GAP) * (len(widths) - 1) - width
    floors = [max(c.min_width, len(c.header), 8) if c.wrap else max(len(c.header), 4)
              for c in columns]
    for i in [i for i, c in enumerate(columns) if c.wrap] + sorted(
            (i for i, c in enumerate(columns) if not c.wrap), key=lambda i: -widths[i]):
        if excess <= 0:
            break
        cut = min(excess, max(0, widths[i] - floors[i]))
        widths[i] -= cut
        excess -= cut
    return widths


def _cell_lines(text: str, w: int) -> list[str]:
    if len(text) <= w:
        return [text]
    return textwrap.wrap(text, w, break_on_hyphens=False) or [""]


def table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], *,
          rules_after: Collection[int] = (), width: int = WIDTH) -> str:
    """`title`, a blank line, the header, a rule, then the rows (a rule after each row
    index in `rules_after`, except the last); lines end without trailing spaces."""
    natural = [max([len(c.header)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    widths = _fit(columns, natural, width)

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if col.right else c.ljust(w)
                 for c, w, col in zip(cells, widths, columns)]
        return (" " + _GAP.join(parts)).rstrip()

    rule = " " + _RULE * (sum(widths) + len(_GAP) * (len(widths) - 1))
    out = [title, "", line([c.header for c in columns]), rule]
    for n, row in enumerate(rows):
        wrapped = [_cell_lines(str(cell), w) for cell, w in zip(row, widths)]
        for k in range(max(map(len, wrapped))):
            out.append(line([cell[k] if k < len(cell) else "" for cell in wrapped]))
        if n in rules_after and n + 1 < len(rows):
            out.append(rule)
    return "\n".join(out) + "\n"


def lines(*texts: str) -> str:
    """Lines printed below a table, each as it is (never wrapped)."""
    return "".join(t + "\n" for t in texts)


def wrapped(*texts: str, indent: str = "  ", width: int = WIDTH) -> list[str]:
    """Each text as lines of at most `width`, starting at `indent` and continuing
    two spaces further in (notes below a table)."""
    return [line for t in texts for line in textwrap.wrap(
        t, width, initial_indent=indent, subsequent_indent=indent + "  ",
        break_on_hyphens=False) or [indent]]


def ranges(numbers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (layers or ranks that share a line); [-1] (no index) -> '-'."""
    out: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return ",".join("-" if a < 0 else str(a) if a == b else f"{a}-{b}" for a, b in out) or "-"


_said: set[str] = set()


def say_once(level: int, msg: str) -> None:
    """Log `msg` on the package's logger the first time only: every layer of a model would
    repeat it."""
    if msg not in _said:
        _said.add(msg)
        logging.getLogger("megatron_overlap").log(level, msg)
