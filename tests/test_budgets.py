"""Budgets a reader and the GPU machine can live with, checked on the CPU in well under a second.

- every chapter (notebooks/*.ipynb): at most 4,000 words of markdown (markdown cells, split on
  whitespace) and at most 400 lines of code cells;
- the prose speaks of the design as it is: no commit hashes and none of the project's working
  vocabulary in the chapters' markdown, book/*.md, README.md, DESIGN.md, ssd/ or tests/;
- README.md at most 6,000 characters, DESIGN.md at most 15,000;
- results/ at most 2 MB, the repository without .gpu/ under 4 MiB (so it travels to the GPU
  machine beside the toolchain);
- every recording under results/ names one git revision (that of the GPU tests' summary).

Each case is parametrized per file, and each message names the file and the value to fix.
"""
from __future__ import annotations

import ast
import io
import json
import re
import subprocess
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from ssd.tools.env import read_json

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RESULTS = ROOT / "results"

MAX_MARKDOWN_WORDS = 4_000
MAX_CODE_LINES = 400
MAX_README_CHARS = 6_000
MAX_DESIGN_CHARS = 15_000
MAX_RESULTS_BYTES = 2_000_000  # "2 MB"
MAX_REPO_BYTES = 4 * 2**20     # "4 MiB"

# The working vocabulary. Each pattern is built from pieces so that this file's own source
# does not match it (the file is scanned like every other under tests/).
VOCABULARY = [
    re.compile(r"\bst" + r"op[ -]?\d+\b", re.IGNORECASE),
    re.compile(r"\blan" + r"ded\b", re.IGNORECASE),
    re.compile(r"\bscree" + r"ning\b", re.IGNORECASE),
    re.compile(r"previous" + r" run", re.IGNORECASE),
    re.compile(r"\bses" + r"sion\b", re.IGNORECASE),
]
# A commit hash as git prints one: 7 to 40 lowercase hex digits as a word, with at least one
# digit and one letter (so neither a plain number nor an English word such as "decade" or
# "facade" counts). Hex in code is no hash: "0x1f" has no word boundary before "1f", a CSS
# colour "#1f77b4" has six digits, a sha256 digest (64) is longer than 40.
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _cells(nb: Path, kind: str) -> list[str]:
    cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"]
            for c in cells if c["cell_type"] == kind]


# ---------------------------------------------------------------------------------------------
# Chapter budgets

@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_markdown_words(nb):
    words = sum(len(src.split()) for src in _cells(nb, "markdown"))
    assert words <= MAX_MARKDOWN_WORDS, (
        f"{_rel(nb)}: {words:,} words of markdown, budget {MAX_MARKDOWN_WORDS:,}")


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_chapter_code_lines(nb):
    lines = sum(len(src.splitlines()) for src in _cells(nb, "code"))
    assert lines <= MAX_CODE_LINES, (
        f"{_rel(nb)}: {lines:,} lines in code cells, budget {MAX_CODE_LINES:,} "
        f"(move computation into a library function that returns a table)")


# ---------------------------------------------------------------------------------------------
# Prose: no hashes, no working vocabulary

def _literal(token: str):
    try:
        return ast.literal_eval(token)
    except (ValueError, SyntaxError):  # an f-string
        return None


