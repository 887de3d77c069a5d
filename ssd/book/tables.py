"""What the chapters' table-and-figure modules share: :class:`Table`, the tidy table they
return, and :func:`wrap` and :func:`show_source`, which fit printed output and library source
to the book's code column.
"""
from __future__ import annotations

import html
import math
import re

#: The widest line a code block of the book shows without a scroll bar (ssd.book.browser_check).
WIDTH = 88
#: Code in a cell, as Markdown marks it: shown in a code font.
_CODE = re.compile(r"`([^`]+)`")


class Table:
    """Rows of dicts, shown as an HTML table in Jupyter and the book (numbers right-aligned,
    text in backticks in a code font) and as fixed-width text by ``repr``.

    Args:
        rows: list of dicts, one a row; a row may hold more keys than are shown.
        columns: the keys shown, in order: a list, or {key: header} (default: the first row's
            keys).
        formats: {key: format}: a format spec (``".3f"``), a ``str.format`` template
            (``"{:.2f}x"``; specs and templates leave strings as they are) or a callable.
        labels: {key: header} where the header is not the key with its underscores as spaces.
    A missing value (None, NaN) shows as a dash.
    """

    def __init__(self, rows, columns=None, formats=None, labels=None):
        self.rows = list(rows)
        columns = columns or list(self.rows[0] if self.rows else {})
        self.labels = {**columns, **(labels or {})} if isinstance(columns, dict) else \
            dict(labels or {})
        self.columns = list(columns)
        self.formats = dict(formats or {})

    def __len__(self):
        return len(self.rows)

    def __iter__(self):
        return iter(self.rows)

    def __getitem__(self, i):
        return self.rows[i]

    def column(self, key) -> list:
        """The values of one column, in row order (None where a row lacks it)."""
        return [r.get(key) for r in self.rows]

    def where(self, **match) -> list:
        """The rows whose values equal ``match``."""
        return [r for r in self.rows if all(r.get(k) == v for k, v in match.items())]

    def find(self, **match) -> dict:
        """The one row whose values equal ``match``."""
        hits = self.where(**match)
        if len(hits) != 1:
            raise KeyError(f"{len(hits)} rows match {match}")
        return hits[0]

    def select(self, columns) -> "Table":
        """The same rows with other columns shown."""
        return Table(self.rows, list(columns), self.formats, self.labels)

    def header(self, key) -> str:
        return str(self.labels.get(key, str(key).replace("_", " ")))

    def cell(self, row, key) -> str:
        """One cell as text."""
        value, fmt = row.get(key), self.formats.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if callable(fmt):
            return fmt(value)
        if fmt and not isinstance(value, str):
            return fmt.format(value) if "{" in fmt else format(value, fmt)
        return str(value)

    def _repr_html_(self) -> str:
        right = {k: all(isinstance(v, (int, float)) or v in (None, "") for v in self.column(k))
                 for k in self.columns}  # numbers (and blanks, dashes) right-aligned

        def code(m):  # lines break between its words only, as in Sphinx's literals
            return "<code>" + " ".join(f'<span style="white-space: nowrap">{w}</span>'
                                       for w in m[1].split(" ")) + "</code>"

        def tag(name, text, key):
            text = _CODE.sub(code, html.escape(text))
            return (f'<{name} style="padding: 0.2em 0.25em; text-align: '
                    f'{"right" if right[key] else "left"}">{text}</{name}>')

        head = "".join(tag("th", self.header(k), k) for k in self.columns)
        body = "".join("<tr>" + "".join(tag("td", self.cell(r, k), k) for k in self.columns)
                       + "</tr>" for r in self.rows)
        return (f'<table class="table" style="font-size: 85%"><thead><tr>{head}</tr></thead>'
                f"<tbody>{body}</tbody></table>")  # class: the book theme's table style

    def __repr__(self) -> str:
        cells = [[self.header(k) for k in self.columns]]
        cells += [[self.cell(r, k) for k in self.columns] for r in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def wrap(text: str, width: int = WIDTH) -> str:
    """``text`` with every line longer than ``width`` broken at spaces, the continuation
    indented two spaces more than the line: printed output that fits the book's code column."""
    import textwrap

    out = []
    for line in str(text).splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out += textwrap.wrap(line, width, subsequent_indent=indent + "  ", break_long_words=True,
                             break_on_hyphens=False) or [""]
    return "\n".join(out)


def show_source(obj, width: int = WIDTH) -> str:
    """The source of a function or class, fitted to ``width``: runs of whole-line comments
    reflowed, and a trailing comment that makes a line too long moved above it (reflowed too)."""
    import inspect
    import textwrap

    lines, out, comment = inspect.getsource(obj).splitlines(), [], []

    def flush():
        if comment:
            indent = comment[0][:len(comment[0]) - len(comment[0].lstrip())]
            text = " ".join(c.strip()[1:].strip() for c in comment)
            out.extend(textwrap.wrap(text, width, initial_indent=indent + "# ",
                                     subsequent_indent=indent + "# "))
            comment.clear()

    for line in lines:
        if line.lstrip().startswith("#"):
            comment.append(line)
            continue
        flush()
        if len(line) > width and "  # " in line:
            code, note = line.split("  # ", 1)
            comment.append(line[:len(line) - len(line.lstrip())] + "# " + note)
            flush()
            line = code.rstrip()
        out.append(line)
    flush()
    return "\n".join(out)


def pct(v) -> str:
    """A fraction as a percentage, for table cells and figure labels."""
    return f"{100 * v:.1f}\u00a0%"  # no break before the sign


__all__ = ["Table", "WIDTH", "wrap", "show_source", "pct"]
