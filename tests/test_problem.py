"""ProblemSpec: seeded inputs, per-stage references, named and random shapes."""

import math

import numpy as np
import pytest

from ssd import reference as R
from ssd.problem import (BACKWARD_KEYS, EDGE_SHAPES, MODEL_SHAPES, REFERENCE_KEYS, ProblemSpec,
                         random_spec)
from ssd.reference_backward import ssd_chunked_backward

REQUIRED_EDGE_NAMES = {
    "single-chunk", "three-chunks", "l-not-multiple", "l-less-than-q", "ngroups-gt-1",
    "dstate-ne-chunk", "headdim-not-pow2", "initial-states", "seq-idx-mid-chunk", "z-gate",
    "D-per-head", "D-per-channel", "dt-bias-softplus-limit", "all-features",
}


def expected_shapes(spec):
    b, l, h, p, n, g = spec.dims
    c, q = spec.nchunks, spec.chunk_size
    inputs = {"x": (b, l, h, p), "dt": (b, l, h), "A": (h,), "B": (b, l, g, n), "C": (b, l, g, n)}
    if spec.D is not None:
        inputs["D"] = (h,) if spec.D == "h" else (h, p)
    if spec.z:
        inputs["z"] = (b, l, h, p)
    if spec.dt_bias:
        inputs["dt_bias"] = (h,)
    if spec.initial_states:
        inputs["initial_states"] = (b, h, p, n)
    if spec.seq_boundaries:
        inputs["seq_idx"] = (b, l)
    ref = {"dt_out": (b, h, c, q), "dA_cumsum": (b, h, c, q), "states": (b, c, h, p, n),
           "prev_states": (b, c, h, p, n), "final_states": (b, h, p, n), "y": (b, l, h, p)}
    return inputs, ref


def test_edge_shapes_cover_the_required_cases():
    assert REQUIRED_EDGE_NAMES <= set(EDGE_SHAPES)
    for name, spec in EDGE_SHAPES.items():
        assert spec.name == name
    e = EDGE_SHAPES
    assert e["single-chunk"].nchunks == 1 and e["single-chunk"].seqlen == e["single-chunk"].chunk_size
    assert e["three-chunks"].nchunks == 3
    assert e["l-not-multiple"].seqlen % e["l-not-multiple"].chunk_size != 0
    assert e["l-less-than-q"].seqlen < e["l-less-than-q"].chunk_size
    assert e["ngroups-gt-1"].ngroups > 1
    assert e["dstate-ne-chunk"].dstate != e["dstate-ne-chunk"].chunk_size
    p = e["headdim-not-pow2"].headdim
    assert p & (p - 1) != 0
    assert e["D-per-head"].D == "h" and e["D-per-channel"].D == "hp"
    seq = e["seq-idx-mid-chunk"]
    q = seq.chunk_size
    flat = [t for row in seq.seq_boundaries for t in row]
    assert any(t % q != 0 for t in flat) and any(t % q == 0 and t > 0 for t in flat)


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_make_inputs_and_reference_shapes(name):
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=0)
    want_inputs, want_ref = expected_shapes(spec)
    assert {k: v.shape for k, v in inputs.items()} == want_inputs
    for k, v in inputs.items():
        assert v.dtype == (np.int32 if k == "seq_idx" else np.float64), k
        assert np.isfinite(v).all(), k
    ref = spec.reference(inputs)
    assert tuple(ref) == REFERENCE_KEYS
    assert {k: v.shape for k, v in ref.items()} == want_ref
    assert all(v.dtype == np.float64 and np.isfinite(v).all() for v in ref.values())
    # the reference agrees with the one-call chunked function
    y, f = R.ssd_chunked(**inputs, **spec.options, return_final_states=True)
    np.testing.assert_array_equal(ref["y"], y)
    np.testing.assert_array_equal(ref["final_states"], f)


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_reference_backward_keys_and_shapes(name):
    spec = EDGE_SHAPES[name]
    inputs, grads = spec.make_inputs(seed=0), spec.make_output_grads(seed=0)
    shapes, ref_shapes = expected_shapes(spec)
    assert {k: v.shape for k, v in grads.items()} == {"dy": ref_shapes["y"],
                                                      "dfinal_states": ref_shapes["final_states"]}
    dref = spec.reference_backward(inputs, grads)
    has = {"dD": "D", "dz": "z", "ddt_bias": "dt_bias", "dinitial_states": "initial_states"}
    assert tuple(dref) == tuple(k for k in BACKWARD_KEYS if k not in has or has[k] in inputs)
    want = {"dprev_states": ref_shapes["prev_states"], "dstates": ref_shapes["states"],
            "ddt_out": ref_shapes["dt_out"], "ddA_cumsum": ref_shapes["dA_cumsum"],
            **{"d" + k: v for k, v in shapes.items() if k != "seq_idx"}}
    assert {k: v.shape for k, v in dref.items()} == want
    assert all(v.dtype == np.float64 and np.isfinite(v).all() for v in dref.values())
    # the input gradients agree with the one-call chunked backward
    whole = ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                 dfinal_states=grads["dfinal_states"])
    assert whole.keys() <= dref.keys()
    for k, v in whole.items():
        np.testing.assert_array_equal(dref[k], v, err_msg=k)


