"""The NumPy reference ladder: recurrence == quadratic == chunked, stage by stage.

CPU only, float64. Every comparison prints its error and asserts it.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ssd import reference as R
from ssd.problem import EDGE_SHAPES, ProblemSpec

# Tolerance. All three rungs compute in float64 (eps = 2.2e-16). They sum at most a few
# hundred products of O(1) terms whose decay factors are <= 1, so no step amplifies
# round-off beyond the size of the sum; we observe relative errors of 1e-16..1e-15.
# 1e-12 leaves three orders of margin (for longer l and unlucky cancellation) while a
# real semantic slip -- one wrong mask entry, a missing decay step, an off-by-one
# chunk boundary -- changes the result by >= 1e-4 relative.
RTOL = 1e-12


def assert_close(actual, expected, name, rtol=RTOL, scale=0.0):
    """Relative Frobenius error AND max-abs error (scaled by max(1, max|expected|)). ``scale``:
    a floor for the relative error's norm, for a sum that may cancel to far below its terms
    (its rounding is relative to the terms)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = actual - expected
    norm = max(np.linalg.norm(expected), scale)
    rel = np.linalg.norm(err) / norm if norm > 0 else np.linalg.norm(err)
    max_abs = float(np.abs(err).max()) if err.size else 0.0
    max_scale = max(1.0, float(np.abs(expected).max())) if err.size else 1.0
    print(f"{name}: rel {rel:.2e}, max-abs {max_abs:.2e}")
    assert rel <= rtol, f"{name}: relative error {rel:.3e} > {rtol:.0e}"
    assert max_abs <= rtol * max_scale, f"{name}: max-abs error {max_abs:.3e} > {rtol * max_scale:.0e}"


def flags(spec):
    return dict(dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)


def all_rungs(spec, inputs):
    """(y, final_states) from each rung, plus the staged reference of the spec."""
    out = {
        "recurrence": R.ssd_recurrence(**inputs, **flags(spec), return_final_states=True),
        "quadratic": R.ssd_quadratic(**inputs, **flags(spec), return_final_states=True),
        "chunked": R.ssd_chunked(**inputs, **spec.options, return_final_states=True),
    }
    ref = spec.reference(inputs)
    out["stages"] = (ref["y"], ref["final_states"])
    return out


def assert_rungs_agree(spec, inputs):
    out = all_rungs(spec, inputs)
    y0, f0 = out.pop("recurrence")
    for rung, (y, f) in out.items():
        assert_close(y, y0, f"{spec.name} y {rung} vs recurrence")
        assert_close(f, f0, f"{spec.name} final_states {rung} vs recurrence")


# ---- the ladder on every named edge shape ----------------------------------------------


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_rungs_agree_on_edge_shapes(name):
    spec = EDGE_SHAPES[name]
    assert_rungs_agree(spec, spec.make_inputs(seed=0))


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_prev_states_are_recurrence_states_at_chunk_starts(name):
    """prev_states[:, c] is h_{c*q - 1}; prev_states[:, 0] is the initial state."""
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=1)
    ref = spec.reference(inputs)
    no_gate = {k: v for k, v in inputs.items() if k not in ("D", "z")}
    h_all = R.recurrence_states(**no_gate, **flags(spec))  # (b, l, h, p, n)
    b, l, h, p, n, g = spec.dims
    q = spec.chunk_size
    h0 = inputs.get("initial_states", np.zeros((b, h, p, n)))
    assert_close(ref["prev_states"][:, 0], h0, f"{name} prev_states[0]")
    for c in range(1, spec.nchunks):
        assert_close(ref["prev_states"][:, c], h_all[:, c * q - 1], f"{name} prev_states[{c}]")
    assert_close(ref["final_states"], h_all[:, -1], f"{name} final_states")


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_chunk_state_is_each_chunk_run_from_zero(name):
    """states[:, c] is the final state of the recurrence run on chunk c alone."""
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=2)
    ref = spec.reference(inputs)
    q, l = spec.chunk_size, spec.seqlen
    for c in range(spec.nchunks):
        piece = slice(c * q, min((c + 1) * q, l))
        sliced = {k: v[:, piece] for k, v in inputs.items() if k in ("x", "dt", "B", "C", "seq_idx")}
        _, alone = R.ssd_recurrence(**sliced, A=inputs["A"], dt_bias=inputs.get("dt_bias"),
                                    **flags(spec), return_final_states=True)
        assert_close(ref["states"][:, c], alone, f"{name} states[{c}]")


