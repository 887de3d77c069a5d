"""ssd.book.backward: the backward chapter's tables and figures say what they claim."""
import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from ssd.book import backward as BW  # noqa: E402
from ssd.config import head_splits  # noqa: E402
from ssd.cost import ssd_costs  # noqa: E402
from ssd.launch import CAPTURE_GPU  # noqa: E402
from ssd.problem import EDGE_SHAPES, MODEL_SHAPES, ProblemSpec  # noqa: E402

TINY = ProblemSpec(batch=1, seqlen=5, nheads=2, headdim=2, dstate=2, ngroups=1, chunk_size=2,
                   D="h", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.0, 0.06),
                   initial_states=True, seq_boundaries=((3,),), name="tiny")


def test_gradient_table_gives_each_input_a_gradient_of_its_shape():
    table = BW.gradient_table(TINY)
    inputs = TINY.make_inputs(0)
    returned = [r for r in table if r["role"].startswith("returns")]
    assert sorted(r["tensor"] for r in returned) == sorted(
        f"`d{k}`" for k in inputs if k != "seq_idx")
    for r in returned:
        assert r["shape"] == "(" + ", ".join(map(str, inputs[r["tensor"][2:-1]].shape)) + ")"
    assert table.find(tensor="`dB`")["layout"] == "b, l, g, n"   # per group, not per head
    assert table.find(tensor="`seq_idx`")["role"].startswith("none")
    assert [r["tensor"] for r in table][:2] == ["`dy`", "`dfinal_states`"]


def test_impulse_gradient_is_the_impulse_response_reversed():
    out = BW.impulse_gradient([-0.5, -2.0], step=0.1, length=30)
    T = 29
    want = 0.1 * np.exp(0.1 * np.array([-0.5, -2.0])[None, :] * (T - out["t"])[:, None])
    np.testing.assert_allclose(out["dx"], want, rtol=1e-13)
    np.testing.assert_allclose(out["dx"], out["y"][::-1], rtol=1e-13)
    fig = BW.plot_impulse_gradient(out)
    assert len(fig.axes) == 2


def test_finite_difference_table_checks_every_element():
    inputs, grads = TINY.make_inputs(0), TINY.make_output_grads(0)
    table = BW.finite_difference_table(TINY, inputs, grads)
    assert [r["input"] for r in table] == [f"`{k}`" for k in inputs if k != "seq_idx"]
    assert sum(table.column("elements")) == sum(v.size for k, v in inputs.items()
                                                if k != "seq_idx")
    assert max(table.column("rel_err")) < 1e-6
    assert min(table.column("largest")) > 0                   # no input is trivially 0
    at_kink = {**inputs, "dt": inputs["dt"].copy(), "dt_bias": np.zeros(2)}
    at_kink["dt"][0, 1, 0] = np.log(np.expm1(0.06))           # softplus lands on hi
    with pytest.raises(ValueError, match="kink"):
        BW.finite_difference_table(TINY, at_kink, grads)


def test_dt_path_table_edges_are_a_convention():
    lo, hi = 0.01, 0.05
    table = BW.dt_path_table([("below", 0.0, False), ("lo", lo, False), ("mid", 0.02, False),
                              ("hi", hi, False), ("soft", -3.0, True)], (lo, hi))
    for label in ("lo", "hi"):                                # inside taken at the edge
        row = table.find(point=label)
        assert row["slope"] == 1.0
        assert row["central"] == pytest.approx(0.5, abs=1e-6)
        assert {round(row["below"], 6), round(row["above"], 6)} == {0.0, 1.0}
    assert table.find(point="below")["slope"] == 0.0
    soft = table.find(point="soft")
    assert soft["slope"] == pytest.approx(1 / (1 + math.exp(3)))   # sigmoid(-3)
    assert soft["central"] == pytest.approx(soft["slope"], rel=1e-6)


def test_directional_error_tells_right_from_wrong():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 4))

    def loss(kw):
        return float((np.sin(kw["a"]) ** 2).sum())

    grad = np.sin(2 * a)
    assert BW.directional_error(loss, {"a": a}, grad, "a", np.random.default_rng(1)) < 1e-8
    assert BW.directional_error(loss, {"a": a}, 1.01 * grad, "a",
                                np.random.default_rng(1)) > 1e-3


def test_stage_check_table_on_edge_shapes():
    table = BW.stage_check_table(["l-not-multiple", "seq-idx-mid-chunk"])
    assert table.column("seq_idx") == ["no", "yes"]
    for row in table:
        for stage in ("chunk_scan", "state_passing", "chunk_state", "chunk_cumsum"):
            assert 0 < row[stage] < 1e-6, (row["shape"], stage)
        assert row["composed"] < 1e-12