def test_make_output_grads_is_seeded_and_leaves_inputs_alone():
    spec = EDGE_SHAPES["all-features"]
    a, b, c = spec.make_output_grads(0), spec.make_output_grads(0), spec.make_output_grads(1)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert not np.array_equal(a[k], c[k]), k
    assert not np.array_equal(a["dy"], spec.make_inputs(0)["x"])  # streams of their own
    assert all(v.dtype == np.float16 for v in spec.make_output_grads(0, np.float16).values())


def test_make_inputs_is_seeded_and_streams_are_independent():
    spec = EDGE_SHAPES["all-features"]
    a, b, c = spec.make_inputs(0), spec.make_inputs(0), spec.make_inputs(1)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        if k != "seq_idx":
            assert not np.array_equal(a[k], c[k]), k
    # switching a feature on does not change the other arrays
    plain = spec.replace(z=False, D=None).make_inputs(0)
    for k in plain:
        np.testing.assert_array_equal(plain[k], a[k])


def test_make_inputs_dtype():
    spec = EDGE_SHAPES["all-features"]
    inputs = spec.make_inputs(0, dtype=np.float16)
    assert all(v.dtype == (np.int32 if k == "seq_idx" else np.float16) for k, v in inputs.items())
    np.testing.assert_array_equal(inputs["x"], spec.make_inputs(0)["x"].astype(np.float16))
    ref = spec.reference(inputs)  # the exact reference of the rounded inputs
    assert ref["y"].dtype == np.float64
    y16 = R.ssd_recurrence(**inputs, dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
    assert np.linalg.norm(y16 - ref["y"]) / np.linalg.norm(ref["y"]) < 1e-12


@pytest.mark.parametrize("name", ["three-chunks", "dt-bias-softplus-limit", "all-features",
                                  "D-per-head"])
def test_input_magnitudes_are_realistic(name):
    """dt' in [1e-3, 1e-1] (the limit may narrow it), A in [-16, -1], y of order one."""
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=3)
    dt = R.prepare_dt(inputs["dt"], inputs.get("dt_bias"), spec.dt_softplus, spec.dt_limit)
    lo, hi = spec.dt_limit
    if spec.dt_softplus and spec.dt_bias:  # bias-centred noise spreads dt' a bit wider
        assert np.median(dt) > max(lo, 1e-4) * 0.999 and np.median(dt) < min(hi, 0.3)
    else:
        assert dt.min() >= max(lo, 1e-3) * (1 - 1e-9) and dt.max() <= min(hi, 0.2)
    A = inputs["A"]
    assert (A <= -1).all() and (A >= -16).all()
    y = spec.reference(inputs)["y"]
    print(f"{name}: std(y) = {y.std():.3f}, dt' in [{dt.min():.2e}, {dt.max():.2e}]")
    assert 0.05 < y.std() < 20