@pytest.mark.parametrize("name", ["l-not-multiple", "l-less-than-q", "dt-bias-softplus-limit"])
def test_chunk_cumsum_layout_and_padding(name):
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=3)
    dt_out, dA_cumsum = R.chunk_cumsum(inputs["dt"], inputs["A"], spec.chunk_size,
                                       inputs.get("dt_bias"), **flags(spec))
    b, l, h, p, n, g = spec.dims
    c, q = spec.nchunks, spec.chunk_size
    assert dt_out.shape == dA_cumsum.shape == (b, h, c, q)
    assert dt_out.dtype == dA_cumsum.dtype == np.float64
    dt = R.prepare_dt(inputs["dt"], inputs.get("dt_bias"), **flags(spec))  # (b, l, h)
    flat = dt_out.transpose(0, 2, 3, 1).reshape(b, c * q, h)  # (b, c*q, h)
    np.testing.assert_array_equal(flat[:, :l], dt)
    np.testing.assert_array_equal(flat[:, l:], 0.0)  # padded tail: dt' = 0 even with lo > 0
    expected = np.cumsum(dt_out * inputs["A"][None, :, None, None], axis=-1)
    assert_close(dA_cumsum, expected, f"{name} dA_cumsum")
    last = (l - 1) % q
    tail = dA_cumsum[:, :, -1, last:]  # flat from the last valid position on
    assert (tail == tail[..., :1]).all()
    assert (dA_cumsum <= 0).all() and (np.diff(dA_cumsum, axis=-1) <= 0).all()


def test_chunking_does_not_change_the_answer():
    """Any chunk size, including 1, odd sizes and q > l, gives the same y."""
    spec = EDGE_SHAPES["all-features"]
    inputs = spec.make_inputs(seed=4)
    y0, f0 = R.ssd_recurrence(**inputs, **flags(spec), return_final_states=True)
    for q in (1, 3, 7, 16, 64, 200):
        y, f = R.ssd_chunked(**inputs, chunk_size=q, **flags(spec), return_final_states=True)
        assert_close(y, y0, f"y with chunk_size={q}")
        assert_close(f, f0, f"final_states with chunk_size={q}")


# ---- semantics, checked against independent formulations ---------------------------------


def test_seq_idx_equals_running_sequences_separately():
    """A packed row == each sequence run on its own; h0 only feeds a first seq_idx of 0."""
    spec = EDGE_SHAPES["seq-idx-mid-chunk"]
    inputs = spec.make_inputs(seed=5)
    y_packed, f_packed = R.ssd_chunked(**inputs, **spec.options, return_final_states=True)
    seq = inputs["seq_idx"]
    for bi in range(spec.batch):
        starts = [0] + [t for t in range(1, spec.seqlen) if seq[bi, t] != seq[bi, t - 1]]
        ends = starts[1:] + [spec.seqlen]
        for s, e in zip(starts, ends):
            part = {k: inputs[k][bi:bi + 1, s:e] for k in ("x", "dt", "B", "C")}
            h0 = inputs["initial_states"][bi:bi + 1] if (s == 0 and seq[bi, 0] == 0) else None
            y, f = R.ssd_recurrence(**part, A=inputs["A"], initial_states=h0,
                                    return_final_states=True)
            assert_close(y_packed[bi:bi + 1, s:e], y, f"row {bi} sequence [{s}, {e})")
        assert_close(f_packed[bi:bi + 1], f, f"row {bi} final state = last sequence's")


