"""The GPU run's summary files, written by tests/conftest.py, checked on the CPU.

A GPU run cannot be repeated here, so the plumbing that turns test reports into
``results/<gpu>/gpu_tests.json``, ``gpu_mixer_tests.json`` and ``gpu_decode_tests.json`` is fed
fake reports: the rows
each test attached, pass/fail outcomes, the xdist controller's view (reports from several
workers), and a suite split over several commands (``--gpu-merge``). A fresh copy of the
conftest module stands for each pytest process and keeps this test's rows out of the real run.
"""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import ssd.tools.env
from ssd.tools.env import read_json

CONFTEST = Path(__file__).with_name("conftest.py")


def fresh(tmp_path, monkeypatch, revision="abc"):
    """A new copy of the conftest plumbing, as a pytest process loads it."""
    spec = importlib.util.spec_from_file_location("conftest_copy", CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    monkeypatch.setattr(ssd.tools.env, "environment",
                        lambda: {"gpu": "NVIDIA H200", "git_revision": revision})
    return module


@pytest.fixture
def plumbing(tmp_path, monkeypatch):
    return fresh(tmp_path, monkeypatch)


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
    finish(plumbing, merge=False)

    summary = read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")
    assert summary["outcomes"] == {"passed": 3, "failed": 1}
    assert summary["failed_tests"] == ["tests/m.py::two"]
    assert ssd.tools.env.unpack_rows(summary["rows"]) == [dict(kernel, file="tests/a.py")]
    assert summary["checks"] == 1 and summary["outcomes_by_file"] == {
        "tests/a.py": {"passed": 1}, "tests/m.py": {"passed": 1, "failed": 1},
        "tests/d.py": {"passed": 1}}
    assert summary["worst_rel_err_by_dtype"] == {"bfloat16": 2e-3}
    layer = read_json(tmp_path / "results" / "h200" / "gpu_mixer_tests.json.gz")
    assert [r["rel_err"] for r in ssd.tools.env.unpack_rows(layer["rows"])] == [1e-6, 1.0]
    assert layer["environment"]["gpu"] == "NVIDIA H200"
    step = read_json(tmp_path / "results" / "h200" / "gpu_decode_tests.json.gz")
    assert ssd.tools.env.unpack_rows(step["rows"]) == [dict(decode, file="tests/d.py")]


def finish(module, merge):
    """End the module's run as pytest does, with or without --gpu-merge."""
    config = SimpleNamespace(getoption={"--gpu-merge": merge}.__getitem__)
    module.pytest_sessionfinish(SimpleNamespace(config=config), 0)


def test_a_split_suite_merges_replacing_the_files_run_again(tmp_path, monkeypatch):
    """--gpu-merge: a second command's files join the first's summary; a file run again
    replaces what the summary held of it (rows, outcomes, failures); the worst error and the
    totals are those of what is kept."""
    row = dict(test="t", dtype="bfloat16", rel_err=1e-3)
    first = fresh(tmp_path, monkeypatch)
    first.pytest_runtest_logreport(report("tests/a.py::x", "passed", [row]))
    first.pytest_runtest_logreport(report("tests/b.py::y", "failed", [dict(row, rel_err=0.5)]))
    finish(first, merge=False)
    second = fresh(tmp_path, monkeypatch)
    second.pytest_runtest_logreport(report("tests/b.py::y", "passed", [dict(row, rel_err=2e-3)]))
    second.pytest_runtest_logreport(report("tests/c.py::z", "passed", [dict(row, rel_err=3e-4)]))
    finish(second, merge=True)
    summary = read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")
    assert summary["outcomes"] == {"passed": 3} and summary["failed_tests"] == []
    assert sorted(r["file"] for r in ssd.tools.env.unpack_rows(summary["rows"])) == [
        "tests/a.py", "tests/b.py", "tests/c.py"]
    assert summary["worst_rel_err_by_dtype"] == {"bfloat16": 2e-3} and summary["checks"] == 3
    third = fresh(tmp_path, monkeypatch)  # without --gpu-merge a run starts the summary anew
    third.pytest_runtest_logreport(report("tests/c.py::z", "passed", [row]))
    finish(third, merge=False)
    assert read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")["checks"] == 1


def test_merging_into_another_revision_is_refused(tmp_path, monkeypatch):
    first = fresh(tmp_path, monkeypatch, revision="abc")
    first.pytest_runtest_logreport(report("tests/a.py::x", "passed", [dict(dtype="float32")]))
    finish(first, merge=False)
    second = fresh(tmp_path, monkeypatch, revision="def")
    second.pytest_runtest_logreport(report("tests/b.py::y", "passed", [dict(dtype="float32")]))
    with pytest.raises(RuntimeError, match="another revision"):
        finish(second, merge=True)


def test_errors_and_crashed_workers_count_as_failures(plumbing, tmp_path):
    """A test whose setup raised, or whose xdist worker died under it, never sends a call
    report; it is a failure all the same, and a part whose every test failed so still writes."""
    error = SimpleNamespace(when="setup", keywords={"gpu": True}, outcome="failed", failed=True,
                            skipped=False, nodeid="tests/a.py::broken", user_properties=[])
    crash = SimpleNamespace(when="???", keywords={}, outcome="failed", failed=True,
                            skipped=False, nodeid="tests/b.py::killed", user_properties=[])
    for r in (error, crash):
        plumbing.pytest_runtest_logreport(r)
    finish(plumbing, merge=False)
    summary = read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")
    assert summary["outcomes"] == {"failed": 2}
    assert summary["failed_tests"] == ["tests/a.py::broken", "tests/b.py::killed"]


def test_a_new_recording_drops_the_files_of_another_revision(tmp_path, monkeypatch):
    """The first part of a recording (no --gpu-merge) removes summaries of another revision,
    so that a later part's --gpu-merge finds only its own recording's files."""
    decode = dict(record="decode", test="decode/layer", dtype="float16", rel_err=2e-4)
    old = fresh(tmp_path, monkeypatch, revision="abc")
    old.pytest_runtest_logreport(report("tests/d.py::one", "passed", [decode]))
    finish(old, merge=False)
    assert (tmp_path / "results" / "h200" / "gpu_decode_tests.json.gz").exists()
    new = fresh(tmp_path, monkeypatch, revision="def")
    new.pytest_runtest_logreport(report("tests/a.py::x", "passed", [dict(dtype="float32")]))
    finish(new, merge=False)
    assert not (tmp_path / "results" / "h200" / "gpu_decode_tests.json.gz").exists()
    part2 = fresh(tmp_path, monkeypatch, revision="def")
    part2.pytest_runtest_logreport(report("tests/d.py::one", "passed", [decode]))
    finish(part2, merge=True)  # merges, where the stale file would have been refused
    summary = read_json(tmp_path / "results" / "h200" / "gpu_tests.json.gz")
    assert summary["outcomes"] == {"passed": 2}


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


def test_every_gpu_test_file_is_in_one_gpu_check_part():
    """make gpu-check-1..4 name the test files they run (GPU_TESTS_1 ...): a file with GPU
    tests left out of every part would never be recorded, one in two parts twice."""
    import re

    root = CONFTEST.parent.parent
    text = (root / "Makefile").read_text().replace("\\\n", " ")
    parts = re.findall(r"^GPU_TESTS_\d+\s*\?=(.*)$", text, re.MULTILINE)
    named = [f for part in parts for f in part.split()]
    marked = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)", re.MULTILINE)
    with_gpu = sorted(f"tests/{p.name}" for p in CONFTEST.parent.glob("test_*.py")
                      if marked.search(p.read_text()))
    assert sorted(named) == with_gpu
    assert len(parts) == 4 and all(f"gpu-check-{i}" in text for i in range(1, 5))


def test_gpu_smoke_runs_every_tool_of_make_gpu():
    """make gpu-smoke is there to fail before a recording would: it must run each tool (and
    each subcommand of ssd.tools.train) that a part of make gpu runs, but the GPU tests, the
    doctor and the chapters, which are parts of their own."""
    import re

    from ssd.book.reproduce import make_targets

    targets = make_targets((CONFTEST.parent.parent / "Makefile").read_text())

    def tools(commands):
        found = set()
        for cmd in commands:
            m = re.search(r"-m (ssd\.tools\.\w+)(?: (mqar|step)\b)?", cmd)
            if m:
                found.add(" ".join(filter(None, m.groups())))
        return found

    parts = targets["gpu"][0]
    assert len(parts) == 22
    recorded = tools(cmd for part in parts for cmd in targets[part][1])
    assert {"ssd.tools.bench", "ssd.tools.backward_bench", "ssd.tools.train step"} <= recorded
    assert tools(targets["gpu-smoke"][1]) >= recorded
