"""The PyTorch backward (ssd.backward) and the autograd Function (ssd.autograd), on the CPU.

* Each stage's backward against its NumPy reference (ssd.reference_backward), float64, to
  1e-12; the composition too, with the forward's intermediates given and recomputed.
* ``torch.autograd.gradcheck`` of the Function, every input, with the float64 NumPy forward
  injected (``ssd.autograd.reference_stages``): the cuTile forward needs a GPU.
* The API's wiring: no gradient required, nothing recorded; gradients in each input's dtype;
  varlen_states' gradient refused; a grouped stage-2 walk's entering states completed.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import autograd as AG  # noqa: E402
from ssd import backward as TB  # noqa: E402
from ssd import reference as R  # noqa: E402
from ssd import reference_backward as RB  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec  # noqa: E402

# Both sides compute the same float64 sums in another order (einsum contractions, group sums
# inside them): observed relative errors 1e-16..2e-15; a wrong mask entry or a dropped term
# changes a gradient by far more than 1e-4.
RTOL = 1e-12
FLOAT_INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def assert_close(got, want, name, rtol=RTOL):
    """Relative Frobenius error and max-abs error (scaled by max(1, max|want|)), printed."""
    got = got.detach().double().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    err = got - want
    norm = np.linalg.norm(want)
    rel = np.linalg.norm(err) / norm if norm > 0 else np.linalg.norm(err)
    max_abs = float(np.abs(err).max()) if err.size else 0.0
    print(f"{name}: rel {rel:.2e}, max-abs {max_abs:.2e}")
    assert rel <= rtol, f"{name}: relative error {rel:.3e} > {rtol:.0e}"
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    assert max_abs <= rtol * scale, f"{name}: max-abs error {max_abs:.3e}"


def tensors(arrays: dict) -> dict:
    """NumPy arrays -> torch tensors (None stays None)."""
    return {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in arrays.items()}


def flags(spec):
    return dict(dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)


def stage_case(name, seed):
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=seed)
    return spec, inputs, spec.reference(inputs), np.random.default_rng(seed)


# ---- each stage against its NumPy reference -------------------------------------------------

STAGE_SHAPES = ["all-features", "seq-idx-mid-chunk", "l-not-multiple", "l-less-than-q"]


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_forward_stages_match_numpy(name):
    """The forward stages in PyTorch: those the backward recomputes with (chunk_cumsum,
    chunk_state, state_passing) and chunk_scan, the fast float64 forward gradcheck runs."""
    spec, inputs, ref, _ = stage_case(name, 20)
    t = tensors(inputs)
    dt_out, dA_cs = TB.chunk_cumsum_torch(t["dt"], t["A"], spec.chunk_size, t.get("dt_bias"),
                                          **flags(spec), dtype=torch.float64)
    assert_close(dt_out, ref["dt_out"], f"{name} dt_out")
    assert_close(dA_cs, ref["dA_cumsum"], f"{name} dA_cumsum")
    states = TB.chunk_state_torch(t["B"], t["x"], dt_out, dA_cs, t.get("seq_idx"))
    assert_close(states, ref["states"], f"{name} states")
    prev, final = TB.state_passing_torch(states, dA_cs, t.get("initial_states"), t.get("seq_idx"))
    assert_close(prev, ref["prev_states"], f"{name} prev_states")
    assert_close(final, ref["final_states"], f"{name} final_states")
    y = TB.chunk_scan_torch(t["B"], t["C"], t["x"], dt_out, dA_cs, prev, t.get("D"), t.get("z"),
                            t.get("seq_idx"))
    assert_close(y, ref["y"], f"{name} y")


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_chunk_scan_backward_matches_numpy(name):
    spec, inputs, ref, rng = stage_case(name, 21)
    dy = rng.standard_normal(ref["y"].shape)
    args = dict(B=inputs["B"], C=inputs["C"], x=inputs["x"], dt_out=ref["dt_out"],
                dA_cumsum=ref["dA_cumsum"], prev_states=ref["prev_states"], D=inputs.get("D"),
                z=inputs.get("z"), seq_idx=inputs.get("seq_idx"))
    want = RB.chunk_scan_backward(dy, **args)
    got = TB.chunk_scan_backward_torch(torch.from_numpy(dy), **tensors(args))
    assert sorted(got) == sorted(want)
    for key in want:
        assert_close(got[key], want[key], f"{name} chunk_scan {key}")


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_state_passing_backward_matches_numpy(name):
    spec, inputs, ref, rng = stage_case(name, 22)
    dprev = rng.standard_normal(ref["prev_states"].shape)
    dfinal = rng.standard_normal(ref["final_states"].shape)
    init, seq = inputs.get("initial_states"), inputs.get("seq_idx")
    want = RB.state_passing_backward(dprev, ref["states"], ref["dA_cumsum"], init, seq,
                                     spec.chunk_size, dfinal_states=dfinal)
    t = tensors(dict(init=init, seq=seq))
    got = TB.state_passing_backward_torch(
        torch.from_numpy(dprev), torch.from_numpy(ref["prev_states"]),
        torch.from_numpy(ref["dA_cumsum"]), t["init"], t["seq"],
        dfinal_states=torch.from_numpy(dfinal))
    assert sorted(got) == sorted(want)
    for key in want:
        assert_close(got[key], want[key], f"{name} state_passing {key}")


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_chunk_state_backward_matches_numpy(name):
    spec, inputs, ref, rng = stage_case(name, 23)
    dstates = rng.standard_normal(ref["states"].shape)
    args = dict(B=inputs["B"], x=inputs["x"], dt_out=ref["dt_out"], dA_cumsum=ref["dA_cumsum"],
                seq_idx=inputs.get("seq_idx"))
    want = RB.chunk_state_backward(dstates, **args)
    got = TB.chunk_state_backward_torch(torch.from_numpy(dstates), **tensors(args))
    assert sorted(got) == sorted(want)
    for key in want:
        assert_close(got[key], want[key], f"{name} chunk_state {key}")


@pytest.mark.parametrize("name", ["all-features", "dt-bias-softplus-limit", "l-not-multiple"])
def test_chunk_cumsum_backward_matches_numpy(name):
    spec, inputs, ref, rng = stage_case(name, 24)
    ddt_out = rng.standard_normal(ref["dt_out"].shape)
    ddA = rng.standard_normal(ref["dA_cumsum"].shape)
    args = dict(dt=inputs["dt"], A=inputs["A"], chunk_size=spec.chunk_size,
                dt_bias=inputs.get("dt_bias"), **flags(spec))
    want = RB.chunk_cumsum_backward(ddt_out, ddA, **args)
    for saved in (None, torch.from_numpy(ref["dt_out"])):  # recomputed, then the forward's
        got = TB.chunk_cumsum_backward_torch(torch.from_numpy(ddt_out), torch.from_numpy(ddA),
                                             **tensors(args), dt_out=saved)
        assert sorted(got) == sorted(want)
        for key in want:
            assert_close(got[key], want[key],
                         f"{name} chunk_cumsum {key} (saved={saved is not None})")


def test_prepare_dt_backward_matches_numpy_at_the_kinks():
    """Bias, softplus (identity above 20, 20 itself on the softplus side) and the clamp's
    edges (the gradient passes at lo and hi, not strictly outside)."""
    dt = np.array([[[-3.0, -0.2, 0.5, 19.0, 20.0, 20.5, 40.0, -7.0, 0.1, 0.2]]])  # (1, 1, 10)
    bias = np.array([0.5, 0.1, -0.3, 0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0])
    ddtp = np.random.default_rng(25).standard_normal(dt.shape)
    for softplus in (False, True):
        for limit in ((0.0, np.inf), (0.1, 25.0), (0.2, 0.5)):
            want = RB.prepare_dt_backward(ddtp, dt, bias, softplus, limit)
            got = TB.prepare_dt_backward_torch(torch.from_numpy(ddtp), torch.from_numpy(dt),
                                               torch.from_numpy(bias), softplus, limit)
            for key in want:
                assert_close(got[key], want[key], f"{key} softplus={softplus} limit={limit}")


# ---- the composition ------------------------------------------------------------------------


RECOMPUTED = ("all-features", "seq-idx-mid-chunk", "initial-states", "l-less-than-q")


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_chunked_backward_matches_numpy(name):
    """Every edge shape with the forward's intermediates given (as the Function saves them);
    some also with everything recomputed (as after the one-kernel forward)."""
    spec = EDGE_SHAPES[name]
    inputs, grads = spec.make_inputs(seed=26), spec.make_output_grads(seed=26)
    want = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                   dfinal_states=grads["dfinal_states"])
    ref = spec.reference(inputs)
    saved = tensors({k: ref[k] for k in ("dt_out", "dA_cumsum", "prev_states")})
    for given in (saved, {}) if name in RECOMPUTED else (saved,):
        got = TB.ssd_chunked_backward_torch(
            torch.from_numpy(grads["dy"]), **tensors(inputs), **spec.options,
            dfinal_states=torch.from_numpy(grads["dfinal_states"]), **given)
        assert list(got) == list(want)
        for key in want:
            assert_close(got[key], want[key], f"{name} {key} (saved={bool(given)})")


def test_chunked_backward_without_dy_or_dfinal_states():
    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=27), spec.make_output_grads(seed=27)
    t = tensors(inputs)
    only_final = TB.ssd_chunked_backward_torch(
        None, **t, **spec.options, dfinal_states=torch.from_numpy(grads["dfinal_states"]))
    want = RB.ssd_chunked_backward(np.zeros_like(grads["dy"]), **inputs, **spec.options,
                                   dfinal_states=grads["dfinal_states"])
    for key in want:
        assert_close(only_final[key], want[key], f"only dfinal_states {key}")
    only_y = TB.ssd_chunked_backward_torch(torch.from_numpy(grads["dy"]), **t, **spec.options)
    want = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options)
    for key in want:
        assert_close(only_y[key], want[key], f"only dy {key}")


# ---- the autograd Function: gradcheck with the float64 forward injected ---------------------


def call(spec, t, *, return_final_states=True, stages=AG.reference_stages, **kw):
    """ssd.autograd.chunk_scan_combined on the float tensors ``t`` (a dict), seq_idx from
    the spec, an injected float64 forward (the NumPy ladder unless ``stages`` says)."""
    seq = spec.seq_idx()
    return AG.chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], spec.chunk_size, D=t.get("D"), z=t.get("z"),
        dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"),
        seq_idx=None if seq is None else torch.from_numpy(seq), **flags(spec),
        return_final_states=return_final_states, stages=stages, **kw)


def kink_gap(spec, inputs):
    """How far dt + dt_bias lies from a kink of the dt transform (the clamp's edges,
    softplus's switch at 20): a finite difference across one sees half a slope."""
    u = inputs["dt"] + inputs.get("dt_bias", 0.0)
    s = np.where(u <= 20, R.softplus(u), u) if spec.dt_softplus else u
    lo, hi = spec.dt_limit
    gap = np.minimum(np.abs(s - lo), np.abs(s - hi) if np.isfinite(hi) else np.inf)
    return float(np.minimum(gap, np.abs(u - 20)).min())


def gradcheck(spec, inputs, outputs=("y", "final_states"), fast_mode=False,
              stages=AG.torch_stages):
    """gradcheck of the selected outputs with respect to every float input, the float64
    PyTorch forward injected by default (checked against the NumPy ladder above; a few times
    faster, and gradcheck runs the forward twice per input element)."""
    names = [k for k in FLOAT_INPUTS if k in inputs]
    leaves = tuple(torch.from_numpy(inputs[k]).requires_grad_() for k in names)

    def f(*args):
        y, final = call(spec, dict(zip(names, args)), stages=stages)
        return tuple(o for o, k in ((y, "y"), (final, "final_states")) if k in outputs)

    # gradcheck steps by 1e-6 times a direction of entries at most 1: clear of every kink
    assert kink_gap(spec, inputs) > 5e-6
    assert torch.autograd.gradcheck(f, leaves, fast_mode=fast_mode)


# Every input and feature at once on a shape small enough for the full Jacobian: two groups,
# a partial last chunk, a reset mid-chunk and one at position 0, a clamp that clips both ends
# of dt' (some steps at the limits, gradient 0 there), z, D per channel, softplus with a bias.
TINY = ProblemSpec(batch=2, seqlen=6, nheads=4, headdim=2, dstate=2, ngroups=2, chunk_size=4,
                   D="hp", z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.01, 0.06),
                   initial_states=True, seq_boundaries=((3,), (0, 5)), name="tiny")


