"""The built book, as a reader's browser shows it: every page checked in headless Chromium.

    python -m ssd.book.browser_check _build/html     # after jupyter-book build .

For every HTML page of the build (file:// URLs, no network: any request that leaves the
build folder is refused and reported) it checks that

- the page loads: no script error, every local resource it asks for exists;
- MathJax typeset every math element (``.math``: each holds an ``mjx-container``), no TeX error
  box, and no raw TeX (``$$``, ``\\(``, ``\\[``, ``\\begin{``, ``$\\alpha``-like) is left in the
  visible text outside code;
- every ``<img>`` loaded (``complete`` and ``naturalWidth > 0``);
- no unresolved glue or cross-reference: no literal MyST role such as ``{glue:text}``,
  ``{ref}``, ``{numref}`` in the text, no ``??`` as link text, no Python repr where a glued value
  should be (``<Figure size ...>``); links to other pages of the book (and their #anchors) exist;
- no code line is wider than the page: no ``<pre>`` block (code cell, output or code in prose)
  whose content is wider than its box (``scrollWidth > clientWidth``), in a 1440x1000 window,
  where the theme's text column is at its widest.

Why a width in pixels and not a number of characters: what a reader meets is a scroll bar, and
whether a line gets one depends on the theme's column and the font, which the browser knows and
a character count only approximates. The first line printed says how many characters the code
column holds (89 with Debian's fonts: keep code, and library source shown in a chapter, within
88), and each wide block is reported with its longest line's length.

Prints one line per page and a summary; exits 1 if any page fails (saying what failed), 2 if no
browser can be started. Needs the Python package ``playwright`` and a Chromium: Debian's
``chromium`` package (found at /usr/lib/chromium/chromium or on PATH), or ``--browser PATH``, or
the environment variable ``CHROMIUM``; Playwright's own downloaded browser as a last resort.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: The window: 1440 px is where the theme's text column reaches its widest (at 1024 to 1439 px the
#: page's table of contents takes a column beside it, below 1024 the layout is a phone's), so a
#: code line that scrolls here scrolls on every screen.
WINDOW = (1440, 1000)
PAGE_TIMEOUT_MS = 60_000
#: Folders of a Sphinx build that hold assets, not pages.
ASSET_DIRS = {"_static", "_images", "_sources", "_downloads", ".doctrees"}

#: Raw TeX left in the visible text: the math delimiters and environments MyST and Sphinx use,
#: and a dollar sign followed by a TeX command (``$\alpha``), which prose never has.
RAW_TEX = re.compile(r"\$\$|\\\(|\\\)|\\\[|\\\]|\\begin\{|\$\\[A-Za-z]")
#: MyST roles and directives that did not resolve, or a substitution left as written.
RAW_MYST = re.compile(r"\{(?:glue(?::[a-z]+)?|ref|numref|eq|doc|cite(?::[a-z]+)?|term|download"
                      r"|math|abbr|sub-ref)\}`?|```\{|\{\{[^}]*\}\}")
#: A Python repr where a glued value or a figure should be.
REPR = re.compile(r"<(?:Figure size|matplotlib\.|IPython\.core\.display\.|pandas\.io\.formats)")

#: Script errors that are the toolchain's, not the book's, and change nothing a reader sees:
#: sphinx-thebe 0.3.1 under Jupyter Book 1.0.x writes its inline config script
#: (``const THEBE_JS_URL = ...``) twice into every page, and the second declaration throws.
#: Thebe (live code through Binder) is not used by this book.
KNOWN_SCRIPT_ERRORS = re.compile(r"Identifier 'THEBE_JS_URL' has already been declared")
#: A page that only redirects (Jupyter Book's index.html): its target is checked, not it.
REDIRECT = re.compile(r'<meta\s+http-equiv="refresh"\s+content="\d+;\s*url=([^"]+)"', re.I)

# Evaluated in the page once it has loaded: waits for MathJax and the images, then measures.
_MEASURE_JS = r"""
async () => {
  // Collapsed <details> (hidden cells) would hide their code from the width check.
  for (const d of document.querySelectorAll('details')) d.open = true;
  const out = {};
  const mj = window.MathJax;
  out.mathjax = !!(mj && mj.startup);
  if (out.mathjax && mj.startup.promise) {
    try { await mj.startup.promise; } catch (e) { out.mathjaxError = String(e); }
  }
  // Images: load lazy ones too, wait for each (or 10 s), then read their size.
  const imgs = [...document.images];
  await Promise.all(imgs.map(img => {
    img.loading = 'eager';
    if (img.complete) return null;
    return new Promise(r => { img.addEventListener('load', r); img.addEventListener('error', r);
                              setTimeout(r, 10000); });
  }));
  out.images = imgs.length;
  out.brokenImages = imgs.filter(i => !i.complete || i.naturalWidth === 0)
                         .map(i => i.getAttribute('src'));
  // Math: every Sphinx math element holds what MathJax made of it.
  const math = [...document.querySelectorAll('.math')];
  out.math = math.length;
  out.mjx = document.querySelectorAll('mjx-container').length;
  out.untypeset = math.filter(m => !m.querySelector('mjx-container'))
                      .map(m => m.textContent.trim().slice(0, 80));
  out.texErrors = [...document.querySelectorAll('mjx-merror')]
                      .map(e => (e.getAttribute('data-mjx-error') || e.textContent).slice(0, 80));
  // The text a reader sees outside code and typeset math.
  const skip = 'pre, code, script, style, noscript, textarea, mjx-container, .highlight';
  const clone = document.body.cloneNode(true);
  for (const el of clone.querySelectorAll(skip)) el.remove();
  out.text = clone.textContent;
  out.badLinks = [...document.querySelectorAll('a')]
      .filter(a => a.textContent.includes('??')).map(a => a.getAttribute('href'));
  out.links = [...document.querySelectorAll('a[href]')].map(a => a.href)
      .filter(h => h.startsWith('file:'));
  out.ids = [...document.querySelectorAll('[id]')].map(e => e.id)
      .concat([...document.querySelectorAll('a[name]')].map(e => e.name));
  // Code wider than its box, for blocks a reader can see.
  out.columnChars = null;
  const first = [...document.querySelectorAll('pre')].find(p => p.offsetParent);
  if (first) {
    const cs = getComputedStyle(first);
    const ctx = document.createElement('canvas').getContext('2d');
    ctx.font = cs.font;
    const cw = ctx.measureText('0'.repeat(100)).width / 100;
    const pad = parseFloat(cs.paddingLeft) + parseFloat(cs.paddingRight);
    out.columnChars = Math.floor((first.clientWidth - pad) / cw);
  }
  out.pre = 0;
  out.wide = [];
  for (const pre of document.querySelectorAll('pre')) {
    if (!pre.offsetParent) continue;
    out.pre += 1;
    const over = pre.scrollWidth - pre.clientWidth;
    if (over <= 1) continue;
    const lines = pre.textContent.split('\n');
    const longest = lines.reduce((a, b) => (b.length > a.length ? b : a), '');
    const kind = pre.closest('.cell_output') ? 'output'
               : pre.closest('.cell_input') ? 'code cell' : 'code';
    out.wide.push({kind, over, chars: longest.length, line: longest.trim().slice(0, 60)});
  }
  return out;
}
"""


@dataclass
class PageResult:
    page: str
    problems: list[str] = field(default_factory=list)
    summary: str = ""
    links: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)
    column_chars: int | None = None


def find_pages(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.html")
                  if not ASSET_DIRS.intersection(p.relative_to(root).parts[:-1]))


def find_browser(given: str | None = None) -> str | None:
    """A Chromium executable: the one given, $CHROMIUM, Debian's (the binary itself, not the
    /usr/bin wrapper script), or one on PATH; None to let Playwright use its own download."""
    for cand in (given, os.environ.get("CHROMIUM"), "/usr/lib/chromium/chromium"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


def _text_problems(text: str) -> list[str]:
    problems = []
    for pat, what in ((RAW_TEX, "raw TeX in the text"), (RAW_MYST, "unresolved MyST markup"),
                      (REPR, "a Python repr in the text")):
        found = [m.group(0) for m in pat.finditer(text)]
        if found:
            ctx = []
            for m in list(pat.finditer(text))[:3]:
                ctx.append(" ".join(text[max(0, m.start() - 30):m.end() + 30].split()))
            problems.append(f"{what}: {len(found)}x, e.g. " + " | ".join(repr(c) for c in ctx))
    return problems


def check_page(page, path: Path, root: Path, show: int = 3) -> PageResult:
    """Load one page in a Playwright ``page`` and return what is wrong with it (at most ``show``
    examples of each kind)."""
    rel = str(path.relative_to(root))
    res = PageResult(rel)
    errors: list[str] = []
    failed: list[str] = []

    def on_request_failed(req):
        if req.url.startswith("file:"):
            failed.append(unquote(urlsplit(req.url).path))

    def on_page_error(exc):
        msg = str(exc).splitlines()[0][:120]
        if not KNOWN_SCRIPT_ERRORS.search(msg):
            errors.append(msg)

    head = path.read_text(encoding="utf-8", errors="replace")[:4000]
    if redirect := REDIRECT.search(head):
        target = (path.parent / unquote(urlsplit(redirect.group(1)).path)).resolve()
        res.summary = f"redirects to {os.path.relpath(target, root)}"
        if not target.is_file():
            res.problems.append(f"redirects to a missing page: {redirect.group(1)}")
        return res
    page.on("pageerror", on_page_error)
    page.on("requestfailed", on_request_failed)
    try:
        page.goto(path.resolve().as_uri(), wait_until="load", timeout=PAGE_TIMEOUT_MS)
        m = page.evaluate(_MEASURE_JS)
    except Exception as exc:  # a page that does not load is a result, not a crash
        res.problems.append(f"did not load: {str(exc).splitlines()[0][:200]}")
        return res
    finally:
        page.remove_listener("requestfailed", on_request_failed)

    p = res.problems
    if errors:
        p.append(f"script errors: {errors[:3]}")
    if failed:
        p.append("missing files: " + ", ".join(sorted({os.path.relpath(f, root) for f in failed})[:5]))
    if m["math"] and not m["mathjax"]:
        p.append(f"{m['math']} math elements but MathJax did not load")
    elif m["untypeset"]:
        p.append(f"{len(m['untypeset'])} of {m['math']} math elements not typeset, e.g. "
                 f"{m['untypeset'][0]!r}")
    if m.get("mathjaxError"):
        p.append(f"MathJax failed: {m['mathjaxError'][:120]}")
    if m["texErrors"]:
        p.append(f"{len(m['texErrors'])} TeX errors, e.g. {m['texErrors'][0]!r}")
    if m["brokenImages"]:
        p.append(f"{len(m['brokenImages'])} of {m['images']} images did not load: "
                 + ", ".join(m["brokenImages"][:3]))
    p.extend(_text_problems(m["text"]))
    if m["badLinks"]:
        p.append(f"links shown as '??' (unresolved reference): {m['badLinks'][:3]}")
    for w in m["wide"][:show]:
        p.append(f"{w['kind']} {w['over']} px wider than the page ({w['chars']} characters): "
                 f"{w['line']!r}")
    if len(m["wide"]) > show:
        p.append(f"... {len(m['wide']) - show} more wide blocks (-v lists them)")
    res.column_chars = m["columnChars"]
    res.links = m["links"]
    res.ids = set(m["ids"])
    res.summary = (f"math {m['mjx']}/{m['math']}, images {m['images']}, code blocks {m['pre']}")
    return res


def check_links(results: list[PageResult], root: Path) -> None:
    """Links from page to page inside the build: the target file exists, and so does the
    #anchor when the target is a page checked here."""
    by_path = {(root / r.page).resolve(): r for r in results}
    for r in results:
        missing = set()
        for href in r.links:
            url = urlsplit(href)
            target = Path(unquote(url.path))
            if not target.exists():
                missing.add(os.path.relpath(target, root))
            elif url.fragment and (t := by_path.get(target.resolve())) and t.ids \
                    and unquote(url.fragment) not in t.ids:
                missing.add(f"{os.path.relpath(target, root)}#{url.fragment}")
        if missing:
            r.problems.append(f"{len(missing)} broken links: " + ", ".join(sorted(missing)[:5]))