def test_prepare_dt_order_threshold_and_clamp():
    dt = np.array([[[-3.0, 0.5, 19.0, 20.0, 20.5, 40.0]]])  # (1, 1, 6)
    # default dt_limit (0, inf) is applied: a negative dt' becomes 0 (as mamba_ssm)
    np.testing.assert_array_equal(R.prepare_dt(dt), np.maximum(dt, 0.0))
    sp = R.prepare_dt(dt, dt_softplus=True)
    np.testing.assert_allclose(sp[..., :4], np.log1p(np.exp(dt[..., :4])), rtol=1e-15)
    np.testing.assert_array_equal(sp[..., 4:], dt[..., 4:])  # identity above 20
    # bias first, then softplus, then clamp
    bias = np.array([1.0, -1.0, 0.0, 0.0, -0.6, 0.0])
    got = R.prepare_dt(dt, bias, dt_softplus=True, dt_limit=(0.1, 20.0))
    want = np.clip(np.where(dt + bias <= 20, np.log1p(np.exp(dt + bias)), dt + bias), 0.1, 20.0)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert got[0, 0, 5] == 20.0  # 40 passes softplus unchanged, then the clamp
    assert R.prepare_dt(np.array([[[1e-4, 1.0]]]), dt_limit=(1e-3, 0.5)).tolist() == [[[1e-3, 0.5]]]


def test_negative_dt_is_a_zero_step():
    """With the default dt_limit, dt < 0 acts as dt' = 0: no decay, no write."""
    spec = EDGE_SHAPES["three-chunks"]
    inputs = spec.make_inputs(seed=6)
    neg = dict(inputs, dt=np.where(np.arange(spec.seqlen)[None, :, None] % 5 == 0, -1.0, inputs["dt"]))
    zero = dict(inputs, dt=np.maximum(neg["dt"], 0.0))
    assert_close(R.ssd_chunked(**neg, chunk_size=32), R.ssd_recurrence(**zero), "negative dt")


def test_D_skip_and_z_gate():
    spec = EDGE_SHAPES["all-features"]
    inputs = spec.make_inputs(seed=7)
    plain = {k: v for k, v in inputs.items() if k not in ("D", "z")}
    y = R.ssd_chunked(**plain, **spec.options)
    x, D, z = inputs["x"], inputs["D"], inputs["z"]
    assert_close(R.ssd_chunked(**plain, D=D, **spec.options), y + D * x, "D (h, p)")
    assert_close(R.ssd_chunked(**plain, D=D[:, 0], **spec.options), y + D[:, :1] * x, "D (h,)")
    silu = z / (1 + np.exp(-z))
    assert_close(R.ssd_chunked(**plain, z=z, **spec.options), y * silu, "z gate")
    assert_close(R.ssd_chunked(**inputs, **spec.options), (y + D * x) * silu, "D then z")


def test_groups_equal_repeated_heads():
    """g groups == B, C repeated per head (g = h): head i reads group i // (h // g)."""
    spec = EDGE_SHAPES["ngroups-gt-1"]
    inputs = spec.make_inputs(seed=8)
    ratio = spec.nheads // spec.ngroups
    wide = dict(inputs, B=np.repeat(inputs["B"], ratio, axis=2), C=np.repeat(inputs["C"], ratio, axis=2))
    assert_close(R.ssd_chunked(**inputs, chunk_size=32), R.ssd_chunked(**wide, chunk_size=32), "groups")


def test_low_precision_inputs_are_computed_in_float64():
    spec = EDGE_SHAPES["all-features"]
    inputs32 = spec.make_inputs(seed=9, dtype=np.float32)
    inputs64 = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in inputs32.items()}
    for fn in (R.ssd_recurrence, R.ssd_quadratic):
        y = fn(**inputs32, **flags(spec))
        assert y.dtype == np.float64
        assert_close(y, fn(**inputs64, **flags(spec)), f"{fn.__name__} float32 inputs", rtol=0)
    y, f = R.ssd_chunked(**inputs32, **spec.options, return_final_states=True)
    assert y.dtype == f.dtype == np.float64


# ---- the segment sum and its numerical hazard ------------------------------------------------


def test_segsum_matches_its_definition():
    x = np.random.default_rng(10).standard_normal((2, 3, 7))
    out = R.segsum(x)
    assert out.shape == (2, 3, 7, 7)
    for t in range(7):
        for s in range(7):
            want = x[..., s + 1:t + 1].sum(-1) if s <= t else np.full((2, 3), -np.inf)
            np.testing.assert_allclose(out[..., t, s], want, rtol=1e-14, atol=1e-15)


