"""Shared pytest plumbing: skip GPU tests cleanly without a GPU, and record what GPU tests saw.

GPU tests append one row per checked quantity to the ``gpu_record`` fixture; at the end of a
session that ran any, the rows, the pass/fail counts, the worst error per dtype and the
environment go to ``results/<gpu>/gpu_tests.json`` (the run summary the Kernels issue asks
for, read back by notebook 08).
"""
import importlib.util
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_ROWS: list[dict] = []
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


def pytest_runtest_logreport(report):
    if report.when == "call" and "gpu" in report.keywords:
        _OUTCOMES[report.outcome] += 1
    elif report.when == "setup" and report.skipped and "gpu" in report.keywords:
        _OUTCOMES["skipped"] += 1


def pytest_sessionfinish(session, exitstatus):
    if not _ROWS:
        return
    from ssd.env import environment, gpu_slug, write_json

    env = environment()
    worst = {}
    for row in _ROWS:
        if row.get("rel_err") is not None and row.get("kind", "reference") == "reference":
            key = row["dtype"]
            worst[key] = max(worst.get(key, 0.0), row["rel_err"])
    summary = {
        "outcomes": dict(_OUTCOMES),
        "checks": len(_ROWS),
        "worst_rel_err_by_dtype": worst,
        "environment": env,
        "rows": _ROWS,
    }
    path = write_json(ROOT / "results" / gpu_slug(env) / "gpu_tests.json", summary)
    print(f"\n[gpu] {len(_ROWS)} checks, outcomes {dict(_OUTCOMES)}; summary written to {path}")
