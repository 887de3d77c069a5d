"""Shared pytest plumbing: skip GPU tests cleanly without a GPU, and record what GPU tests saw.

GPU tests append one row per checked quantity to the ``gpu_record`` fixture. Each test's rows
travel on its report (``user_properties``), and the process that logs the reports collects
them: the same process in a plain run, the controller under pytest-xdist (``pytest -m gpu -n 8``
compiles kernel variants in parallel; tileiras is single-threaded). At the end of a session that
ran any, the rows, the pass/fail counts, the worst error per dtype and the environment go to
``results/<gpu>/gpu_tests.json`` (the run summary the Kernels issue asks for, read back by
notebook 08).
"""
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_ROWS: list[dict] = []       # rows appended by the tests running in this process
_COLLECTED: list[dict] = []  # rows from every logged report (all workers' on the controller)
_OUTCOMES: Counter = Counter()


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


def pytest_runtest_logreport(report):
    if report.when == "call" and "gpu" in report.keywords:
        _OUTCOMES[report.outcome] += 1
    elif report.when == "setup" and report.skipped and "gpu" in report.keywords:
        _OUTCOMES["skipped"] += 1
    for key, rows in report.user_properties:
        if key == "gpu_rows":
            _COLLECTED.extend(rows)


def pytest_sessionfinish(session, exitstatus):
    if not _COLLECTED or hasattr(session.config, "workerinput"):  # xdist workers: controller writes
        return
    from ssd.env import environment, gpu_slug, write_json

    env = environment()
    worst = {}
    for row in _COLLECTED:
        if row.get("rel_err") is not None and row.get("kind", "reference") == "reference":
            key = row["dtype"]
            worst[key] = max(worst.get(key, 0.0), row["rel_err"])
    summary = {
        "outcomes": dict(_OUTCOMES),
        "checks": len(_COLLECTED),
        "worst_rel_err_by_dtype": worst,
        "environment": env,
        "rows": _COLLECTED,
    }
    path = write_json(ROOT / "results" / gpu_slug(env) / "gpu_tests.json", summary)
    print(f"\n[gpu] {len(_COLLECTED)} checks, outcomes {dict(_OUTCOMES)}; summary written to {path}")
