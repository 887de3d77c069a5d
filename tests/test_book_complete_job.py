"""ssd.book.complete_job on a synthetic recording made by ``ssd.tools.endtoend.run`` on the CPU:
the torch path's rows in the schema the tool writes, retimed into both layers with both SSD
backends and mamba_ssm's module (the GPU-only parts) with chosen times, so that every table can
be checked against what those times imply. On the book's own recording, where it has both
layers, the tables agree with the raw rows."""
import copy
import math
import re

import matplotlib
import pytest

matplotlib.use("Agg")

pytest.importorskip("torch")

from ssd.book import complete_job as cj  # noqa: E402
from ssd.book.recordings import load_recorded  # noqa: E402
from ssd.tools import endtoend  # noqa: E402
from ssd.tools.endtoend import BASE, NEW, PEER_KERNELS, amdahl  # noqa: E402
from ssd.tools.env import BOOK_GPU  # noqa: E402

#: The synthetic times: our SSD K times mamba_ssm's; the fast layer's rest FAST_REST of the plain
#: one's; mamba_ssm's module PEER times the plain layer's mixer with its SSD.
K, FAST_REST, PEER = 2.0, 0.25, 0.8
#: The layers' relative error against the plain layer's output, as a fraction of the tolerance.
ERR = 0.1


def _retime(row, ssd_ms, rest_ms):
    """A share row with its SSD and rest set, the fields derived from them recomputed."""
    r = copy.deepcopy(row)
    r.update(ssd_ms=ssd_ms, mixer_ms=ssd_ms + rest_ms, rest_diff_ms=rest_ms, rest_ms=rest_ms,
             share=ssd_ms / (ssd_ms + rest_ms), rest_over_floor=rest_ms / r["rest_floor_ms"])
    return r


def _restack(row, ssd_total, rest_total):
    r = copy.deepcopy(row)
    latency = ssd_total + rest_total
    r.update(ssd_ms_total=ssd_total, ssd_ms_per_layer=ssd_total / r["n_layers"],
             latency_ms=latency, ssd_share=ssd_total / latency,
             tokens_per_s=r["tokens"] / (latency * 1e-3))
    return r


@pytest.fixture(scope="module")
def rec():
    from ssd.layer import config_for_shape

    shape = endtoend.SMOKE_SHAPES[0]
    config = config_for_shape(shape, chunk_size=32, dtype="float32")
    raw = endtoend.run([shape], ("torch",), [(config, 1, 40)], reps=2, prefill_reps=1,
                       n_layers=2, chunk_size=32, dtype="float32", device="cpu", progress=False)
    share, pre = [], []
    for r in raw["share"]["rows"]:
        ssd, rest = r["ssd_ms"], max(r["rest_diff_ms"], 1e-3)
        for kernels, rest_ms in (("torch", rest), ("cutile", FAST_REST * rest)):
            for backend, ssd_ms in ((BASE, ssd), (NEW, ssd / K)):
                share.append(dict(_retime(r, ssd_ms, rest_ms), backend=backend, kernels=kernels,
                                  gate_rel_err=ERR * endtoend.GATE_TOL["float32"]))
        peer = _retime(r, ssd, PEER * rest)
        peer.update(backend=BASE, kernels=PEER_KERNELS,
                    gate_rel_err=ERR * endtoend.GATE_TOL["float32"],
                    path=dict(fused=False, conv="nn.Conv1d", norm="Triton", ssd="Triton"))
        share.append(peer)
    for r in raw["prefill"]["rows"]:
        ssd, rest = r["ssd_ms_total"], r["latency_ms"]  # the stack's rest: any positive time
        for kernels, rest_ms in (("torch", rest), ("cutile", FAST_REST * rest)):
            for backend, ssd_ms in ((BASE, ssd), (NEW, ssd / K)):
                pre.append(dict(_restack(r, ssd_ms, rest_ms), backend=backend, kernels=kernels))
    raw["share"]["rows"], raw["prefill"]["rows"] = share, pre
    return endtoend.merge({}, raw)  # recomputes amdahl over the rows, as the tool does


def test_amdahl_grid():
    grid = cj.amdahl_grid(shares=(0.1, 0.5), speedups=(2.0, math.inf))
    assert len(grid) == 2
    assert grid[1][2.0] == pytest.approx(4 / 3)          # half the job twice as fast
    assert grid[0][math.inf] == pytest.approx(1 / 0.9)   # the bound 1 / (1 - s)
    cells = re.findall(r">([^<]*)</td>", grid._repr_html_())
    assert cells[3:] == ["50.0\u00a0%", "1.33x", "2.00x"]


def test_layers_side_by_side(rec):
    t = cj.layers_table(rec)
    assert [(r["shape"], r["layer"]) for r in t] == [("smoke", "plain"), ("smoke", "fast")]
    plain, fast = t
    assert fast["rest_ms"] == pytest.approx(FAST_REST * plain["rest_ms"])
    # the same SSD is a larger share of the faster layer
    assert fast["base_share"] > plain["base_share"] and fast["new_share"] > plain["new_share"]
    for r in t:
        assert r["new_ms"] == pytest.approx(r["ssd_ms"] + r["rest_ms"])