def test_gradcheck_every_input_full_jacobian():
    inputs = TINY.make_inputs(seed=0)
    dt_prime = R.prepare_dt(inputs["dt"], inputs["dt_bias"], **flags(TINY))
    assert ((dt_prime == 0.01) | (dt_prime == 0.06)).any(), "no step is clamped: the test is weak"
    gradcheck(TINY, inputs)


# Random directions (gradcheck's fast mode) on larger shapes, one feature set each.
FAST = {
    "all-features": (EDGE_SHAPES["all-features"], ("y", "final_states")),
    "seq-idx-mid-chunk": (EDGE_SHAPES["seq-idx-mid-chunk"].replace(seqlen=70, seq_boundaries=(
        (5, 32, 60), (0, 40, 41, 69))), ("y", "final_states")),
    "D-per-head-y-only": (TINY.replace(D="h", z=False, seq_boundaries=(), seqlen=11), ("y",)),
    "final-states-only": (TINY.replace(seqlen=13, chunk_size=8), ("final_states",)),
    "no-options": (ProblemSpec(1, 9, 2, 3, 4, chunk_size=4, name="bare"), ("y", "final_states")),
}


@pytest.mark.parametrize("name", list(FAST))
def test_gradcheck_random_directions(name):
    spec, outputs = FAST[name]
    gradcheck(spec, spec.make_inputs(seed=1), outputs, fast_mode=True)


