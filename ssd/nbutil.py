"""Helpers for the GPU chapters: run live on a GPU, replay the recorded run elsewhere.

A GPU chapter computes its numbers with :func:`live_or_recorded`: on a machine with an NVIDIA
GPU and cuTile it runs the measurement, stores the result (with the environment record) as
``results/<gpu>/<name>.json`` and returns it; on any other machine (CI, a laptop) it loads the
recorded file and says so. Either way the cells after it draw tables and plots from the same
dictionary, so the book always shows numbers from a real GPU run, never typed-in ones.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from .config import SMALL_STATE, FusedScanConfig, fused_scan_fills
from .env import ROOT, environment, gpu_slug, write_json

RESULTS = ROOT / "results"
DEFAULT_GPU = "h200"  # where the book's recorded results come from


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when torch sees a CUDA GPU and cuda.tile imports (the GPU chapters can run live)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cuda.tile  # noqa: F401
    except Exception:
        return False
    return True


def result_path(name: str, gpu: str | None = None) -> Path:
    return RESULTS / (gpu or DEFAULT_GPU) / f"{name}.json"


def load_recorded(name: str, gpu: str | None = None) -> dict:
    """The recording ``results/<gpu>/<name>.json``: by default this machine's GPU's own
    recording when it has one, else the book's (``DEFAULT_GPU``)."""
    if gpu is None and gpu_available():
        import torch

        slug = gpu_slug({"gpu": torch.cuda.get_device_name()})
        gpu = slug if result_path(name, slug).is_file() else None
    path = result_path(name, gpu)
    if not path.is_file():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise FileNotFoundError(f"{shown}: no recorded result; run this chapter "
                                "on a GPU once (see the Reproducibility chapter)")
    return json.loads(path.read_text())


def load_recorded_at(name: str, rev: str, gpu: str | None = None, paths=None, same=None) -> dict:
    """The recording ``name`` of the code at git revision ``rev``: the current file when it was
    made at ``rev`` or at a revision whose measured code is the same (:func:`same_code` over
    ``paths``, default :data:`MEASURED_CODE`; or ``same(its revision, rev)``, :func:`same_kernels`
    say), else a run kept under ``previous/`` (as ``<name>-<its revision>.json``, when a later run
    replaced it) that is of such a revision, so that a chapter can set files of the same code side
    by side."""
    same = same or functools.partial(same_code, paths=paths or MEASURED_CODE)
    current = load_recorded(name, gpu)
    if same(current["environment"]["git_revision"], rev):
        return current
    pattern = result_path(f"previous/{name}-???????", gpu)  # <name>-<7 hex digits>.json
    for path in sorted(pattern.parent.glob(pattern.name),
                       key=lambda p: not p.stem.endswith(rev[:7])):  # rev's own run first
        run = json.loads(path.read_text())
        if same(run["environment"]["git_revision"], rev):
            return run
    raise FileNotFoundError(f"{name}: the recording is of {current['environment']['git_revision']} "
                            f"and no run kept under previous/ is of code the same as at {rev}")


#: git pathspecs of the code a recording measures: the ``ssd`` package (kernels, launchers,
#: benchmark and end-to-end harnesses) without the modules that only render the chapters, the
#: one that only writes the record (``env``: the environment fields and the JSON layout) and the
#: CPU compile harness (``aot``: it exports cubins and reads their resources and SASS on a
#: machine without a GPU; no GPU recording imports it, the kernels it compiles live elsewhere).
#: ``ssd/_tile_stream.py``, a benchmark ceiling kernel from stop 28 until stop 29 found that it
#: bounded nothing, stays excluded so that the revisions that had it compare with those without.
MEASURED_CODE = ("ssd", ":(exclude)ssd/nbutil.py", ":(exclude)ssd/nbfig.py",
                 ":(exclude)ssd/notebooks.py", ":(exclude)ssd/env.py", ":(exclude)ssd/aot.py",
                 ":(exclude)ssd/_tile_stream.py")
#: the kernels, their launchers, the API and the layer: :data:`MEASURED_CODE` without the
#: benchmark harness and the peers' adapters, which change when a harness option is added (a
#: TileGym replay, say) while the code a recording times stays the same.
KERNEL_CODE = (*MEASURED_CODE, ":(exclude)ssd/bench.py", ":(exclude)ssd/peers.py")


