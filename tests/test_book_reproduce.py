"""ssd.book.reproduce: the Makefile read as a plan of commands and the recordings they write, the
environment table over the recorded files, and the variation tables against the raw records."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")

from ssd.book import reproduce as rp  # noqa: E402
from ssd.tools.bench import speedups  # noqa: E402
from ssd.tools.env import BOOK_GPU, ROOT, gpu_slug  # noqa: E402

MAKEFILE = """\
PY ?= python3
OUT = /tmp/out
.PHONY: all one two
all: one two
one:
\t$(PY) -m ssd doctor
\t$(PY) -m pytest -m gpu -n auto tests/
two: one
\t$(PY) -m ssd.tools.bench --suite models --impl ssd \\
\t  --out results/$$($(PY) -m ssd.tools.env --slug)/replayed.json
\t$(PY) -m ssd.tools.endtoend --only share
\t$(PY) -m ssd.book.run '0[4-5]*.ipynb'
test:
\t$(PY) -m pytest -m "not gpu" tests/
"""


@pytest.fixture(scope="module")
def recs():
    return rp.load_recordings(gpu=BOOK_GPU)


@pytest.fixture
def notebooks(tmp_path):
    for name, live in (("04_a.ipynb", "primer"), ("05_b.ipynb", "stage1"), ("09_c.ipynb", "study")):
        cell = {"cell_type": "code", "source": [f'run = live_or_recorded("{live}", measure)']}
        (tmp_path / name).write_text(json.dumps({"cells": [cell]}))
    return tmp_path


def test_make_targets():
    targets = rp.make_targets(MAKEFILE)
    assert targets["all"] == (["one", "two"], [])
    assert targets["one"][1] == ["python3 -m ssd doctor", "python3 -m pytest -m gpu -n auto tests/"]
    cmd = targets["two"][1][0]  # continuation joined, $$ read as $, variables expanded
    assert cmd.endswith("--out results/$(python3 -m ssd.tools.env --slug)/replayed.json")
    assert ".PHONY" not in targets


def test_writes(notebooks):
    w = lambda c: rp.writes(c, notebooks)  # noqa: E731
    assert w("python -m pytest -m gpu -n auto tests/") == [
        f"<gpu>/gpu_{name}tests.json.gz" for name in ("", "mixer_", "decode_", "backward_")]
    assert w('python -m pytest -m "not gpu" tests/') == []
    assert w("python -m ssd.tools.bench --suite first-call") == ["<gpu>/first-call.json"]
    out = "results/$(python -m x --slug)/r.json"
    assert w(f"python -m ssd.tools.bench --out {out}") == ["<gpu>/r.json"]
    assert w("python -m ssd.tools.bench --out /tmp/runs/a.json") == ["/tmp/runs/a.json"]
    assert w("python -m ssd.tools.endtoend --only share") == ["<gpu>/endtoend.json (share)"]
    assert w("python -m ssd.tools.aot --resources") == ["compile/sm_90_resources.json"]
    assert w("python -m ssd.book.run '0[4-5]*.ipynb'") == ["<gpu>/primer.json", "<gpu>/stage1.json"]
    assert w("python -m ssd doctor") == []
    assert w("python -m ssd.tools.decode_bench --reps 50") == ["<gpu>/decode.json"]
    assert w("python -m ssd.tools.serving --reps 10") == ["<gpu>/serving_scenario.json"]
    assert w("python -m ssd.tools.backward_bench --merge") == ["<gpu>/backward.json"]
    assert w("python -m ssd.tools.train mqar --seed 0") == ["<gpu>/training.json"]
    assert w("python -m ssd.tools.train step --shapes 2.7b") == ["<gpu>/training_step.json"]
    assert w("python -m ssd.tools.bench --suite robust --shard 2/8 --merge") == [
        "<gpu>/robust.json"]


def test_gpu_plan(notebooks):
    plan = rp.gpu_plan(MAKEFILE, root_target="all", notebooks=notebooks)
    assert plan.column("part") == ["one", "one", "two", "two", "two"]  # one runs once, first
    assert plan[2]["writes"] == ["<gpu>/replayed.json"]
    assert rp.shown(plan[2]["command"]).endswith("--out results/<gpu>/replayed.json")
    assert rp.shown(plan[0]["command"]) == "python -m ssd doctor"


def test_real_makefile_plan():
    plan = rp.gpu_plan((ROOT / "Makefile").read_text())
    commands = plan.column("command")
    written = [w for ws in plan.column("writes") for w in ws]
    assert "ssd doctor" in commands[0]                       # the machine is checked first
    tests = next(i for i, c in enumerate(commands) if "pytest" in c)
    bench = next(i for i, c in enumerate(commands) if "ssd.tools.bench" in c)
    assert tests < bench                                     # correctness before any timing
    assert {"<gpu>/gpu_tests.json.gz", "<gpu>/models.json"} <= set(written)
    serving_and_training = {"decode", "serving_scenario", "robust", "backward", "training",
                            "training_step"}
    assert {f"<gpu>/{n}.json" for n in serving_and_training} <= set(written)
    assert serving_and_training <= set(rp.HOLDS)
    shards = [c for c in commands if "--suite robust" in c]
    assert sorted(c.split("--shard ")[1].split()[0] for c in shards) == [
        f"{i}/{len(shards)}" for i in range(1, len(shards) + 1)]   # every shard, once
    assert all("--merge" in c for c in shards)


def test_recordings_and_environment(recs):
    assert f"{BOOK_GPU}/models.json" in recs and f"{BOOK_GPU}/endtoend.json" in recs
    envs = rp.environment_table(recs)
    with_env = [n for n, p in recs.items() if p.get("environment")]
    assert envs.column("file") == [n.removesuffix(".gz").removesuffix(".json") for n in with_env]
    revs = rp.revisions(recs)
    assert sorted(n for names in revs.values() for n in names) == sorted(with_env)
    common = rp.common_versions(recs)
    for row, name in zip(envs, with_env):
        differ = [k for k in rp.VERSIONS if recs[name]["environment"].get(k) != common[k]]
        assert (row["versions"] == "common") == (not differ)
    models_env = recs[f"{BOOK_GPU}/models.json"]["environment"]
    assert all(models_env.get(k) == v for k, v in common.items())
    assert rp.span_minutes(recs) >= 0
    assert models_env["gpu"] in rp.environment_line(models_env)
    assert gpu_slug(models_env) == BOOK_GPU


def test_holds_table(recs):
    holds = rp.holds_table(recs, (ROOT / "Makefile").read_text())
    row = {r["file"]: r for r in holds}
    models, endtoend = f"{BOOK_GPU}/models.json", f"{BOOK_GPU}/endtoend.json"
    assert row[models]["entries"] == len(recs[models]["records"])
    assert row[models]["writer"].startswith("make ")
    assert row[endtoend]["entries"] == sum(
        len(recs[endtoend][p]["rows"]) for p in ("share", "prefill"))


def test_spread_and_reruns(recs):
    models = recs[f"{BOOK_GPU}/models.json"]
    spread = rp.spread_table(models)
    graph = [r for r in models["records"] if r["mode"] == "graph"]
    assert sum(spread.column("n")) == len(graph)
    assert all(0 <= r["median"] <= r["worst"] for r in spread)
    replayed = recs[f"{BOOK_GPU}/tilegym_replayed.json"]
    rerun = rp.rerun_table(models, {"tilegym_replayed": replayed})
    assert len(rerun) > 0
    for r in rerun:
        assert r["ratio"] == pytest.approx(r["ms"] / r["ref_ms"])
    fig = rp.plot_reruns(rerun)
    assert sum(len(c.get_offsets()) for c in fig.axes[0].collections
               if hasattr(c, "get_offsets") and c.get_offsets().shape[1:] == (2,)) >= len(rerun)


def test_compare_recordings_with_itself(recs):
    models = recs[f"{BOOK_GPU}/models.json"]
    table = rp.compare_recordings(models, models)
    expected = speedups(models["records"])
    assert len(table) == len(expected) - 1                   # every shape; no geomean row
    for r in table:
        assert r["ratio"] == 1
        assert r["a_speedup"] == pytest.approx(expected[r["shape"]])


def test_gpu_support():
    rows = {r["cc"]: r for r in rp.gpu_support()}
    assert rows["9.x"]["folder"] == "results/h100/" and rows["9.x"]["tuned"].startswith("tuned")
    assert rows["10.x"]["tileiras"] == "13.1"