def test_seq_idx_from_boundaries():
    spec = EDGE_SHAPES["seq-idx-mid-chunk"]  # rows (5, 32, 70) and (0, 40, 41, 95), l = 96
    seq = spec.seq_idx()
    assert seq.dtype == np.int32 and seq.shape == (2, 96)
    assert seq[0, :5].tolist() == [0] * 5 and seq[0, 5] == 1 and seq[0, 32] == 2 and seq[0, 95] == 3
    assert seq[1, 0] == 1 and seq[1, 40] == 2 and seq[1, 41] == 3 and seq[1, 94] == 3 and seq[1, 95] == 4
    shared = spec.replace(seq_boundaries=(10, 20))  # one tuple of ints: the same for every row
    s = shared.seq_idx()
    assert (s[0] == s[1]).all() and s[0, 9] == 0 and s[0, 10] == 1 and s[0, 20] == 2
    assert spec.replace(seq_boundaries=()).seq_idx() is None
    assert "seq_idx" not in spec.replace(seq_boundaries=()).make_inputs(0)


def test_derived_sizes():
    spec = ProblemSpec(3, 100, 8, 48, 24, ngroups=2, chunk_size=32)
    assert spec.dims == (3, 100, 8, 48, 24, 2)
    assert (spec.dims.b, spec.dims.l, spec.dims.g) == (3, 100, 2)
    assert spec.nchunks == 4 and spec.x_numel == 3 * 100 * 8 * 48
    assert spec.options == {"chunk_size": 32, "dt_softplus": False, "dt_limit": (0.0, math.inf)}
    assert "b=3 l=100 h=8 p=48 n=24 g=2 q=32" in str(spec)
    hash(spec)  # frozen: usable as a dict key / test id
    with pytest.raises(Exception):
        spec.batch = 4


@pytest.mark.parametrize("changes, pattern", [
    (dict(nheads=6, ngroups=4), r"not divisible by ngroups"),
    (dict(chunk_size=0), r"^chunk_size"),
    (dict(batch=0), r"^batch"),
    (dict(D="p"), r"^D: expected None, 'h' or 'hp'"),
    (dict(dt_limit=(0.2, 0.1)), r"^dt_limit"),
    (dict(seq_boundaries=(5, 3)), r"^seq_boundaries: .*strictly increasing"),
    (dict(seq_boundaries=(5, 100)), r"^seq_boundaries: .*\[0, 100\)"),
    (dict(seq_boundaries=((1,), (2,), (3,))), r"^seq_boundaries: 3 rows given, expected batch = 2"),
])
def test_invalid_specs_are_rejected(changes, pattern):
    base = dict(batch=2, seqlen=100, nheads=4, headdim=16, dstate=16)
    with pytest.raises((ValueError, TypeError), match=pattern):
        ProblemSpec(**{**base, **changes})


def test_model_shapes():
    table = {
        "130m": (8, 2048, 24, 64, 128, 1),
        "2.7b": (4, 4096, 80, 64, 128, 1),
        "long-16k": (1, 16384, 80, 64, 128, 1),
        "codestral-7b": (2, 8192, 128, 64, 128, 8),
        "small-state": (16, 1024, 32, 64, 64, 1),
    }
    assert {k: tuple(v.dims) for k, v in MODEL_SHAPES.items()} == table
    for name, spec in MODEL_SHAPES.items():
        assert spec.name == name and spec.seqlen % spec.chunk_size == 0


def test_random_specs_are_valid_varied_and_fast():
    import time

    rng = np.random.default_rng(2024)
    specs = [random_spec(rng) for _ in range(200)]
    assert len({(s.dims, s.chunk_size) for s in specs}) > 150
    assert any(s.seqlen % s.chunk_size for s in specs) and any(s.seqlen < s.chunk_size for s in specs)
    assert any(s.seq_boundaries for s in specs) and any(s.ngroups > 1 for s in specs)
    assert {s.D for s in specs} == {None, "h", "hp"}
    worst = 0.0
    for i, spec in enumerate(specs[:25]):
        inputs = spec.make_inputs(seed=i)
        start = time.perf_counter()
        ref = spec.reference(inputs)
        worst = max(worst, time.perf_counter() - start)
        y = R.ssd_recurrence(**inputs, dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
        assert np.linalg.norm(y - ref["y"]) / np.linalg.norm(ref["y"]) < 1e-12, str(spec)
    print(f"slowest float64 reference: {worst * 1e3:.1f} ms")
    assert worst < 1.0


def test_random_spec_is_reproducible():
    a = [random_spec(np.random.default_rng(7)) for _ in range(2)]
    assert a[0] == a[1]