def same_code(*revisions, paths=MEASURED_CODE, root: Path = ROOT) -> bool | None:
    """Whether ``paths`` (git pathspecs; default :data:`MEASURED_CODE`) hold the same code at the
    given git revisions, as recorded in the files' ``git_revision``: True or False where the
    checkout's git knows them all, None where it cannot tell (no git, an unknown revision, a
    revision marked ``-dirty``). Recordings made at different revisions time the same code when
    this is True. A Python file whose changes are only comments, docstrings and layout counts as
    the same (its syntax tree without docstrings is unchanged): a corrected comment does not make
    the recordings of the code around it stale."""
    revs = list(dict.fromkeys(revisions))
    if len(revs) == 1 and revs[0] is not None:
        return True
    if any(r is None or r.endswith("-dirty") for r in revs):
        return None
    git = functools.partial(_git, root)
    try:
        for rev in revs[1:]:
            for path in git("diff", "--name-only", revs[0], rev, "--", *paths).splitlines():
                if not path.endswith(".py"):
                    return False
                try:
                    trees = [_code_of(git("show", f"{r}:{path}")) for r in (revs[0], rev)]
                except LookupError:  # added or removed
                    return False
                if trees[0] != trees[1]:
                    return False
    except (OSError, subprocess.SubprocessError, LookupError):
        return _same_by_digest(revs, paths)
    return True


#: Commits that changed :data:`KERNEL_CODE` but no kernel the GPU runs once its tuned builds are
#: ready: every kernel's TileIR is the same before and after (tests/test_nbutil_kernels.py compiles
#: the forward's kernels at both revisions and compares them), so a steady-state time recorded
#: before one is a time of the kernels after it (:func:`same_kernels`). {commit: what it changed}
SAME_KERNELS = {"e81deae": "chunk_scan's quick first call (ssd._tiered): launch code only",
                "fa1cf03": "the quick first call keyed per launch, not per kernel",
                "b2819b5": "the quick first call's QuickFirst made once per tuned build",
                "0ec89c1": "the fused-walk prototype (ssd/fused_walk.py), which no forward imports"}

#: Commits that changed the kernels of some problem shapes only, a default rule of
#: :mod:`ssd.config` say: {commit: (what it changed, the shapes whose kernels it changed, a
#: predicate on a shape's dims (b, l, h, p, n, g))}. A steady-state recording of other shapes
#: outlives one (:func:`same_kernels` given the recording's ``dims``). tests/test_nbutil_kernels.py
#: builds the forward's kernels per shape before and after each, and checks that every shape the
#: predicate leaves out keeps its kernels and that the shapes it names do change.
SHAPE_KERNELS: dict = {
    "23e5cbd": ("small states at chunk 128 and 256 (config.SMALL_STATE_AT)",
                [(16, 1024, 32, 64, 64, 1)], lambda dims: dims[4] <= SMALL_STATE),
    # on the H200's 132 SMs, where the recordings are made
    "57ba209": ("stages 2 and 3 in one kernel at chunk 64 where its grid fills the GPU "
                "(config.fused_scan_fills)",
                [(8, 2048, 24, 64, 128, 1), (2, 8192, 128, 64, 128, 8), (16, 1024, 32, 64, 64, 1)],
                lambda dims: fused_scan_fills(FusedScanConfig(), (dims[0], *dims[2:5]), 132))}


def same_kernels(*revisions, root: Path = ROOT, dims=None) -> bool | None:
    """Whether recordings at these git revisions time the same kernels in steady state:
    :func:`same_code` over :data:`KERNEL_CODE`, or else every commit between two of them that
    changed it either changed only comments and docstrings or is one of :data:`SAME_KERNELS`,
    or, given the recordings' ``dims`` (an iterable of (b, l, h, p, n, g)), one of
    :data:`SHAPE_KERNELS` that changed none of those shapes.
    (A first call can differ: chunk_scan's quick build, ``ssd._tiered``, is such a commit.) None
    where git cannot tell."""
    same = same_code(*revisions, paths=KERNEL_CODE, root=root)
    if same is True:
        return True
    revs = list(dict.fromkeys(revisions))
    dims = None if dims is None else [tuple(d) for d in dims]
    if not all(known_revision(r, root) for r in revs):  # no git here: the digests' answer
        if any(r is None or r.endswith("-dirty") for r in revs):
            return None
        same = _same_by_digest(revs, KERNELS_KEY)
        shaped = _shape_commits_by_digest(revs)
        if same is not True or shaped is None:
            return same if same is not True else None
        between = set.union(*shaped) - set.intersection(*shaped)
        return not any(_changes_shapes(c, dims) for c in between)
    if same is None:
        return None
    return not any(_changes_kernels(c, root, dims)
                   for rev in revs[1:] for c in _kernel_commits(f"{revs[0]}...{rev}", root))