def test_gradcheck_with_the_numpy_forward():
    """The NumPy ladder itself as the forward, every feature."""
    spec = EDGE_SHAPES["all-features"]
    gradcheck(spec, spec.make_inputs(seed=3), fast_mode=True, stages=AG.reference_stages)


def test_gradcheck_negative_dt_clamped_to_zero():
    """The default limit (0, inf) sends a negative dt' to 0: no gradient reaches that dt."""
    spec = ProblemSpec(1, 6, 2, 3, 2, chunk_size=4, D="h", initial_states=True, name="neg")
    inputs = spec.make_inputs(seed=0)
    inputs["dt"][:, 2] = -0.3
    gradcheck(spec, inputs)
    t = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items()}
    call(spec, t)[0].sum().backward()
    assert (t["dt"].grad[:, 2] == 0).all() and (t["dt"].grad[:, 3] != 0).all()


# ---- dtypes, the API's wiring ---------------------------------------------------------------


def test_gradients_come_back_in_each_inputs_dtype():
    """bf16 x, dt, B, C, z with fp32 A, D, dt_bias, initial_states (as the GPU tests pass
    them): each gradient in its input's dtype, close to the float64 reference of the rounded
    inputs (bf16 output rounding: relative error about 2^-8 / sqrt(3))."""
    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=28), spec.make_output_grads(seed=28)
    low = ("x", "dt", "B", "C", "z")
    t = {k: torch.from_numpy(v).to(torch.bfloat16 if k in low else torch.float32).requires_grad_()
         for k, v in inputs.items() if k != "seq_idx"}
    dy = torch.from_numpy(grads["dy"]).to(torch.bfloat16)
    y, final = call(spec, t)
    assert y.dtype == torch.bfloat16
    torch.autograd.backward([y, final], [dy, torch.from_numpy(grads["dfinal_states"])])
    host = {k: v.detach().double().numpy() for k, v in t.items()} | {"seq_idx": inputs["seq_idx"]}
    want = spec.reference_backward(host, {"dy": dy.double().numpy(),
                                          "dfinal_states": grads["dfinal_states"]})
    for key, leaf in t.items():
        assert leaf.grad.dtype == leaf.dtype, key
        assert_close(leaf.grad, want["d" + key], f"bf16 d{key}", rtol=1e-2)