def test_plot_gradient_blocks_draws_both_passes():
    spec = EDGE_SHAPES["three-chunks"].replace(batch=1, nheads=1)
    M = np.tril(np.ones((spec.seqlen, spec.seqlen)))
    fig = BW.plot_gradient_blocks(M, spec.chunk_size)
    left, right = fig.axes[:2]
    assert "M^\\top" in right.get_title() and "M\\," in left.get_title()
    c = spec.nchunks                      # c diagonal blocks, c (c - 1) / 2 off-diagonal
    assert len(left.patches) == len(right.patches) == c + c * (c - 1) // 2 * 4


def test_intermediates_table_counts():
    spec = MODEL_SHAPES["2.7b"]
    b, l, h, p, n, g = spec.dims
    q = spec.chunk_size
    c = math.ceil(l / q)
    table = BW.intermediates_table(spec, bandwidth=4e12, rate=8e14)
    prev = table.find(intermediate="`prev_states`")
    states = table.find(intermediate="`states`")
    assert prev["saved"] == b * c * h * p * n * 2              # bf16, as stored
    assert states["saved"] == 2 * prev["saved"]                # fp32
    cost = ssd_costs(spec.dims, q)
    assert prev["flops"] == cost["chunk_state"]["flops"] + cost["state_passing"]["flops"]
    assert prev["rebuild_us"] == pytest.approx(1e6 * max(prev["moved"] / 4e12,
                                                         prev["flops"] / 8e14))
    kept = table.find(intermediate="inputs `x`, `dt`, `B`, `C`")
    assert kept["flops"] is None and kept["saved"] > prev["saved"]
    assert "no z" in table.find(intermediate="output before the gate")["read_by"]
    assert "rebuild_us" not in BW.intermediates_table(spec).columns


def test_save_or_recompute_scales_as_n_over_q():
    shapes = {k: MODEL_SHAPES[k] for k in ("130m", "small-state")}
    table = BW.save_or_recompute(shapes, [64, 256], 4e12, 8e14)
    assert len(table) == 4
    for row in table:
        assert row["over_x"] == shapes[row["shape"]].dstate / row["q"]
        assert 0 < row["share"] < 1 and row["rebuild_us"] < row["forward_us"]
    by = {(r["shape"], r["q"]): r for r in table}
    assert by[("130m", 64)]["prev_mb"] == pytest.approx(4 * by[("130m", 256)]["prev_mb"])


def test_kernel_table_reads_the_kernels_and_their_launches():
    table = BW.kernel_table("bfloat16")
    d = table.dims
    assert d["c"] == math.ceil(d["l"] / d["q"])
    by = {r["kernel"].strip("`"): r for r in table}
    assert list(by) == ["state_passing_backward_kernel", "state_passing_backward_rows_kernel",
                        "chunk_scan_backward_columns_kernel", "chunk_scan_backward_rows_kernel",
                        "chunk_cumsum_backward_kernel", "chunk_cumsum_backward_sum_kernel"]
    walk = by["state_passing_backward_kernel"]  # it forms dprev_states from chunk_scan's dy, C
    assert "`dy`, `C`" in walk["reads"] and "dprev_states" not in walk["reads"]
    assert "chunk_state" not in "".join(table.column("stage"))  # folded into chunk_scan's
    columns, rows = by["chunk_scan_backward_columns_kernel"], by["chunk_scan_backward_rows_kernel"]
    assert columns["writes"] == "`dx`, `dB`, `ddt_out`, `ddA_cumsum`, `dD_parts`, `state_total`"
    assert "`dstates`" in columns["reads"] and "`state_total`" in rows["reads"]
    assert "`ddA_cumsum` (+=)" in rows["writes"] and "`prev_states`" in rows["reads"]
    splits = head_splits(d["b"] * d["c"] * d["g"] * 4, d["h"] // d["g"], CAPTURE_GPU[1])
    assert columns["blocks"] == d["b"] * d["c"] * d["g"] * splits * 4  # q / 64 column blocks
    assert by["state_passing_backward_rows_kernel"]["reads"] == "`ddecay_parts`"
    for r in table:                                                    # a read is no write
        written = {w.split(" ")[0] for w in r["writes"].split(", ")}
        assert written and not written & set(r["reads"].split(", ")), r["kernel"]


def test_grid_formula_is_checked_against_the_launch():
    grid, block = BW._grid_formula("Grid: (b * c, g, cdiv(n, BLOCK_N)); one block walks.")
    assert (grid, block) == ("(b * c, g, cdiv(n, BLOCK_N))", "one block walks")
    dims = dict(b=2, l=384, h=8, p=64, g=2, n=128, c=2, q=256)
    assert BW._grid_value(grid, dict(BLOCK_N=32, HAS_SEQ=True), dims) == (4, 2, 4)
    assert BW._grid_value("(b, h, slices)", dict(BLOCK_P=64, BLOCK_N=32), dims) == (2, 8, 4)


def test_contract_table_matches_the_numpy_ladder():
    table = BW.contract_table(TINY)
    assert [r["gradient"] for r in table] == [
        "`dx`", "`ddt`", "`dA`", "`dB`", "`dC`", "`dD`", "`dz`", "`ddt_bias`",
        "`dinitial_states`"]
    assert max(table.column("rel_err")) < 1e-13