def _kernel_commits(revs: str, root: Path) -> list[str]:
    """The commits of the git revision or range ``revs`` that touched :data:`KERNEL_CODE`, newest
    first, merges left out: a merge brings the commits of both sides, which the log lists
    themselves, and against its first parent it would show the other side's as its own change."""
    return _git(root, "log", "--no-merges", "--format=%H", revs, "--", *KERNEL_CODE).split()


def _changes_kernels(commit: str, root: Path, dims=None) -> bool:
    """Whether ``commit`` (one that touched KERNEL_CODE) changed a kernel of the shapes ``dims``
    (None: of any shape): it is not one of :data:`SAME_KERNELS`, nor one of
    :data:`SHAPE_KERNELS` that left those shapes alone, and did more than comments and
    docstrings."""
    shaped = _listed(commit, SHAPE_KERNELS)
    return (_listed(commit, SAME_KERNELS) is None
            and (shaped is None or _changes_shapes(shaped, dims))
            and same_code(f"{commit}^", commit, paths=KERNEL_CODE, root=root) is not True)


def _listed(commit: str, table: dict) -> str | None:
    """The key of ``table`` (:data:`SAME_KERNELS`, :data:`SHAPE_KERNELS`: short hashes) that
    names the full hash ``commit``, or None."""
    return next((c for c in table if commit.startswith(c)), None)


def _changes_shapes(commit: str, dims) -> bool:
    """Whether the :data:`SHAPE_KERNELS` commit ``commit`` changed a kernel of a shape in ``dims``
    (every shape where ``dims`` is None)."""
    changed = SHAPE_KERNELS[commit][2]
    return dims is None or any(changed(d) for d in dims)


def shape_commits(rev: str, root: Path = ROOT) -> list[str]:
    """The :data:`SHAPE_KERNELS` commits in the history of ``rev`` (for :data:`CODE_DIGESTS`:
    without git, two revisions differ by those in one history and not the other)."""
    def ancestor(commit):
        try:
            _git(root, "merge-base", "--is-ancestor", commit, rev)
        except LookupError:  # not an ancestor (git's status 1), or unknown here
            return False
        return True

    return [c for c in SHAPE_KERNELS if ancestor(c)]


def kernels_digest(rev: str, root: Path = ROOT) -> str:
    """The :func:`code_digest` of :data:`KERNEL_CODE` at the newest commit up to ``rev`` that
    changed a kernel (one that changed KERNEL_CODE, neither listed in :data:`SAME_KERNELS` nor
    of comments and docstrings only; a :data:`SHAPE_KERNELS` commit counts as none here, and
    :func:`shape_commits` tells revisions on either side of one apart): two revisions of one line
    of history have one such digest exactly where :func:`same_kernels` finds them the same (for
    every shape), so that a machine without git can answer it from :data:`CODE_DIGESTS`."""
    for commit in _kernel_commits(rev, root):
        # a SHAPE_KERNELS commit is told apart by shape_commits instead
        if _listed(commit, SHAPE_KERNELS) is None and _changes_kernels(commit, root):
            return code_digest(commit, KERNEL_CODE, root)
    return code_digest(rev, KERNEL_CODE, root)


#: ``results/code_digests.json``: for each git revision the recordings name, a digest of the
#: code :func:`same_code` compares (:func:`code_digest`), so that it can answer where git
#: cannot: a GPU machine handed the working tree without its history, a copy without ``.git``.
#: ``python -m ssd.nbutil`` refreshes it after new recordings (a CPU test checks it covers them).
CODE_DIGESTS = RESULTS / "code_digests.json"
DIGEST_KEYS = {MEASURED_CODE: "measured", KERNEL_CODE: "kernel"}
KERNELS_KEY = "kernels"  # the table of :func:`kernels_digest`
SHAPE_COMMITS_KEY = "shape_commits"  # the table of :func:`shape_commits`
_EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"  # git's empty tree


