"""Shared pytest plumbing: skip GPU tests cleanly without a GPU, and record what GPU tests saw.

GPU tests append one row per checked quantity to the ``gpu_record`` fixture. Each test's rows
travel on its report (``user_properties``), and the process that logs the reports collects
them: the same process in a plain run, the controller under pytest-xdist (``pytest -m gpu -n 8``
compiles kernel variants in parallel; tileiras is single-threaded). At the end of a run that
ran any, the rows, the pass/fail counts, the worst error per dtype and the environment go to
``results/<gpu>/gpu_tests.json.gz`` (the run summary the Kernels issue asks for, read back by
notebook 08), with the ids of any failed tests. Rows tagged ``record=NAME`` go to
``results/<gpu>/gpu_NAME_tests.json.gz`` instead: ``mixer``, the whole-layer checks of
tests/test_mamba2.py, and ``decode``, the decode step's of tests/test_gpu_decode.py, which have
no per-stage tolerance for notebook 08 to check them against. A run with injected faults
(``SSD_INJECT_FAULT``, see ssd.validate) writes its summary to ``results/<gpu>/gpu_faults.json.gz``
(how often each fault was put in, visible and caught by each criterion, per test family, and
the rows of any visible fault that was missed) and leaves the other files as they are. Each
row names its test file; with ``--gpu-merge`` a run replaces what the summaries recorded at
the same revision on the same GPU held of its test files and keeps the rest, so that a suite
too long for one command is recorded by several (``make gpu-check-1`` ...).
"""
import importlib.util
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

# The GPU tests check the tuned kernels: chunk_scan's quick first-call build (ssd.launch) would
# stand in for them on each kernel's first launch. One test turns it back on and checks it.
os.environ.setdefault("SSD_QUICK_FIRST_CALL", "0")

ROOT = Path(__file__).resolve().parent.parent
_ROWS: list[dict] = []       # rows appended by the tests running in this process
_COLLECTED: list[dict] = []  # rows from every logged report (all workers' on the controller)
_OUTCOMES: dict[str, Counter] = {}  # test file -> outcome -> count
_FAILED: list[str] = []      # node ids of failed GPU tests


def pytest_addoption(parser):
    parser.addoption("--gpu-merge", action="store_true",
                     help="merge this run's GPU summaries into those recorded at this revision on "
                          "this GPU, replacing what they held of the test files run here (a suite "
                          "split over several commands, each within a time limit)")