def test_segsum_keeps_short_segments_exact_after_a_huge_prefix():
    """cumsum differences lose short segments behind a large prefix; segsum does not."""
    x = np.full(64, -1e-3)
    x[0] = -1e12  # e.g. the log-decay accumulated over a very long sequence
    out = R.segsum(x)
    cs = np.cumsum(x)
    naive = cs[10] - cs[5]  # the same segment x[6..10] = -5e-3, via the big cumsum
    print(f"segsum {out[10, 5]!r}, cumsum difference {naive!r}")
    assert abs(out[10, 5] - (-5e-3)) < 1e-17
    assert abs(naive - (-5e-3)) > 1e-6  # the subtraction lost ~all digits


def test_exp_of_masked_segsum_has_no_nan():
    """Mask to -inf before exp: exp(-inf) = 0. Masking after exp meets inf * 0 = NaN."""
    x = np.full(64, -30.0)  # strong decay: upper-triangle "segments" are +30 per step
    L = np.exp(R.segsum(x))
    assert np.isfinite(L).all() and (np.triu(L, 1) == 0).all()
    assert_close(np.diag(L), np.ones(64), "diagonal of L")
    cs = np.cumsum(x)
    with np.errstate(over="ignore", invalid="ignore"):
        wrong = np.exp(cs[:, None] - cs[None, :]) * np.tril(np.ones((64, 64)))
    assert np.isnan(wrong).any()  # why the reference (and the kernels) mask first


def test_a_check_can_fail():
    """The comparisons above are not vacuous: one perturbed element is detected."""
    spec = EDGE_SHAPES["three-chunks"]
    inputs = spec.make_inputs(seed=11)
    ref = spec.reference(inputs)
    bad_states = ref["prev_states"].copy()
    bad_states[0, 1, 0, 0, 0] += 1e-6
    y_bad = R.chunk_scan(inputs["B"], inputs["C"], inputs["x"], ref["dt_out"], ref["dA_cumsum"],
                         bad_states)
    with pytest.raises(AssertionError, match="error"):
        assert_close(y_bad, ref["y"], "y from a perturbed prev_states")
    y = ref["y"].copy()
    y[1, 50, 2, 3] += 1e-9 * np.abs(y).max()  # tiny and local: rel ~ 1e-11
    with pytest.raises(AssertionError):
        assert_close(y, ref["y"], "one element off")


# ---- property-based: random shapes and features --------------------------------------------------


@st.composite
def specs(draw):
    q = draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    l = draw(st.integers(1, 48))
    g = draw(st.integers(1, 3))
    h = g * draw(st.integers(1, 3))
    b = draw(st.integers(1, 2))
    boundaries = ()
    if draw(st.booleans()):
        row = st.lists(st.integers(0, l - 1), max_size=4, unique=True).map(lambda r: tuple(sorted(r)))
        boundaries = tuple(draw(row) for _ in range(b))
    lo = draw(st.sampled_from([0.0, 0.0, 0.002, 0.01]))
    hi = draw(st.sampled_from([np.inf, 0.05, 0.1]))
    return ProblemSpec(
        batch=b, seqlen=l, nheads=h, headdim=draw(st.integers(1, 8)),
        dstate=draw(st.integers(1, 8)), ngroups=g, chunk_size=q,
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        dt_bias=draw(st.booleans()), dt_softplus=draw(st.booleans()), dt_limit=(lo, hi),
        initial_states=draw(st.booleans()), seq_boundaries=boundaries, name="hypothesis",
    )


@settings(max_examples=100, deadline=None)
@given(spec=specs(), seed=st.integers(0, 2**32 - 1))
def test_rungs_agree_on_random_problems(spec, seed):
    assert_rungs_agree(spec, spec.make_inputs(seed))


# ---- bad inputs: each raises a clear error that names the argument ---------------------------


def _valid():
    spec = EDGE_SHAPES["all-features"].replace(batch=2, seqlen=40, nheads=4, ngroups=1,
                                               headdim=6, dstate=8, chunk_size=16,
                                               seq_boundaries=((5,), (0, 20)))
    return spec.make_inputs(seed=12)  # b=2 l=40 h=4 p=6 n=8 g=1


def _with(**changes):
    def modify(kw):
        for key, fn in changes.items():
            kw[key] = fn(kw)
        return kw
    return modify