def code_digest(rev: str, paths=MEASURED_CODE, root: Path = ROOT) -> str:
    """sha256 over the files ``paths`` select at git revision ``rev``: each file's path and its
    syntax tree without docstrings (Python; :func:`_code_of`) or its text, so that two revisions
    have one digest exactly where :func:`same_code` finds them the same (with one Python: the
    tree's text is the running interpreter's ``ast.dump``)."""
    git = functools.partial(_git, root)
    digest = hashlib.sha256()
    for path in sorted(git("diff", "--name-only", _EMPTY_TREE, rev, "--", *paths).splitlines()):
        source = git("show", f"{rev}:{path}")
        digest.update(f"{path}\0{_code_of(source) if path.endswith('.py') else source}\0".encode())
    return digest.hexdigest()


def _same_by_digest(revs, paths) -> bool | None:
    """:func:`same_code` from :data:`CODE_DIGESTS` (``paths``; or :data:`KERNELS_KEY`, for
    :func:`same_kernels`): None unless every revision (a recorded one, or a unique prefix of one)
    has a digest there."""
    key = paths if paths == KERNELS_KEY else DIGEST_KEYS.get(tuple(paths))
    if key is None or not CODE_DIGESTS.is_file():
        return None
    table = json.loads(CODE_DIGESTS.read_text()).get("digests", {}).get(key, {})
    digests = []
    for rev in revs:
        found = [d for r, d in table.items() if r.startswith(rev)]
        if len(found) != 1:
            return None
        digests.append(found[0])
    return len(set(digests)) == 1


def _shape_commits_by_digest(revs) -> list[set] | None:
    """Each revision's :func:`shape_commits` from :data:`CODE_DIGESTS` (a recorded revision, or
    a unique prefix of one); None unless every revision is there."""
    if not CODE_DIGESTS.is_file():
        return None
    table = json.loads(CODE_DIGESTS.read_text()).get(SHAPE_COMMITS_KEY)
    if table is None:  # a table from before SHAPE_KERNELS: none of its revisions has one
        return [set() for _ in revs]
    found = []
    for rev in revs:
        hits = [set(v) for r, v in table.items() if r.startswith(rev)]
        if len(hits) != 1:
            return None
        found.append(hits[0])
    return found


def recorded_revisions(results: Path = RESULTS) -> list[str]:
    """Every ``git_revision`` the recordings under ``results`` name (at any depth of a file),
    but those of a tree with uncommitted changes (``-dirty``)."""
    found = set()

    def walk(node):
        if isinstance(node, dict):
            rev = node.get("git_revision")
            if isinstance(rev, str) and rev and not rev.endswith("-dirty"):
                found.add(rev)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for path in results.rglob("*.json"):
        if path != CODE_DIGESTS:
            walk(json.loads(path.read_text()))
    return sorted(found)


def known_revision(rev: str, root: Path = ROOT) -> bool:
    """Whether this checkout's git has commit ``rev`` (a screening branch's may be gone)."""
    try:
        _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except (OSError, subprocess.SubprocessError, LookupError):
        return False
    return True


def write_code_digests(root: Path = ROOT, extra=()) -> dict:
    """Compute :data:`CODE_DIGESTS` from git for every recorded revision it knows, and for the
    ``extra`` ones, and write it. An extra revision is the one a GPU call is about to record at
    (``python -m ssd.nbutil $(cat .revision)``, the table left uncommitted): the call's checkout
    has no git, and without the digest of its own revision a chapter executed there cannot tell
    whether its new recordings time the same code as older ones (same_code answers None)."""
    for rev in extra:
        if not known_revision(rev, root):
            raise ValueError(f"{rev!r}: not a commit of this checkout")
    revs = list(dict.fromkeys([*(rev for rev in recorded_revisions() if known_revision(rev, root)),
                               *extra]))
    table = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}",
             "paths": {key: list(paths) for paths, key in DIGEST_KEYS.items()},
             "digests": {key: {rev: code_digest(rev, paths, root) for rev in revs}
                         for paths, key in DIGEST_KEYS.items()}}
    table["digests"][KERNELS_KEY] = {rev: kernels_digest(rev, root) for rev in revs}
    table[SHAPE_COMMITS_KEY] = {rev: shape_commits(rev, root) for rev in revs}
    write_json(CODE_DIGESTS, table)
    return table