def _python_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and string literal in a Python file.

    Code proper is left out: a float literal's digits and exponent can read as hex (a mantissa of
    seven digits or more before ``e``), and identifiers are names, not prose.
    A string whose whole content is one word that pytest defines (the fixture scope name) is
    pytest's vocabulary, not ours, and is skipped.
    """
    kinds = {tokenize.COMMENT, tokenize.STRING}
    if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python 3.12+: f-strings come in pieces
        kinds.add(tokenize.FSTRING_MIDDLE)
    pytest_words = {"ses" + "sion"}
    out = []
    source = path.read_text(encoding="utf-8")
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in kinds:
            continue
        if tok.type == tokenize.STRING and _literal(tok.string) in pytest_words:
            continue
        out.append((tok.start[0], tok.string))
    return out


def _markdown_prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a markdown file, or of a notebook's markdown cells (cell number, source):
    never code cells, outputs or metadata (these hold ids, colours and digests)."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return [(i, "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
                for i, c in enumerate(cells) if c["cell_type"] == "markdown"]
    return list(enumerate(path.read_text(encoding="utf-8").splitlines(), start=1))


PROSE_FILES = sorted(
    NOTEBOOKS
    + sorted((ROOT / "book").glob("**/*.md"))
    + [p for p in (ROOT / "README.md", ROOT / "DESIGN.md") if p.exists()]
    + sorted((ROOT / "ssd").glob("**/*.py"))
    + sorted((ROOT / "tests").glob("**/*.py")))


def _prose(path: Path) -> tuple[str, list[tuple[int, str]]]:
    if path.suffix == ".py":
        return "line", _python_prose(path)
    if path.suffix == ".ipynb":
        return "cell", _markdown_prose(path)
    return "line", _markdown_prose(path)


def _hits(path: Path, patterns) -> list[str]:
    where, chunks = _prose(path)
    hits = []
    for n, text in chunks:
        for pat in patterns:
            for m in pat.finditer(text):
                k = text.count("\n", 0, m.start())
                at = f"{where} {n}, its line {k + 1}" if where != "line" else f"line {n + k}"
                hits.append(f"{at}: {m.group(0)!r}")
    return hits


def _report(path: Path, what: str, hits: list[str]) -> str:
    shown = "; ".join(hits[:15]) + (f"; ... {len(hits) - 15} more" if len(hits) > 15 else "")
    return f"{_rel(path)}: {len(hits)} {what}: {shown}"


@pytest.mark.parametrize("path", PROSE_FILES, ids=_rel)
def test_no_working_vocabulary(path):
    hits = _hits(path, VOCABULARY)
    assert not hits, _report(path, "working-vocabulary mention(s)", hits)


@pytest.mark.parametrize("path", PROSE_FILES, ids=_rel)
def test_no_commit_hashes(path):
    hits = _hits(path, [HASH])
    assert not hits, _report(path, "commit hash(es)", hits)


def test_patterns_catch_what_they_mean():
    """The patterns themselves: what they must catch and what they must leave alone."""
    def vocab(s):
        return any(p.search(s) for p in VOCABULARY)
    for bad in ["since st" "op 38", "St" "op-7", "st" "op42", "none lan" "ded",
                "the scree" "ning runs", "as in the previous" " run", "this ses" "sion"]:
        assert vocab(bad), bad
    for good in ["stop the timer", "range(start, stop)", "landing page", "screen", "sessions"]:
        assert not vocab(good), good
    # (samples in pieces of fewer than seven hex digits, for the same reason)
    for bad in ["88e" "467f", "at 474f" "74c4" "22f9 (the suite)", "a1b2" "c3d"]:
        assert HASH.search(bad), bad
    for good in ["0x7fff" "ffff", "#1f77b4", "facade", "decade", "1234567", "fp16", "bf16",
                 "a" * 64 + "1", "ssd_12" "34abc", "sha256 " + ("01234" "56789" "abcdef") * 4]:
        assert not HASH.search(good), good


def test_python_prose_skips_code():
    src = ROOT / "tests" / "test_budgets.py"
    texts = " ".join(t for _, t in _python_prose(src))
    assert "A commit hash as git prints one" in texts  # a comment is read
    assert "generate" "_tokens" not in texts            # code is not


# ---------------------------------------------------------------------------------------------
# Documents

@pytest.mark.parametrize("name, limit", [("README.md", MAX_README_CHARS),
                                         ("DESIGN.md", MAX_DESIGN_CHARS)])
def test_document_length(name, limit):
    n = len((ROOT / name).read_text(encoding="utf-8"))
    assert n <= limit, f"{name}: {n:,} characters, budget {limit:,}"


# ---------------------------------------------------------------------------------------------
# Sizes: what travels to the GPU machine

def _repo_files() -> list[Path]:
    """The files a copy of the working tree holds: tracked ones and untracked ones git does not
    ignore (what a checkout carries), that exist on disk."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = {ROOT / p for p in out.decode().split("\0") if p}
    return sorted(p for p in paths if p.is_file() and not p.is_symlink())


def _largest(files: list[Path], n: int = 5) -> str:
    sizes = sorted(((p.stat().st_size, p) for p in files), reverse=True)[:n]
    return ", ".join(f"{_rel(p)} {s / 1e3:,.0f} kB" for s, p in sizes)


def test_results_size():
    files = [p for p in _repo_files() if p.is_relative_to(RESULTS)]
    total = sum(p.stat().st_size for p in files)
    assert total <= MAX_RESULTS_BYTES, (
        f"results/: {total / 1e6:.2f} MB in {len(files)} files, budget "
        f"{MAX_RESULTS_BYTES / 1e6:.0f} MB; largest: {_largest(files)}")


