"""ssd.book.browser_check on small made-up pages: each defect it exists to find, found, and a
clean page passed. Needs Playwright and a Chromium (Debian's chromium package); skipped without."""
import struct
import subprocess
import sys
import zlib

import pytest

pytest.importorskip("playwright.sync_api")
from ssd.book import browser_check as bc  # noqa: E402

EXE = bc.find_browser()
pytestmark = pytest.mark.skipif(EXE is None, reason="no Chromium (apt-get install chromium)")


def _png(width=2, height=2) -> bytes:
    """A valid grey PNG, built here so the test needs no image file."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    raw = b"".join(b"\0" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


GOOD = """<html><body><main>
<p>A chapter with an image <img src="fig.png"> and short code, and a link to
<a href="bad.html#sec">the other page</a>; a price of $5 is not TeX.</p>
<div class="cell_input"><pre>y = x + 1</pre></div>
<pre>a line with \\(TeX\\) inside code is code</pre>
</main></body></html>"""

BAD = """<html><body><main id="sec">
<p>Raw display math $$x^2$$ and inline \\(a_t\\) left as typed.</p>
<span class="math notranslate nohighlight">\\(h_t\\)</span>
<p>A glued value {glue:text}`speedup` and a reference {numref}`fig-x`, a figure
&lt;Figure size 640x480 with 1 Axes&gt;, a link <a href="#nowhere">??</a>,
a page that is not there <a href="missing.html">here</a>.</p>
<img src="missing.png"> <img src="fig.png">
<div class="cell_input"><pre>""" + "x = " + "1 + " * 80 + "1" + """</pre></div>
</main></body></html>"""


@pytest.fixture(scope="module")
def browser():
    b = bc.Browser(EXE)
    yield b
    b.close()


@pytest.fixture
def site(tmp_path):
    (tmp_path / "fig.png").write_bytes(_png())
    (tmp_path / "good.html").write_text(GOOD)
    (tmp_path / "bad.html").write_text(BAD)
    (tmp_path / "index.html").write_text(
        '<html><head><meta http-equiv="refresh" content="0; url=good.html" /></head></html>')
    return tmp_path


def test_a_clean_page_passes(browser, site):
    res = browser.check(site / "good.html", site)
    bc.check_links([res], site)
    assert res.problems == [], res.problems
    assert res.summary.startswith("math 0/0, images 1, code blocks 2")


def test_each_defect_is_reported(browser, site):
    res = browser.check(site / "bad.html", site)
    bc.check_links([res], site)
    text = "\n".join(res.problems)
    assert "1 math elements but MathJax did not load" in text
    assert "1 of 2 images did not load: missing.png" in text
    assert "missing files: missing.png" in text
    assert "raw TeX in the text" in text and "$$x^2$$" in text
    assert "unresolved MyST markup: 2x" in text
    assert "a Python repr in the text" in text
    assert "links shown as '??'" in text
    assert "code cell" in text and "px wider than the page (325 characters)" in text
    assert "2 broken links: bad.html#nowhere, missing.html" in text


def test_a_redirect_is_followed_not_loaded(browser, site):
    res = browser.check(site / "index.html", site)
    assert res.problems == [] and res.summary == "redirects to good.html"
    (site / "good.html").unlink()
    assert "redirects to a missing page" in browser.check(site / "index.html", site).problems[0]


def test_the_network_is_refused_and_reported(browser, site):
    (site / "net.html").write_text('<html><body><img src="https://example.invalid/x.png">'
                                   '</body></html>')
    res = browser.check(site / "net.html", site)
    assert any("asks the network for: https://example.invalid/x.png" in p for p in res.problems)


def test_the_command_exit_codes(site):
    """The command line, in its own process (Playwright's sync API runs one per thread)."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "ssd.book.browser_check", str(site), *args],
                              capture_output=True, text=True, timeout=120)
    ok = run("good.html")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = run()
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL bad.html" in bad.stdout and "ok   good.html" in bad.stdout
    assert "3 pages, 2 ok, 1 failed" in bad.stdout
