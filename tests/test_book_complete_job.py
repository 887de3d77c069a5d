"""ssd.book.complete_job on the recorded layer (results/<gpu>/endtoend.json, ``<gpu>`` the book's
recording folder ``ssd.tools.env.BOOK_GPU``): the tables agree with the raw rows, Amdahl's law
as the recording computed it, and the floors are floors."""
import math
import re

import matplotlib
import pytest

matplotlib.use("Agg")

from ssd.book import complete_job as cj  # noqa: E402
from ssd.book.recordings import load_recorded  # noqa: E402
from ssd.layer import Mamba2Config  # noqa: E402
from ssd.tools.endtoend import BASE, NEW, amdahl  # noqa: E402
from ssd.tools.env import BOOK_GPU  # noqa: E402


@pytest.fixture(scope="module")
def rec():
    return load_recorded("endtoend", gpu=BOOK_GPU), load_recorded("models", gpu=BOOK_GPU)


def test_amdahl_grid():
    grid = cj.amdahl_grid(shares=(0.1, 0.5), speedups=(2.0, math.inf))
    assert len(grid) == 2
    assert grid[1][2.0] == pytest.approx(4 / 3)          # half the job twice as fast
    assert grid[0][math.inf] == pytest.approx(1 / 0.9)   # the bound 1 / (1 - s)
    cells = re.findall(r">([^<]*)</td>", grid._repr_html_())
    assert cells[3:] == ["50.0\u00a0%", "1.33x", "2.00x"]


def test_time_split_matches_rows(rec):
    e, _ = rec
    split = cj.time_split(e)
    assert len(split) == len(e["share"]["rows"])
    for t, r in zip(split, e["share"]["rows"]):
        assert t["share"] == pytest.approx(r["ssd_ms"] / r["mixer_ms"])
        assert t["unexplained"] == pytest.approx(1 - (r["rest_ms"] + r["ssd_ms"]) / r["mixer_ms"])
        assert abs(t["unexplained"]) < 0.05          # the parts add up to the mixer
    assert {r["key"] for r in split} == {BASE, NEW}


@pytest.mark.parametrize("part", ["share", "prefill"])
def test_amdahl_table_is_the_recorded_one(rec, part):
    e, _ = rec
    table = cj.amdahl_table(e, part)
    stored = e[part]["amdahl"]
    assert len(table) == len(stored) > 0
    for t, a in zip(table, stored):
        for key in ("share", "kernel_speedup", "predicted", "measured", "max_possible"):
            assert t[key] == pytest.approx(a[key])
        assert t["predicted"] == pytest.approx(amdahl(min(t["share"], 1), t["kernel_speedup"]))
        assert t["error"] == pytest.approx(t["measured"] - t["predicted"])


def test_prefill_table(rec):
    e, _ = rec
    table = cj.prefill_table(e)
    rows = {(r["config"], r["batch"], r["seqlen"], r["backend"]): r for r in e["prefill"]["rows"]}
    assert len(table) == len(e["prefill"]["rows"]) // 2
    for t in table:
        base = rows[(t["config"], t["batch"], t["seqlen"], BASE)]
        new = rows[(t["config"], t["batch"], t["seqlen"], NEW)]
        assert t["measured"] == pytest.approx(base["latency_ms"] / new["latency_ms"])
        assert t["share"] == pytest.approx(base["ssd_share"])
        assert t["tokens"] == base["tokens"]


def test_rest_costs_by_hand():
    # d_model 4, expand 2 -> d_inner 8, headdim 4 -> 2 heads; state 2, 1 group, conv 4:
    # conv_dim = 8 + 2*2 = 12, in_proj width = 8 + 12 + 2 = 22; 3 tokens, 2 bytes each.
    c = Mamba2Config(d_model=4, d_state=2, headdim=4, dtype="float32")
    parts = cj.rest_costs(c, batch=1, seqlen=3)
    assert parts["in_proj + conv1d"]["flops"] == 2 * 3 * 4 * 22 + 2 * 3 * 12 * 4
    assert parts["in_proj + conv1d"]["bytes"] == 2 * (3 * 4 + 4 * 22 + 12 * 5 + 3 * 22)
    assert parts["norm + out_proj"]["flops"] == 2 * 3 * 8 * 4
    assert parts["norm + out_proj"]["bytes"] == 2 * (2 * 3 * 8 + 8 * 4 + 3 * 4)


def test_floors_are_floors(rec):
    e, m = rec
    costs, rest = cj.cost_table(e, m), cj.rest_floor_table(e, m)
    assert len(costs) == len(rest) == len(e["share"]["rows"]) // 2
    for c in costs:
        assert 0 < c["share_at_floors"] < 1
    for r in rest:
        assert r["over_floor"] > 1                     # nothing measured beats its floor
        assert r["share_at_floor"] > 0 and r["s_at_floor"] >= r["measured"] - 0.01
        assert r["s_at_floor"] == pytest.approx(amdahl(r["share_at_floor"], r["k"]))


def test_figures(rec):
    e, _ = rec
    fig = cj.plot_time_split(e)
    assert len(fig.axes[0].patches) == 2 * len(e["share"]["rows"])   # SSD + rest per row
    fig = cj.plot_amdahl(e)
    points = sum(len(c.get_offsets()) for c in fig.axes[0].collections)
    assert points == len(e["share"]["amdahl"]) + len(e["prefill"]["amdahl"])
