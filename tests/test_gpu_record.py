"""The GPU run's summary files, written by tests/conftest.py, checked on the CPU.

A GPU run cannot be repeated here, so the plumbing that turns test reports into
``results/<gpu>/gpu_tests.json``, ``gpu_mixer_tests.json`` and ``gpu_decode_tests.json`` is fed
fake reports: the rows
each test attached, pass/fail outcomes, the xdist controller's view (reports from several
workers). A fresh copy of the conftest module keeps this test's rows out of the real test run.
"""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import ssd.tools.env
from ssd.tools.env import read_json

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.fixture
def plumbing(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("conftest_copy", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(ssd.tools.env, "environment", lambda: {"gpu": "NVIDIA H200", "date": "d"})
    return module


def report(nodeid, outcome, rows):
    return SimpleNamespace(when="call", keywords={"gpu": True}, outcome=outcome,
                           failed=outcome == "failed", skipped=False, nodeid=nodeid,
                           user_properties=[("gpu_rows", rows)] if rows else [])


def test_rows_from_every_worker_are_split_into_their_files(plumbing, tmp_path):
    kernel = dict(test="chunk_scan", dtype="bfloat16", rel_err=2e-3, tol=1.5e-2)
    mixer = dict(record="mixer", test="mixer-cutile-vs-torch", dtype="float32", rel_err=1e-6)
    decode = dict(record="decode", test="decode/layer", dtype="float16", rel_err=2e-4)
    # Reports as the controller logs them: two tests from one worker, two from another.
    plumbing.pytest_runtest_logreport(report("tests/a.py::k", "passed", [kernel]))
    plumbing.pytest_runtest_logreport(report("tests/m.py::one", "passed", [mixer]))
    plumbing.pytest_runtest_logreport(report("tests/m.py::two", "failed", [dict(mixer, rel_err=1.0)]))
    plumbing.pytest_runtest_logreport(report("tests/d.py::one", "passed", [decode]))
    plumbing.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()), 1)

    summary = read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")
    assert summary["outcomes"] == {"passed": 3, "failed": 1}
    assert summary["failed_tests"] == ["tests/m.py::two"]
    assert ssd.tools.env.unpack_rows(summary["rows"]) == [kernel] and summary["checks"] == 1
    assert summary["worst_rel_err_by_dtype"] == {"bfloat16": 2e-3}
    layer = read_json(tmp_path / "results" / "h200" / "gpu_mixer_tests.json.gz")
    assert [r["rel_err"] for r in ssd.tools.env.unpack_rows(layer["rows"])] == [1e-6, 1.0]
    assert layer["environment"]["gpu"] == "NVIDIA H200"
    step = read_json(tmp_path / "results" / "h200" / "gpu_decode_tests.json.gz")
    assert ssd.tools.env.unpack_rows(step["rows"]) == [decode]


def test_an_xdist_worker_writes_nothing(plumbing, tmp_path):
    plumbing.pytest_runtest_logreport(report("tests/a.py::k", "passed", [dict(dtype="float32")]))
    worker = SimpleNamespace(config=SimpleNamespace(workerinput={"workerid": "gw0"}))
    plumbing.pytest_sessionfinish(worker, 0)
    assert not (tmp_path / "results").exists()


def test_packed_rows_come_back_as_written_to_four_digits():
    rows = [dict(test="a", rel_err=1.23456789e-3, dims=[2, 80]), dict(test="b", kind="peer"),
            dict(test="c", rel_err=None, dims=None)]
    table = ssd.tools.env.pack_rows(rows)
    assert [t["columns"] for t in table] == [["test", "rel_err", "dims"], ["test", "kind"]]
    assert ssd.tools.env.is_packed(table) and not ssd.tools.env.is_packed(rows)
    back = ssd.tools.env.unpack_rows(json.loads(json.dumps(table)))
    assert back == [dict(test="a", rel_err=1.235e-3, dims=[2, 80]),
                    dict(test="c", rel_err=None, dims=None), dict(test="b", kind="peer")]