def test_entering_states_complete_a_grouped_walk():
    """A grouped stage-2 walk stores each group's states from a zero start, with each chunk's
    carry from its group's start and each group's entering state; completed, they are the
    entering states."""
    spec = EDGE_SHAPES["seq-idx-mid-chunk"].replace(seqlen=200,
                                                    seq_boundaries=((5, 70, 150), (0, 100)))
    inputs = spec.make_inputs(seed=29)
    ref = spec.reference(inputs)
    c, G = spec.nchunks, 3
    cpg = -(-c // G)
    decay = np.exp(ref["dA_cumsum"][..., -1])  # (b, h, c)
    seq = inputs["seq_idx"]
    decay = np.where(R._chunk_carry(seq, spec.seqlen, spec.chunk_size)[:, None], decay, 0.0)
    partial = np.empty_like(ref["prev_states"])
    carry = np.empty(decay.shape + (8,))
    for ci in range(c):
        if ci % cpg == 0:
            running, factor = np.zeros_like(ref["final_states"]), np.ones(decay.shape[:2])
        partial[:, ci], carry[:, :, ci] = running, factor[..., None]
        running = decay[:, :, ci, None, None] * running + ref["states"][:, ci]
        factor = factor * decay[:, :, ci]
    enter = ref["prev_states"][:, ::cpg]  # (b, G, h, p, n)
    r = tensors({"prev_states": partial, "chunk_decay": carry, "group_enter": enter})
    assert_close(AG.entering_states(r), ref["prev_states"], "completed entering states", rtol=1e-6)
    assert AG.entering_states({"y": None}) is None
    assert AG.entering_states({"prev_states": r["prev_states"]}) is r["prev_states"]


def test_no_second_derivatives():
    """The saved intermediates carry no graph: differentiating the backward raises instead of
    returning a wrong second derivative."""
    spec = ProblemSpec(1, 9, 2, 3, 4, chunk_size=4, name="bare")
    t = {k: torch.from_numpy(v).requires_grad_() for k, v in spec.make_inputs(seed=34).items()}
    (dx,) = torch.autograd.grad(call(spec, t)[0].sum(), [t["x"]], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice|does not require grad"):
        torch.autograd.grad(dx.sum(), [t["x"]])


def test_varlen_states_return_but_refuse_a_gradient():
    spec = ProblemSpec(1, 40, 2, 4, 3, chunk_size=16, initial_states=True,
                       seq_boundaries=(10, 25), name="packed")
    inputs = spec.make_inputs(seed=30)
    t = {k: torch.from_numpy(v).requires_grad_() for k, v in inputs.items() if k != "seq_idx"}
    cu = torch.from_numpy(spec.cu_seqlens())
    y, final, varlen = call(spec, t, cu_seqlens=cu, return_varlen_states=True)
    assert varlen.shape == (3, 2, 4, 3)
    y.sum().backward(retain_graph=True)  # y's gradient flows
    assert t["x"].grad is not None
    with pytest.raises(NotImplementedError, match="^varlen_states"):
        varlen.sum().backward()


@pytest.fixture
def cpu_api(monkeypatch):
    """ssd.api with the float64 NumPy forward, no device check and no plans (every call runs
    forward_stages): its grad/no-grad wiring on the CPU. Returns the list of forward calls."""
    from ssd import api

    calls = []

    def stages(*args, **kw):
        calls.append(kw)
        return AG.reference_stages(*args, **kw)

    monkeypatch.setattr(api, "forward_stages", stages)
    monkeypatch.setattr(api, "validate", lambda *a, **k: None)
    monkeypatch.setattr(api, "plan_key", lambda *a, **k: None)
    return calls


def api_call(spec, t, **kw):
    from ssd import api

    seq = spec.seq_idx()
    return api.mamba_chunk_scan_combined(
        t["x"], t["dt"], t["A"], t["B"], t["C"], spec.chunk_size, D=t.get("D"), z=t.get("z"),
        dt_bias=t.get("dt_bias"), initial_states=t.get("initial_states"),
        seq_idx=None if seq is None else torch.from_numpy(seq), **flags(spec), **kw)


def test_api_without_a_gradient_records_nothing(cpu_api, monkeypatch):
    spec = EDGE_SHAPES["all-features"]
    inputs = spec.make_inputs(seed=31)
    t = {k: torch.from_numpy(v) for k, v in inputs.items() if k != "seq_idx"}

    def refuse(*a, **k):
        raise AssertionError("the autograd Function ran without a gradient required")

    monkeypatch.setattr(AG.ChunkScanCombined, "apply", refuse)
    y, final = api_call(spec, t, return_final_states=True)
    assert y.grad_fn is None and final.grad_fn is None and len(cpu_api) == 1
    leaves = {k: v.clone().requires_grad_() for k, v in t.items()}
    with torch.no_grad():
        assert api_call(spec, leaves).grad_fn is None
    with torch.inference_mode():
        assert api_call(spec, leaves).grad_fn is None
    assert len(cpu_api) == 3


def test_api_with_a_gradient_runs_the_function(cpu_api):
    """Only A requires grad (as when x comes from a frozen layer): the call is recorded, dA
    is the reference's, and the forward got the same arguments as without a gradient."""
    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=32), spec.make_output_grads(seed=32)
    t = {k: torch.from_numpy(v) for k, v in inputs.items() if k != "seq_idx"}
    plain = api_call(spec, t, return_final_states=True)
    t["A"].requires_grad_()
    y, final = api_call(spec, t, return_final_states=True)
    assert type(y.grad_fn).__name__ == "ChunkScanCombinedBackward"
    assert torch.equal(y, plain[0]) and torch.equal(final, plain[1])
    assert cpu_api[0].keys() == cpu_api[1].keys()
    torch.autograd.backward([y, final], [torch.from_numpy(grads["dy"]),
                                         torch.from_numpy(grads["dfinal_states"])])
    want = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                   dfinal_states=grads["dfinal_states"])
    assert_close(t["A"].grad, want["dA"], "dA through the API")
    assert t["x"].grad is None