BAD_INPUTS = [
    # (id, modification, exception, message regex)
    ("x-rank", _with(x=lambda k: k["x"][..., 0]), ValueError, r"^x: expected shape \(b, l, h, p\), got \(2, 40, 4\)"),
    ("dt-rank", _with(dt=lambda k: k["dt"][..., None]), ValueError, r"^dt: expected shape \(b, l, h\)"),
    ("A-shape", _with(A=lambda k: k["A"][:2]), ValueError, r"^A: .*nheads h=2 does not match h=4 from x"),
    ("A-2d", _with(A=lambda k: k["A"][:, None]), ValueError, r"^A: expected shape \(h,\) = \(4,\)"),
    ("B-rank", _with(B=lambda k: k["B"][:, :, 0]), ValueError,
     r"^B: expected shape \(b, l, g, n\) = \(2, 40, g, n\), got \(2, 40, 8\)"),
    ("batch-mismatch", _with(dt=lambda k: np.concatenate([k["dt"], k["dt"][:1]])), ValueError,
     r"^dt: .*batch b=3 does not match b=2 from x"),
    ("length-mismatch", _with(B=lambda k: k["B"][:, :-1]), ValueError, r"^B: .*seqlen l=39 does not match l=40"),
    ("groups-mismatch", _with(C=lambda k: np.concatenate([k["C"], k["C"]], axis=2)), ValueError,
     r"^C: expected shape \(b, l, g, n\) = \(2, 40, 1, 8\), got \(2, 40, 2, 8\) \(ngroups"),
    ("dstate-mismatch", _with(C=lambda k: k["C"][..., :5]), ValueError, r"^C: .*dstate n=5 does not match n=8"),
    ("heads-not-divisible", _with(B=lambda k: np.repeat(k["B"], 3, axis=2),
                                  C=lambda k: np.repeat(k["C"], 3, axis=2)), ValueError,
     r"^B: nheads h=4 .* not divisible by ngroups g=3"),
    ("A-positive", _with(A=lambda k: np.abs(k["A"])), ValueError, r"^A: must be <= 0"),
    ("x-nan", _with(x=lambda k: np.where(np.arange(6) == 3, np.nan, k["x"])), ValueError, r"^x: contains NaN"),
    ("B-inf", _with(B=lambda k: np.where(np.arange(8) == 0, np.inf, k["B"])), ValueError, r"^B: contains NaN or inf"),
    ("dt-nan", _with(dt=lambda k: k["dt"] * np.nan), ValueError, r"^dt: contains NaN"),
    ("x-complex", _with(x=lambda k: k["x"] + 0j), TypeError, r"^x: expected a real-valued array"),
    ("x-strings", _with(x=lambda k: k["x"].astype(str)), TypeError, r"^x: expected a real-valued array"),
    ("x-empty", _with(x=lambda k: k["x"][:, :0]), ValueError, r"^x: every dimension must be >= 1"),
    ("seq_idx-decreasing", _with(seq_idx=lambda k: k["seq_idx"][:, ::-1].copy()), ValueError,
     r"^seq_idx: must be non-decreasing"),
    ("seq_idx-negative", _with(seq_idx=lambda k: k["seq_idx"] - 1), ValueError, r"^seq_idx: must be >= 0"),
    ("seq_idx-float", _with(seq_idx=lambda k: k["seq_idx"].astype(float)), TypeError,
     r"^seq_idx: expected an integer array"),
    ("seq_idx-shape", _with(seq_idx=lambda k: k["seq_idx"][:, :-1]), ValueError, r"^seq_idx: .*seqlen l=39"),
    ("D-rank", _with(D=lambda k: k["D"][..., None]), ValueError,
     r"^D: expected shape \(h,\) = \(4,\) or \(h, p\) = \(4, 6\), got \(4, 6, 1\)"),
    ("D-heads", _with(D=lambda k: k["D"][:3, 0]), ValueError, r"^D: .*nheads h=3 does not match h=4"),
    ("D-headdim", _with(D=lambda k: k["D"][:, :5]), ValueError, r"^D: .*headdim p=5 does not match p=6"),
    ("z-shape", _with(z=lambda k: k["z"][:, :, :, :4]), ValueError, r"^z: .*headdim p=4 does not match p=6"),
    ("dt_bias-shape", _with(dt_bias=lambda k: k["dt_bias"][:3]), ValueError, r"^dt_bias: "),
    ("initial_states-shape", _with(initial_states=lambda k: k["initial_states"][..., :4]), ValueError,
     r"^initial_states: .*dstate n=4 does not match n=8"),
    ("dt_limit-reversed", _with(dt_limit=lambda k: (0.1, 0.01)), ValueError,
     r"^dt_limit: expected \(lo, hi\) with 0 <= lo <= hi"),
    ("dt_limit-negative", _with(dt_limit=lambda k: (-0.1, 1.0)), ValueError, r"^dt_limit: "),
    ("dt_limit-nan", _with(dt_limit=lambda k: (np.nan, 1.0)), ValueError, r"^dt_limit: "),
    ("dt_limit-scalar", _with(dt_limit=lambda k: 0.1), TypeError, r"^dt_limit: expected a pair"),
]


