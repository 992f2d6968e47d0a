"""Tables a user reads in an 80-column terminal or a log file.

The first column is the row's key (a configuration, a tier, a counter): it is never wrapped or
cut, so rows stay apart. The other columns are right-aligned figures under short headers that
may wrap; there are no vertical rules. What does not fit a figure (an error, a per-tier
breakdown) goes on a line of its own below the table, not in a cell.
"""

from __future__ import annotations

from rich import box
from rich.table import Table


def table(title: str, key: str, *columns: str) -> Table:
    """A table keyed by its first column; ``columns`` are the figures' headers."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True,
              title_justify="left")
    t.add_column(key, no_wrap=True)
    for c in columns:
        t.add_column(c, justify="right")
    return t