def test_check_gradient_catches_what_the_norm_misses():
    """ssd.validate.check_gradient: bf16-sized rounding passes; one zeroed tile of 64 elements
    among 2^20, invisible to the norm (2^-7 relative), fails the elementwise criterion; an
    unwritten (NaN) element fails both."""
    from ssd.validate import GRAD_TOL, check_gradient

    rng = np.random.default_rng(33)
    ref = rng.standard_normal((16, 256, 256))
    rounded = ref * (1 + rng.uniform(-2.0**-8, 2.0**-8, ref.shape))
    assert check_gradient("dx", rounded, ref, "bfloat16").ok
    tile = rounded.copy()
    tile[3, 8:16, 8:16] = 0.0
    check = check_gradient("dx", tile, ref, "bfloat16")
    assert check.rel_err < GRAD_TOL["bfloat16"] and not check.ok
    assert check.elem_index[0] == 3 and 8 <= check.elem_index[1] < 16
    unwritten = rounded.copy()
    unwritten[0, 0, 0] = np.nan
    check = check_gradient("dx", unwritten, ref, "bfloat16")
    assert check.rel_err == np.inf and check.elem_ratio == np.inf and "dx" in check.failure()


def test_a_summed_gradient_is_measured_against_its_terms():
    """A sum whose terms cancel: rounding each term in bf16 moves it by far more than GRAD_TOL
    of its value, within GRAD_TOL of the terms' norm (``scale``); a dropped term fails."""
    from ssd.validate import check_gradient

    rng = np.random.default_rng(8)
    terms = rng.standard_normal(500)
    terms -= terms.mean() - 1e-3  # the sum cancels to 1e-3 * 500 = 0.5 of terms of size ~1
    ref = np.array([terms.sum()])
    scale = np.array([np.linalg.norm(terms)])
    rounded = np.array([(terms * (1 + rng.uniform(-2.0**-8, 2.0**-8, terms.shape))).sum()])
    assert not check_gradient("dA", rounded, ref, "bfloat16").ok
    assert check_gradient("dA", rounded, ref, "bfloat16", scale).ok
    dropped = np.array([terms[1:].sum()])
    assert abs(terms[0]) > 0.5 and not check_gradient("dA", dropped, ref, "bfloat16", scale).ok


