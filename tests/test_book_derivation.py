"""ssd.book.derivation: the derivation chapters' computations, against the reference ladder."""

import numpy as np
import pytest

from ssd.book import derivation as D
from ssd.problem import MODEL_SHAPES, ProblemSpec
from ssd.reference import (chunk_cumsum, chunk_state, prepare_dt, recurrence_states, segsum,
                           state_passing)


def _one_head(l=40, p=3, n=4, seed=0):
    inputs = ProblemSpec(batch=1, seqlen=l, nheads=1, headdim=p, dstate=n).make_inputs(seed)
    dt = prepare_dt(inputs["dt"])[0, :, 0]                        # (l,)
    a = np.exp(dt * inputs["A"][0])                               # (l,)
    w = np.einsum("t,tp,tn->tpn", dt, inputs["x"][0, :, 0], inputs["B"][0, :, 0])
    return inputs, a, w


def test_doubling_scan_equals_the_recurrence():
    inputs, a, w = _one_head()
    states, rounds, combines = D.doubling_scan(a, w)
    np.testing.assert_allclose(states, recurrence_states(**inputs)[0, :, 0], rtol=0, atol=1e-14)
    assert rounds == 6 and combines == sum(40 - 2**k for k in range(6))
    table = D.scan_work([64, 1024])
    assert table.column("doubling_rounds") == [6, 10]
    assert table.column("efficient_work") == [126, 2046]


def test_combine_is_associative():
    rng = np.random.default_rng(0)
    steps = [(rng.uniform(0.5, 1), rng.standard_normal((2, 3))) for _ in range(3)]
    left = D.combine(D.combine(steps[0], steps[1]), steps[2])
    right = D.combine(steps[0], D.combine(steps[1], steps[2]))
    np.testing.assert_allclose(left[0], right[0])
    np.testing.assert_allclose(left[1], right[1])


def test_ssm_matrix_and_realization():
    rng = np.random.default_rng(1)
    l, n = 24, 3
    A = 0.5 * rng.standard_normal((l, n, n))
    B, C, x = rng.standard_normal((l, n)), rng.standard_normal((l, n)), rng.standard_normal(l)
    M = D.ssm_matrix(A, B, C)
    np.testing.assert_allclose(M @ x, D.run_ssm(A, B, C, x), atol=1e-12)
    assert D.hankel_ranks(M).max() == n          # an SSM's matrix is n-semiseparable
    U, V = rng.standard_normal((l, n)), rng.standard_normal((l, n))
    S = np.tril(U @ V.T)                          # a semiseparable matrix, built as no SSM
    A2, B2, C2 = D.realize(S)
    assert max(len(b) for b in B2) == n
    np.testing.assert_allclose(D.run_ssm(A2, B2, C2, x), S @ x, atol=1e-12)


def test_diagonal_ssm_is_a_sum_of_masked_attentions():
    rng = np.random.default_rng(2)
    l, n = 30, 4
    a = rng.uniform(0.7, 1.0, (l, n))
    B, C, x = rng.standard_normal((l, n)), rng.standard_normal((l, n)), rng.standard_normal(l)
    y, masks = D.diagonal_as_attention(a, B, C, x)
    np.testing.assert_allclose(y, D.diagonal_ssm(a, B, C, x), atol=1e-13)
    assert masks.shape == (n, l, l)
    # with one decay shared by the n entries the masks coincide: one masked attention
    same = np.repeat(a[:, :1], n, axis=1)
    _, one = D.diagonal_as_attention(same, B, C, x)
    np.testing.assert_array_equal(one, np.broadcast_to(one[0], one.shape))


def test_exact_segment_sums():
    ell = -np.random.default_rng(3).uniform(0, 1, 50)
    exact = D.exact_segment_sums(ell, 5)
    np.testing.assert_allclose(exact[2], ell[1:-2] + ell[2:-1] + ell[3:], rtol=1e-15)


def test_segment_sum_errors_and_mask_patterns():
    inputs = ProblemSpec(batch=1, seqlen=2048, nheads=16, headdim=1, dstate=1).make_inputs(0)
    head = int(np.argmin(inputs["A"]))            # the fastest head: Lambda reaches about -500
    ell = (prepare_dt(inputs["dt"]) * inputs["A"])[0, :, head]
    table = D.segment_sum_errors(ell, chunk_sizes=(64,))
    err = {(r["method"], r["dtype"]): r["q64"] for r in table}
    assert set(err) == {(m, d) for m in D.SEGMENT_METHODS for d in ("float32", "float64")}
    assert err[("segsum", "float64")] < 1e-12
    # float32: restarting the sum per chunk is as good as segsum, the long difference is not
    assert err[("naive cumsum difference", "float32")] > 10 * err[("segsum", "float32")]
    assert err[("cumsum restarted every chunk", "float32")] < 3 * err[("segsum", "float32")]
    rows = {r["pattern"]: r for r in D.exp_mask_patterns(ell, "float32")}
    assert rows["multiply exp by the mask"]["nan"] > 0
    for safe in ("select after a clamped exp", "mask before exp"):
        assert rows[safe]["nan"] == 0 and rows[safe]["above"] == 0


def test_chunk_passing_matrix_is_state_passing():
    spec = ProblemSpec(batch=2, seqlen=200, nheads=3, headdim=4, dstate=5, chunk_size=32,
                       initial_states=True)
    inp = spec.make_inputs(0)
    dt_out, dA_cumsum = chunk_cumsum(inp["dt"], inp["A"], 32)
    states = chunk_state(inp["B"], inp["x"], dt_out, dA_cumsum)
    prev, final = state_passing(states, dA_cumsum, inp["initial_states"])
    W = D.chunk_passing_matrix(dA_cumsum)                        # (b, h, c+1, c+1)
    stacked = np.concatenate([inp["initial_states"][:, None], states], axis=1)
    H = np.einsum("bhij,bjhpn->bihpn", W, stacked)
    np.testing.assert_allclose(H[:, :-1], prev, atol=1e-14)
    np.testing.assert_allclose(H[:, -1], final, atol=1e-14)
    np.testing.assert_allclose(W[0, 0], np.exp(segsum(np.r_[0, dA_cumsum[0, 0, :, -1]])))


def test_scan_versus_chunked():
    env = {"sm_count": 132, "sm_clock_max_mhz": "1980"}
    assert D.datasheet_fp32_rate(env) == pytest.approx(132 * 128 * 2 * 1.98e9)
    table = D.scan_versus_chunked(MODEL_SHAPES["2.7b"], [64, 256], 1e15)
    q64, q256 = table.rows
    assert q64["scan"] == pytest.approx(4 * 80 * 5 * 4096 * 64 * 128 / 1e9)
    # more matmul FLOPs at a larger chunk: the scan needs less to tie
    assert q256["matmul"] > q64["matmul"] and q256["break_even"] < q64["break_even"]


def test_block_picture():
    spec = ProblemSpec(batch=1, seqlen=128, nheads=1, headdim=1, dstate=4, chunk_size=32)
    inp = spec.make_inputs(0)
    dA = (prepare_dt(inp["dt"]) * inp["A"])[0, :, 0]
    M = np.exp(segsum(dA)) * (inp["C"][0, :, 0] @ inp["B"][0, :, 0].T)
    fig = D.plot_block_picture(M, 32, 4)
    assert len(fig.axes) == 2