def same_function(path: str, name: str, *revisions, root: Path = ROOT) -> bool | None:
    """Whether the module-level function ``name`` of the file ``path`` has the same code
    (docstrings aside, as in :func:`same_code`) at the given git revisions: True, False, or
    None where git cannot tell. For a harness file that changed around a function a chapter
    relies on (the benchmark's timer, say)."""
    revs = list(dict.fromkeys(revisions))
    if any(r is None or r.endswith("-dirty") for r in revs):
        return None
    codes = set()
    for rev in revs:
        if not known_revision(rev, root):
            return None  # no git here, or a revision it does not have
        try:
            found = [node for node in ast.parse(_git(root, "show", f"{rev}:{path}")).body
                     if isinstance(node, ast.FunctionDef) and node.name == name]
        except LookupError:  # the file is absent at that revision
            found = []
        except (OSError, subprocess.SubprocessError):
            return None
        codes.add(_code_of(ast.unparse(found[0])) if found else None)
    return len(codes) == 1 and None not in codes


def _git(root: Path, *args) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30)
    if out.returncode:  # not a git checkout, or a revision it does not have
        raise LookupError(out.stderr)
    return out.stdout


def _code_of(source: str) -> str:
    """The syntax tree of Python ``source`` without docstrings, as a comparable string."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def same_code_word(result: bool | None) -> str:
    """How a chapter prints a :func:`same_code` result."""
    return {True: "yes (git: at most comments and docstrings differ)", False: "NO",
            None: "not checkable here (no git history)"}[result]


def same_kernels_word(result: bool | None) -> str:
    """How a chapter prints a :func:`same_kernels` result."""
    return {True: "yes (git: the same kernel code, or only commits between that change no kernel "
                  "of these shapes: ssd.nbutil.SAME_KERNELS, SHAPE_KERNELS)", False: "NO",
            None: "not checkable here (no git history)"}[result]


def live_or_recorded(name: str, measure, *, force_recorded: bool = False) -> dict:
    """Run ``measure()`` (-> JSON-able dict) on a GPU and record it, else load the recording.

    The returned dict always has ``environment`` (where the numbers were measured) and
    ``source`` ("live" or "recorded").
    """
    if gpu_available() and not force_recorded:
        payload = dict(measure())
        payload["environment"] = environment()
        write_json(result_path(name, gpu_slug(payload["environment"])), payload)
        payload["source"] = "live"
        print(f"Measured live on {payload['environment'].get('gpu')}; "
              f"recorded to results/{gpu_slug(payload['environment'])}/{name}.json")
        return payload
    payload = load_recorded(name)
    payload["source"] = "recorded"
    env = payload.get("environment", {})
    print(f"No GPU here: showing the run recorded on {env.get('gpu')} ({env.get('date')}, "
          f"git {env.get('git_revision')}) from results/{DEFAULT_GPU}/{name}.json")
    return payload


def glue(name: str, value, display: bool = True) -> None:
    """``myst_nb.glue`` without importing myst_nb (the GPU machine has no Sphinx stack).

    Emits the same display output myst_nb's glue does (a mimebundle tagged with
    ``metadata["scrapbook"]``), which the book build reads from the stored notebook. A string is
    pasted as its repr, so it may hold no markup (backticks) and no apostrophe, which would make
    the repr's quotes double and visible in the text. A NumPy scalar is stored as the Python
    number it holds: its repr (``np.float64(...)``) is not a number the book can format.
    """
    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str) and ("'" in value or "`" in value):
        raise ValueError(f"glue {name!r}: a glued string renders as plain text in its repr; "
                         f"drop the apostrophe or backtick from {value!r}")
    import IPython
    from IPython.display import display as ipy_display

    bundle, metadata = IPython.core.formatters.format_display_data(value)
    prefix = "" if display else "application/papermill.record/"
    metadata["scrapbook"] = dict(name=name, mime_prefix=prefix)
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


if __name__ == "__main__":
    written = write_code_digests(extra=sys.argv[1:])
    print(f"{CODE_DIGESTS.relative_to(ROOT)}: {len(next(iter(written['digests'].values())))} "
          f"revisions, {len(written['digests'])} path sets")