def test_sum_scales_are_the_norms_of_the_terms_summed():
    """ssd.validate.sum_scales on a problem with every summed gradient: dA's terms (ddA_cumsum
    times the chunk's cumulative dt') add up to dA, and each scale is its terms' 2-norm."""
    from ssd.validate import sum_scales

    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=3), spec.make_output_grads(seed=3)
    want = spec.reference_backward(inputs, grads)
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    scales = sum_scales(spec, t, torch.from_numpy(grads["dy"]), want)
    assert sorted(scales) == ["dA", "dD", "ddt_bias"]
    terms = want["ddA_cumsum"] * np.cumsum(spec.reference(inputs)["dt_out"], axis=-1)
    np.testing.assert_allclose(terms.sum((0, 2, 3)), want["dA"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(scales["dA"], np.sqrt((terms ** 2).sum((0, 2, 3))))
    np.testing.assert_allclose(scales["ddt_bias"], np.sqrt((want["ddt"] ** 2).sum((0, 1))))
    gated = grads["dy"] * R.silu(inputs["z"]) * inputs["x"]
    axes = (0, 1, 3) if want["dD"].ndim == 1 else (0, 1)
    np.testing.assert_allclose(gated.sum(axes), want["dD"], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(scales["dD"], np.sqrt((gated ** 2).sum(axes)))