def _gpu_missing() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("cuda.tile") is None:
        return "cuda-tile is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    reason = _gpu_missing()
    if reason:
        skip = pytest.mark.skip(reason=f"GPU test: {reason}")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def torch_ops():
    """A context manager class: inside ``with torch_ops() as ops``, ``ops.names`` lists the name
    of every torch operator that runs (on a GPU each would be a launch of its own), and
    ``ops.shapes`` the shape of each one's (first) tensor output, or None."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names, self.shapes = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            first = out[0] if isinstance(out, (tuple, list)) and out else out
            self.names.append(func.__name__)
            self.shapes.append(tuple(first.shape) if isinstance(first, torch.Tensor) else None)
            return out

    return Ops


@pytest.fixture
def git(tmp_path):
    """A new git repository in ``tmp_path`` (branch main): ``git(*args)`` runs git there and
    returns its stripped stdout (the tests of ssd.book.recordings's revision comparisons)."""
    import subprocess

    def run(*args):
        done = subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    run("init", "-q", "-b", "main")
    return run


@pytest.fixture(scope="session")
def gpu_record():
    """Append dicts (test, stage, dtype, rel_err, tol, ...) describing each GPU check."""
    return _ROWS


_NEW_ROWS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Take the rows the test body appends (they leave with its report, see below)."""
    before = len(_ROWS)
    yield
    item.stash[_NEW_ROWS] = _ROWS[before:]
    del _ROWS[before:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the test's rows to its call report: the one thing xdist workers send back."""
    outcome = yield
    if call.when == "call" and item.stash.get(_NEW_ROWS, None):
        outcome.get_result().user_properties.append(("gpu_rows", item.stash[_NEW_ROWS]))


def pytest_runtest_teardown(item, nextitem):
    """Hand a GPU test's cached memory back to the driver. Under xdist every worker's PyTorch
    keeps the blocks of the largest test it ran; sixteen such caches filled an 80 GB card and
    the next large test ran out of memory."""
    if "gpu" in item.keywords and "torch" in sys.modules:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::")[0]
    if report.when == "call" and "gpu" in report.keywords:
        _OUTCOMES.setdefault(file, Counter())[report.outcome] += 1
        if report.failed:
            _FAILED.append(report.nodeid)
    elif report.when == "setup" and report.skipped and "gpu" in report.keywords:
        _OUTCOMES.setdefault(file, Counter())["skipped"] += 1
    # A test that never reached its call failed all the same: an error in its setup, or its
    # xdist worker crashed under it (that report has when "???" and no keywords).
    elif report.failed and ((report.when == "setup" and "gpu" in report.keywords)
                            or report.when == "???"):
        _OUTCOMES.setdefault(file, Counter())["failed"] += 1
        _FAILED.append(report.nodeid)
    for key, rows in report.user_properties:
        if key == "gpu_rows":
            _COLLECTED.extend(dict(row, file=file) for row in rows)


def faults_caught(rows: list[dict]) -> dict:
    """Per injected fault (rows of kind "fault"): how often it was put in where the problem can
    show it, how often it was visible at the dtype's precision, and how often each criterion
    caught a visible one."""
    out = {}
    for row in rows:
        if not row.get("applicable"):
            continue
        n = out.setdefault(row["fault"], dict(injected=0, visible=0, caught_elem=0, caught_norm=0))
        n["injected"] += 1
        if row.get("visible"):
            n["visible"] += 1
            n["caught_elem"] += bool(row["caught_elem"])
            n["caught_norm"] += bool(row["caught_norm"])
    return out


def pytest_sessionfinish(session, exitstatus):
    # xdist workers write nothing (the controller does), nor does a run with no GPU check
    if not (_COLLECTED or _FAILED) or hasattr(session.config, "workerinput"):
        return
    from ssd.tools.env import environment, gpu_slug, pack_rows, read_json, unpack_rows, write_json
    from ssd.validate import requested_faults

    env = environment()
    if env.get("gpu") is None:  # a crashed worker of a CPU run: nothing to record
        return
    folder = ROOT / "results" / gpu_slug(env)
    merge = session.config.getoption("--gpu-merge")

    def another_recording(record):  # made at another revision or on another GPU
        return any(record["environment"].get(k) != env.get(k) for k in ("git_revision", "gpu"))

    def kept(path):  # what a recording there holds of test files this run did not run
        if not merge or not path.exists():
            return {}
        old = read_json(path)
        if another_recording(old):
            raise RuntimeError(f"--gpu-merge: {path} was recorded at another revision or on "
                               "another GPU; run its test files again without --gpu-merge")
        return dict(old, rows=[r for r in unpack_rows(old["rows"]) if r.get("file") not in
                               _OUTCOMES])

    faults = requested_faults()
    if not merge and not faults:  # a recording starts anew: no file of another one stays beside it
        for path in folder.glob("gpu_*_tests.json.gz"):
            if another_recording(read_json(path)):
                path.unlink()
    tests = folder / ("gpu_faults.json.gz" if faults else "gpu_tests.json.gz")
    old = {} if faults else kept(tests)
    # this run's files replace what the recording held of them
    outcomes = {**old.get("outcomes_by_file", {}), **{f: dict(c) for f, c in _OUTCOMES.items()}}
    failed = sorted([t for t in old.get("failed_tests", []) if t.split("::")[0] not in _OUTCOMES]
                    + _FAILED)
    total = dict(sum((Counter(c) for c in outcomes.values()), Counter()))
    # packed (4 significant digits), and the summary computed from what is written
    rows = old.get("rows", []) + unpack_rows(pack_rows(
        [r for r in _COLLECTED if not r.get("record")]))
    records = {}  # record name -> its rows
    for r in _COLLECTED:
        if r.get("record"):
            records.setdefault(r["record"], []).append(r)
    worst, worst_elem = {}, {}
    for row in rows:
        if row.get("rel_err") is not None and row.get("kind", "reference") == "reference":
            key = row["dtype"]
            worst[key] = max(worst.get(key, 0.0), row["rel_err"])
            if row.get("elem_ratio") is not None:
                worst_elem[key] = max(worst_elem.get(key, 0.0), row["elem_ratio"])
    fault_rows = [r for r in rows if r.get("kind") == "fault"]
    summary = {
        "outcomes": total,
        "outcomes_by_file": outcomes,
        "failed_tests": failed,
        "checks": len(rows),
        "worst_rel_err_by_dtype": worst,
        **({"worst_elem_ratio_by_dtype": worst_elem} if worst_elem else {}),
        **({"faults_caught": faults_caught(fault_rows)} if fault_rows else {}),
        "environment": env,
        "rows": pack_rows(rows),
    }
    if faults:
        # Every problem of the suite with every fault: counts per fault and per test family
        # (the rows would be thousands), and the rows of any visible fault that was missed.
        missed = [r for r in fault_rows if r.get("visible") and not r.get("caught_elem")]
        summary = {"faults": list(faults), "outcomes": total, "failed_tests": failed,
                   "faults_caught": faults_caught(fault_rows),
                   "faults_caught_by_family": {
                       family: faults_caught([r for r in fault_rows
                                              if r["test"].split("/")[0] == family])
                       for family in sorted({r["test"].split("/")[0] for r in fault_rows})},
                   "missed": pack_rows(missed), "environment": env}
    path = write_json(tests, summary)
    print(f"\n[gpu] {len(rows)} checks, outcomes {total}; summary written to {path}")
    for name, new in records.items() if not faults else ():
        path = folder / f"gpu_{name}_tests.json.gz"
        all_rows = kept(path).get("rows", []) + new
        write_json(path, dict(environment=env, rows=pack_rows(all_rows)))
        print(f"[gpu] {len(all_rows)} {name} checks written to {path}")
