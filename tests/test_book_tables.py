"""ssd.book.tables: the chapters' Table (formats, headers, missing values, Markdown that shows
what it holds) and the helpers that fit printed output and source to the book's code column."""
import math

import pytest

from ssd.book.tables import WIDTH, Table, show_source, wrap

ROWS = [dict(shape="a_b", ms=0.12345, n=3, note="x|y"),
        dict(shape="c", ms=None, n=4, note="[1] $2"),
        dict(shape="mean", ms=math.nan, n="", note="")]


def test_cells_formats_and_missing_values():
    t = Table(ROWS, ["shape", "ms", "n"], {"ms": ".3f", "n": "{}x"}, {"ms": "time ms"})
    assert [t.cell(r, "ms") for r in t] == ["0.123", "–", "–"]
    assert [t.cell(r, "n") for r in t] == ["3x", "4x", ""]       # strings stay as they are
    assert Table(ROWS, ["n"], {"n": lambda v: f"<{v}>"}).cell(ROWS[0], "n") == "<3>"
    assert [t.header(k) for k in t.columns] == ["shape", "time ms", "n"]
    assert Table(ROWS, {"n": "count"}).header("n") == "count"     # columns as {key: header}
    assert Table(ROWS).columns == ["shape", "ms", "n", "note"]    # the first row's keys


def test_rows_and_lookups():
    t = Table(ROWS, ["shape", "ms"])
    assert len(t) == 3 and t[1]["n"] == 4 and [r["shape"] for r in t] == t.column("shape")
    assert t.where(n=4) == [ROWS[1]] and t.find(shape="c") is ROWS[1]
    with pytest.raises(KeyError):
        t.find(shape="nowhere")
    wide = t.select(["shape", "n", "note"])
    assert wide.rows == t.rows and wide.columns == ["shape", "n", "note"]


def test_html_and_text_show_what_it_holds():
    t = Table(ROWS, ["shape", "ms", "note"], {"ms": ".2f", "note": lambda v: f"`{v}`"})
    page = t._repr_html_()
    assert page.count("<tr>") == 4 and page.count("text-align: right") == 4  # ms: numbers
    assert "<code><span" in page and {"x|y", "[1]", "$2"} <= set(html_text(page))  # code
    assert html_text(Table([dict(a="<b> & c")])._repr_html_()) == ["a", "<b> & c"]
    text = repr(Table(ROWS, ["shape", "ms"], {"ms": ".2f"})).splitlines()
    assert text == ["shape    ms", "  a_b  0.12", "    c     –", " mean     –"]


def html_text(page):
    from html.parser import HTMLParser

    cells = []
    parser = HTMLParser()
    parser.handle_data = cells.append
    parser.feed(page)
    return cells


def _example(x):
    # A run of whole-line comments is reflowed to the width; a trailing comment that makes
    # its line too long moves above the line.
    return x + 1  # one more than x, said at such length that the line no longer fits the column


def test_wrap_and_show_source_fit_the_column():
    line = "word " * 40
    assert all(len(x) <= WIDTH for x in wrap(f"  {line}\nshort").splitlines())
    assert wrap(f"  {line}").splitlines()[1].startswith("    word")  # continuation indented
    src = show_source(_example, width=60).splitlines()
    assert all(len(x) <= 60 for x in src)
    assert src[0] == "def _example(x):" and src[-1] == "    return x + 1"
    assert src[-3].startswith("    # one more than x")  # moved above, reflowed