def test_repository_size():
    files = [p for p in _repo_files() if not p.relative_to(ROOT).parts[0] == ".gpu"]
    total = sum(p.stat().st_size for p in files)
    by_top = Counter()
    for p in files:
        by_top[p.relative_to(ROOT).parts[0]] += p.stat().st_size
    top = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in by_top.most_common(5))
    assert total < MAX_REPO_BYTES, (
        f"repository without .gpu/: {total / 2**20:.2f} MiB in {len(files)} files, budget "
        f"{MAX_REPO_BYTES / 2**20:.0f} MiB; by folder: {top}; largest: {_largest(files)}")


# ---------------------------------------------------------------------------------------------
# One recording revision

GPU_DIRS = sorted(p for p in RESULTS.iterdir() if p.is_dir() and p.name != "compile") \
    if RESULTS.is_dir() else []
RECORDINGS = sorted(p for d in GPU_DIRS for p in [*d.glob("**/*.json"), *d.glob("**/*.json.gz")])
# results/compile/ holds what ssd.tools.aot records on the CPU (registers and spills of the
# study's kernels); it carries an environment record too, and the chapters read it beside the
# GPU recordings, so it must name the same revision when it names one.
COMPILED = sorted((RESULTS / "compile").glob("**/*.json")) if RESULTS.is_dir() else []


def _summaries() -> list:
    """Each GPU's GPU-test summary, gzipped or not."""
    return [p for d in GPU_DIRS for p in (d / "gpu_tests.json.gz", d / "gpu_tests.json")
            if p.exists()]


def _revisions(node) -> set[str]:
    """Every environment.git_revision in a recording, at any depth (a file may hold several
    sub-recordings, each with its environment)."""
    found = set()
    if isinstance(node, dict):
        env = node.get("environment")
        if isinstance(env, dict) and "git_revision" in env:
            found.add(str(env["git_revision"]))
        for v in node.values():
            found |= _revisions(v)
    elif isinstance(node, list):
        for v in node:
            found |= _revisions(v)
    return found


def _reference_revision() -> str | None:
    """The revision the GPU tests' summary names (the one at which pytest -m gpu passed), or,
    without one, the revision most recordings name."""
    summaries = {_rel(p): _revisions(read_json(p)) for p in _summaries()}
    named = {r for revs in summaries.values() for r in revs}
    if len(named) == 1:
        return named.pop()
    counts = Counter(r for p in RECORDINGS for r in _revisions(read_json(p)))
    return counts.most_common(1)[0][0] if counts else None


def _same(a: str, b: str) -> bool:
    # recordings store an abbreviated hash; two of different lengths agree on their prefix
    n = min(len(a), len(b))
    return n >= 7 and a[:n] == b[:n]


def test_one_gpu_test_summary_revision():
    summaries = {_rel(p): sorted(_revisions(read_json(p))) for p in _summaries()}
    assert summaries, "results/<gpu>/gpu_tests.json.gz: no GPU-test summary recorded"
    named = {r for revs in summaries.values() for r in revs}
    assert len(named) == 1, f"GPU-test summaries name several revisions: {summaries}"


# Recordings that name another revision than the GPU tests' summary until one `make gpu` on an
# H200 records every file at one revision (issue 44; a fresh H200 needs more than one 30-minute
# device budget for it today, see DESIGN.md). Each is an expected failure, strictly: once it is
# re-recorded its check passes, and it must leave this list.
AWAITING_RECORDING = {
    "results/h200/endtoend.json", "results/h200/first-call.json", "results/h200/models.json",
    "results/h200/primer.json", "results/h200/serving.json",
    "results/h200/stage1_chunk_cumsum.json", "results/h200/stage2_chunk_state.json",
    "results/h200/stage3_chunk_scan.json", "results/h200/tilegym_replayed.json",
    "results/compile/sm_90_resources.json",
}


def _awaiting(paths):
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason="not yet re-recorded "
                                                    "at the GPU tests' revision"))
            if _rel(p) in AWAITING_RECORDING else p for p in paths]


@pytest.mark.parametrize("path", _awaiting(RECORDINGS + [
    p for p in COMPILED if _revisions(read_json(p))]), ids=_rel)
def test_recording_revision(path):
    ref = _reference_revision()
    assert ref, "results/: no recording names a git revision"
    revs = _revisions(read_json(path))
    assert revs, f"{_rel(path)}: no environment.git_revision recorded"
    wrong = sorted(r for r in revs if not _same(r, ref))
    assert not wrong, (f"{_rel(path)}: environment.git_revision {', '.join(wrong)}, "
                       f"expected {ref} (that of results/<gpu>/gpu_tests.json.gz)")