class Browser:
    """Headless Chromium with one window; ``check(path, root)`` loads a page and returns its
    PageResult. Requests that leave the build (http, https) are refused and reported: the book
    must work offline."""

    def __init__(self, executable: str | None = None):
        from playwright.sync_api import sync_playwright
        self.executable = executable
        self._pw = sync_playwright().start()
        try:
            self.browser = self._pw.chromium.launch(
                executable_path=executable,
                args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        except Exception:
            self._pw.stop()
            raise
        self.context = self.browser.new_context(
            viewport={"width": WINDOW[0], "height": WINDOW[1]})
        self._offline: list[str] = []
        self.context.route("**/*", self._route)

    def _route(self, r):
        if r.request.url.startswith(("file:", "data:", "blob:")):
            r.continue_()
        else:
            self._offline.append(r.request.url)
            r.abort()

    def check(self, path: Path, root: Path, show: int = 3) -> PageResult:
        self._offline = []
        page = self.context.new_page()
        try:
            res = check_page(page, path, root, show)
        finally:
            page.close()
        if self._offline:
            res.problems.append("asks the network for: "
                                + ", ".join(sorted(set(self._offline))[:5]))
        return res

    def close(self):
        self.browser.close()
        self._pw.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd.book.browser_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("html", nargs="?", default="_build/html", type=Path,
                    help="the built book (default: _build/html)")
    ap.add_argument("pages", nargs="*", help="only these pages (paths relative to HTML)")
    ap.add_argument("--browser", help="Chromium executable (default: $CHROMIUM, Debian's chromium)")
    ap.add_argument("-v", "--verbose", action="store_true", help="list every wide code block")
    args = ap.parse_args(argv)
    root: Path = args.html.resolve()
    pages = [root / p for p in args.pages] if args.pages else find_pages(root)
    if not pages:
        print(f"browser_check: no HTML pages under {root} (build the book first)", file=sys.stderr)
        return 1
    try:
        import playwright  # noqa: F401
    except ImportError:
        print("browser_check: the Python package playwright is missing (pip install playwright)",
              file=sys.stderr)
        return 2
    exe = find_browser(args.browser)
    t0 = time.perf_counter()
    try:
        browser = Browser(exe)
    except Exception as exc:
        print(f"browser_check: cannot start Chromium ({exe or 'Playwright default'}): "
              f"{str(exc).splitlines()[0]}\n  install Debian's chromium (apt-get install "
              f"chromium) or pass --browser PATH", file=sys.stderr)
        return 2
    with browser:
        print(f"browser_check: {len(pages)} pages under {root}, Chromium "
              f"{browser.browser.version} ({exe or 'Playwright default'}), window "
              f"{WINDOW[0]}x{WINDOW[1]}", flush=True)
        show = 10**6 if args.verbose else 3
        results = [browser.check(path, root, show) for path in pages]
    check_links(results, root)
    columns = sorted({r.column_chars for r in results if r.column_chars})
    if columns:
        print(f"browser_check: code column {'-'.join(map(str, columns[::len(columns) - 1 or 1]))} "
              f"characters wide")
    failed = [r for r in results if r.problems]
    for r in results:
        print(f"{'FAIL' if r.problems else 'ok  '} {r.page}  {r.summary}")
        for p in r.problems:
            print(f"       - {p}")
    print(f"browser_check: {len(results)} pages, {len(results) - len(failed)} ok, "
          f"{len(failed)} failed ({time.perf_counter() - t0:.1f} s)")
    if failed:
        print("failed: " + ", ".join(r.page for r in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