@pytest.mark.parametrize("part", ["share", "prefill"])
def test_amdahl_per_layer(rec, part):
    t = cj.amdahl_layers(rec, part)
    assert sorted(t.column("layer")) == ["fast", "plain"]
    for a in t:
        assert a["kernel_speedup"] == pytest.approx(K)
        # only the SSD changed between the two jobs: the law is exact here
        assert a["predicted"] == pytest.approx(amdahl(a["share"], K))
        assert a["measured"] == pytest.approx(a["predicted"])
        assert a["max_possible"] == pytest.approx(1 / (1 - a["share"]))
    plain, fast = t.find(layer="plain"), t.find(layer="fast")
    assert fast["measured"] > plain["measured"]  # the same gain, diluted less


def test_floors_and_projections(rec):
    from ssd.cost import rest_floor
    from ssd.layer import config_for_shape

    ceil = rec["share"]["ceilings"]
    (f,) = cj.floor_table(rec)
    shape = endtoend.SMOKE_SHAPES[0]
    want = rest_floor(config_for_shape(shape, chunk_size=32, dtype="float32"), shape.b,
                      shape.l, ceil)
    assert f["rest_floor_ms"] == pytest.approx(want["floor_ms"])
    assert f["proj_gflop"] == pytest.approx(want["proj_flops"] / 1e9)
    assert f["share_at_floors"] == pytest.approx(
        f["ssd_floor_ms"] / (f["ssd_floor_ms"] + f["rest_floor_ms"]))
    (p,) = cj.projections_table(rec)
    for name in ("in_proj", "out_proj"):
        assert p[f"{name}_of_ceiling"] == pytest.approx(
            1e12 * p[f"{name}_tflops"] / ceil["bf16_flops_per_s"])


def test_stack_table(rec):
    (s,) = cj.stack_table(rec)
    rows = {(r["backend"], r["kernels"]): r for r in rec["prefill"]["rows"]}
    fast = rows[(NEW, "cutile")]
    assert s["latency_ms"] == fast["latency_ms"] and s["tokens_per_s"] == fast["tokens_per_s"]
    assert s["over_plain"] == pytest.approx(rows[(NEW, "torch")]["latency_ms"] / fast["latency_ms"])
    assert s["over_start"] == pytest.approx(rows[(BASE, "torch")]["latency_ms"]
                                            / fast["latency_ms"])


def test_goals(rec):
    (g,) = cj.goals_table(rec)
    rows = {(r["backend"], r["kernels"]): r for r in rec["share"]["rows"]}
    fast, peer = rows[(NEW, "cutile")], rows[(BASE, PEER_KERNELS)]
    assert g["over_floor"] == fast["rest_over_floor"]
    assert g["floor_met"] == (fast["rest_over_floor"] <= cj.REST_GOAL)
    assert g["vs_peer"] == pytest.approx(peer["mixer_ms"] / fast["mixer_ms"])
    assert g["peer_met"] == (g["vs_peer"] > 1)
    assert g["tol"] == endtoend.GATE_TOL["float32"] and g["rel_err"] == fast["gate_rel_err"]
    assert g["equal_met"] == (fast["gate_rel_err"] <= g["tol"])
    (p,) = cj.peer_table(rec)
    assert p["speedup"] == pytest.approx(g["vs_peer"]) and p["conv"] == "nn.Conv1d"


def test_headlines_and_figures(rec):
    h = cj.headlines(rec)
    layers = cj.layers_table(rec)
    assert h["plain_share_hi"] == pytest.approx(100 * layers.find(layer="plain")["base_share"])
    assert h["fast_S_hi"] > h["plain_S_hi"] and h["fast_k_lo"] == pytest.approx(K)
    assert h["n_shapes"] == 1 and h["peer_conv"] == "nn.Conv1d"
    assert h["goal_equal_met"] == 1 and "stack_tokens_hi" in h
    fig = cj.plot_layers(rec)
    assert len(fig.axes[0].patches) == 2 * 5  # SSD + rest: 2 layers x 2 SSDs, and the module
    fig = cj.plot_amdahl(rec)
    points = sum(len(c.get_offsets()) for c in fig.axes[0].collections)
    assert points == len(rec["share"]["amdahl"]) + len(rec["prefill"]["amdahl"])


def test_on_the_recording():
    """The book's recording, where it holds both layers: every shape's tables agree with its
    rows, and nothing measured beats its floor."""
    e = load_recorded("endtoend", gpu=BOOK_GPU)
    if not cj.shapes(e):
        pytest.skip("the recording holds no fast-layer rows")
    t = cj.layers_table(e)
    assert len(t) == 2 * len(cj.shapes(e))
    for r in t:
        assert r["over_floor"] > 1
    for part in ("share", "prefill"):
        for a in cj.amdahl_layers(e, part):
            assert a["predicted"] == pytest.approx(amdahl(min(a["share"], 1), a["kernel_speedup"]))