@pytest.mark.parametrize("fn", [R.ssd_recurrence, R.ssd_quadratic, R.ssd_chunked],
                         ids=["recurrence", "quadratic", "chunked"])
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_naming_the_argument(fn, case):
    _, modify, exc, pattern = case
    kw = _valid()
    kw["dt_limit"] = (0.002, 0.08)
    kw = modify(kw)
    if fn is R.ssd_chunked:
        kw["chunk_size"] = 16
    with pytest.raises(exc, match=pattern) as info:
        fn(**kw)
    print(f"{case[0]}: {info.value}")


@pytest.mark.parametrize("chunk_size, exc", [(0, ValueError), (-1, ValueError), (16.0, TypeError),
                                             (True, TypeError), ("16", TypeError), (None, TypeError)])
def test_bad_chunk_size(chunk_size, exc):
    kw = _valid()
    with pytest.raises(exc, match=r"^chunk_size: expected a positive int"):
        R.ssd_chunked(**kw, chunk_size=chunk_size)
    with pytest.raises(exc, match=r"^chunk_size: expected a positive int"):
        R.chunk_cumsum(kw["dt"], kw["A"], chunk_size)


def test_numpy_integer_chunk_size_is_accepted():
    kw = _valid()
    assert_close(R.ssd_chunked(**kw, chunk_size=np.int64(16)), R.ssd_chunked(**kw, chunk_size=16), "np.int64")


def test_stage_functions_check_their_intermediates():
    spec = EDGE_SHAPES["seq-idx-mid-chunk"]
    inputs = spec.make_inputs(seed=13)
    ref = spec.reference(inputs)
    B, C, x = inputs["B"], inputs["C"], inputs["x"]
    with pytest.raises(ValueError, match=r"^dt_out: nchunks c=2 but ceil\(l/q\) = ceil\(96/32\) = 3"):
        R.chunk_state(B, x, ref["dt_out"][:, :, :2], ref["dA_cumsum"][:, :, :2])
    with pytest.raises(ValueError, match=r"^dA_cumsum: .*chunk_size q=32 does not match q=16 from chunk_size"):
        R.state_passing(ref["states"], ref["dA_cumsum"], chunk_size=16)
    with pytest.raises(ValueError, match=r"^prev_states: .*nchunks c=2 does not match c=3"):
        R.chunk_scan(B, C, x, ref["dt_out"], ref["dA_cumsum"], ref["prev_states"][:, :2])
    with pytest.raises(ValueError, match=r"^dA_cumsum: .*nheads h=3 does not match h=4"):
        R.chunk_scan(B, C, x, ref["dt_out"], ref["dA_cumsum"][:, :3], ref["prev_states"])
    with pytest.raises(ValueError, match=r"^seq_idx: .*seqlen l=95 does not match l=96"):
        R.chunk_state(B, x, ref["dt_out"], ref["dA_cumsum"], inputs["seq_idx"][:, :-1])


def test_check_shapes_works_on_plain_tuples():
    """The shape logic is shared with the torch wrappers: tuples in, sizes out."""
    dims = R.check_shapes(x=(2, 100, 8, 64), dt=(2, 100, 8), A=(8,), B=(2, 100, 2, 16),
                          C=(2, 100, 2, 16), D=(8, 64), chunk_size=32)
    assert dims == dict(b=2, l=100, h=8, p=64, g=2, n=16, q=32, c=4)
    with pytest.raises(ValueError, match=r"^B: expected shape \(b, l, g, n\) = \(2, 100, g, n\), got \(2, 100, 16\)"):
        R.check_shapes(x=(2, 100, 8, 64), B=(2, 100, 16))
    with pytest.raises(TypeError, match="unknown argument"):
        R.check_shapes(y=(1, 2))
