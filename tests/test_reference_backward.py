"""The NumPy backward ladder: recurrence adjoint == finite differences == torch.autograd, and
chunked backward == recurrence adjoint, stage by stage.

CPU only, float64. Every comparison prints its error and asserts it.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ssd import reference as R
from ssd import reference_backward as RB
from ssd.problem import EDGE_SHAPES, ProblemSpec
from test_reference import assert_close, flags  # the forward ladder's comparison

# Tolerances.
# Rung against rung: both compute in float64 sums of at most a few hundred O(1) products
# with decays <= 1; observed relative errors are 1e-16..1e-14 (dA and ddt_bias, sums over
# every position, are the largest). 1e-12 as for the forward ladder: a wrong mask entry or
# a dropped term changes a gradient by >= 1e-4 relative.
RTOL = 1e-12
# Central differences with step EPS (relative to each input's scale): truncation error
# O(EPS^2) ~ 1e-12, round-off O(1e-16 |loss| / EPS) ~ 1e-10 |loss|; observed <= 2e-8 of the
# derivative's scale (see assert_fd). 1e-6 keeps a wide margin; a wrong slope (sigmoid vs
# 1, a missing clamp mask, a dropped decay term) is off by >= 1e-3.
EPS = 1e-6
FD_RTOL = 1e-6


def recurrence_loss(spec, inputs, grads):
    """loss = <dy, y> + <dfinal_states, final_states>: its gradient is the backward's."""
    y, final = R.ssd_recurrence(**inputs, **flags(spec), return_final_states=True)
    return float((grads["dy"] * y).sum() + (grads["dfinal_states"] * final).sum())


def kink_gap(spec, inputs):
    """(b, l, h): how far dt + dt_bias lies from a kink of the dt transform (the clamp's
    edges, softplus's switch at 20). Central differences across a kink see half a slope."""
    u = inputs["dt"] + inputs.get("dt_bias", 0.0)
    s = np.where(u <= 20, R.softplus(u), u) if spec.dt_softplus else u
    lo, hi = spec.dt_limit
    gap = np.minimum(np.abs(s - lo), np.abs(s - hi) if np.isfinite(hi) else np.inf)
    return np.minimum(gap, np.abs(u - 20)) if spec.dt_softplus else gap


def directional_fd(loss, inputs, name, rng, gap=None):
    """(d loss / d inputs[name]) . v by central differences, and the direction v.

    v is uniform in [-1, 1]. With ``gap`` (from ``kink_gap``), v is 0 on the dt (or the
    dt_bias of heads) that a step could carry across a kink (softplus's slope is <= 1).
    """
    v = rng.uniform(-1.0, 1.0, np.shape(inputs[name]))
    step = EPS * max(1.0, float(np.abs(inputs[name]).max()))
    if gap is not None and name in ("dt", "dt_bias"):
        free = gap > 2 * step  # (b, l, h)
        v = v * (free if name == "dt" else free.all(axis=(0, 1)))
        assert v.any(), f"{name}: every element lies next to a kink"
    plus = loss({**inputs, name: inputs[name] + step * v})
    minus = loss({**inputs, name: inputs[name] - step * v})
    return (plus - minus) / (2 * step), v


def assert_fd(numeric, grad, v, name):
    """The adjoint's directional derivative grad . v against the finite difference, relative
    to the larger of the two and of |grad| rms(v), the size of a derivative along a random
    direction (round-off in the difference is absolute: a derivative that happens to be
    small must not make it look large)."""
    analytic = float((grad * v).sum())
    scale = max(abs(numeric), np.linalg.norm(grad) * np.sqrt(np.mean(v ** 2)))
    err = abs(numeric - analytic) / scale if scale > 0 else abs(numeric - analytic)  # both 0
    print(f"{name}: finite difference {numeric:.10e}, adjoint {analytic:.10e}, rel {err:.1e}")
    assert err <= FD_RTOL, f"{name}: adjoint differs from finite differences by {err:.1e}"


# ---- rung 1: the recurrence adjoint against finite differences ---------------------------

# Tiny shapes with every feature: one finite difference per element of every input.
TINY = {
    "tiny-all-features": ProblemSpec(
        batch=2, seqlen=7, nheads=4, headdim=2, dstate=3, ngroups=2, chunk_size=4, D="hp",
        z=True, dt_bias=True, dt_softplus=True, dt_limit=(0.01, 0.06), initial_states=True,
        seq_boundaries=((3,), (0, 5)), name="tiny-all-features"),
    # default limit (0, inf): the negative dt of position 2 is clamped to 0
    "tiny-negative-dt": ProblemSpec(
        batch=1, seqlen=6, nheads=2, headdim=3, dstate=2, chunk_size=4, D="h",
        initial_states=True, name="tiny-negative-dt"),
}


def tiny_inputs(name):
    spec = TINY[name]
    inputs = spec.make_inputs(seed=0)
    if name == "tiny-negative-dt":
        inputs["dt"][:, 2] = -0.3
    return spec, inputs


@pytest.mark.parametrize("name", list(TINY))
def test_recurrence_adjoint_matches_finite_differences_elementwise(name):
    spec, inputs = tiny_inputs(name)
    grads = spec.make_output_grads(seed=0)
    assert kink_gap(spec, inputs).min() > 10 * EPS  # every element's steps stay clear
    adjoint = RB.ssd_recurrence_backward(grads["dy"], **inputs, **flags(spec),
                                         dfinal_states=grads["dfinal_states"])
    float_inputs = [k for k in inputs if k != "seq_idx"]
    assert sorted(adjoint) == sorted("d" + k for k in float_inputs)
    dt_prime = R.prepare_dt(inputs["dt"], inputs.get("dt_bias"), **flags(spec))
    lo, hi = spec.dt_limit
    assert ((dt_prime == lo) | (dt_prime == hi)).any(), "no step is clamped: the test is weak"
    for key in float_inputs:
        numeric = np.empty_like(inputs[key])
        for i in np.ndindex(inputs[key].shape):
            step = EPS * max(1.0, abs(inputs[key][i]))
            arrays = []
            for sign in (1, -1):
                moved = inputs[key].copy()
                moved[i] += sign * step
                arrays.append(recurrence_loss(spec, {**inputs, key: moved}, grads))
            numeric[i] = (arrays[0] - arrays[1]) / (2 * step)
        assert_close(adjoint["d" + key], numeric, f"{name} d{key}", rtol=FD_RTOL)


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_recurrence_adjoint_matches_finite_differences(name):
    """Every input's gradient, along a random direction, on every named edge shape."""
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=1)
    grads = spec.make_output_grads(seed=1)
    gap = kink_gap(spec, inputs)
    adjoint = RB.ssd_recurrence_backward(grads["dy"], **inputs, **flags(spec),
                                         dfinal_states=grads["dfinal_states"])
    rng = np.random.default_rng(1)
    for key in (k for k in inputs if k != "seq_idx"):
        numeric, v = directional_fd(lambda kw: recurrence_loss(spec, kw, grads), inputs, key,
                                    rng, gap)
        assert_fd(numeric, adjoint["d" + key], v, f"{name} d{key}")


# ---- rung 1 against torch.autograd, and the clamp's edges ---------------------------------


def torch_recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                     seq_idx=None, dt_softplus=False, dt_limit=(0.0, np.inf)):
    """The recurrence in float64 torch, written independently of ssd.reference."""
    import torch
    import torch.nn.functional as F

    u = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        u = torch.where(u <= 20.0, F.softplus(u), u)
    dtp = u.clamp(dt_limit[0], dt_limit[1])  # (b, l, h)
    h, g = x.shape[2], B.shape[2]
    Bh, Ch = B.repeat_interleave(h // g, dim=2), C.repeat_interleave(h // g, dim=2)
    state = (torch.zeros(x.shape[0], h, x.shape[3], B.shape[3], dtype=x.dtype)
             if initial_states is None else initial_states)
    ys, before = [], torch.zeros(x.shape[0], dtype=torch.long)
    for t in range(x.shape[1]):
        if seq_idx is not None:
            state = state * (seq_idx[:, t] == before).to(x.dtype)[:, None, None, None]
            before = seq_idx[:, t]
        decay = torch.exp(dtp[:, t] * A)[..., None, None]
        state = decay * state + torch.einsum("bh,bhp,bhn->bhpn", dtp[:, t], x[:, t], Bh[:, t])
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + (D[:, None] if D.dim() == 1 else D) * x
    if z is not None:
        y = y * F.silu(z)
    return y, state


def torch_gradients(spec, inputs, grads):
    torch = pytest.importorskip("torch")
    tensors = {k: torch.tensor(v, dtype=torch.long if k == "seq_idx" else torch.float64,
                               requires_grad=k != "seq_idx") for k, v in inputs.items()}
    y, final = torch_recurrence(**tensors, **flags(spec))
    loss = (torch.tensor(grads["dy"]) * y).sum() + (torch.tensor(grads["dfinal_states"]) * final).sum()
    loss.backward()
    return {"d" + k: t.grad.numpy() for k, t in tensors.items() if k != "seq_idx"}


@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "D-per-head"])
def test_recurrence_adjoint_matches_torch_autograd(name):
    spec = EDGE_SHAPES[name]
    spec = spec.replace(seqlen=40, seq_boundaries=((5, 32), (0, 20, 21, 39))
                        if spec.seq_boundaries else ())  # shorter: torch's loop is slow
    inputs = spec.make_inputs(seed=2)
    grads = spec.make_output_grads(seed=2)
    want = torch_gradients(spec, inputs, grads)
    got = RB.ssd_recurrence_backward(grads["dy"], **inputs, **flags(spec),
                                     dfinal_states=grads["dfinal_states"])
    assert got.keys() == want.keys()
    for key in want:
        assert_close(got[key], want[key], f"{name} {key} adjoint vs torch.autograd")


def test_clamp_edges_pass_the_gradient_from_inside():
    """The convention: at dt' == lo or hi exactly the gradient is the one from inside the
    interval (as torch.clamp and mamba_ssm's chunk_cumsum backward); strictly outside, 0.
    Central differences at an edge would give half of it, so they cannot decide this."""
    lo, hi = 0.01, 0.05
    spec = ProblemSpec(batch=1, seqlen=6, nheads=2, headdim=2, dstate=2, chunk_size=4,
                       dt_limit=(lo, hi), name="clamp-edges")
    inputs = spec.make_inputs(seed=3)
    tiny = 1e-9
    # positions 0..5: at lo, just inside lo, just below lo, at hi, just inside hi, above hi
    inputs["dt"][0, :, 0] = [lo, lo + tiny, lo - tiny, hi, hi - tiny, hi + tiny]
    grads = spec.make_output_grads(seed=3)

    def ddt(dt):
        return RB.ssd_recurrence_backward(grads["dy"], **{**inputs, "dt": dt}, **flags(spec),
                                          dfinal_states=grads["dfinal_states"])["ddt"][0, :, 0]

    got = ddt(inputs["dt"])
    moved_in = inputs["dt"].copy()
    moved_in[0, [0, 3], 0] = [lo + tiny, hi - tiny]  # the edge positions, just inside
    inside = ddt(moved_in)
    print(f"ddt at the edges {got}, just inside {inside}")
    assert got[2] == 0.0 and got[5] == 0.0  # strictly outside: no gradient
    assert got[0] != 0.0 and got[3] != 0.0
    np.testing.assert_allclose(got[[0, 3]], inside[[0, 3]], rtol=1e-6)  # = from inside
    want = torch_gradients(spec, inputs, grads)["ddt"][0, :, 0]  # torch.clamp's rule
    assert_close(got, want, "ddt at the clamp's edges vs torch.autograd")


def test_prepare_dt_backward_matches_torch():
    """Bias, softplus (with its identity branch above 20) and clamp, one position each."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    dt = np.array([[[-3.0, -0.2, 0.5, 19.0, 20.0, 20.5, 40.0, -7.0]]])  # (1, 1, 8)
    bias = np.array([0.5, 0.1, -0.3, 0.0, 0.0, 0.0, 0.0, 2.0])
    ddtp = np.random.default_rng(4).standard_normal(dt.shape)
    for softplus in (False, True):
        for limit in ((0.0, np.inf), (0.1, 25.0)):
            got = RB.prepare_dt_backward(ddtp, dt, bias, softplus, limit)
            t_dt = torch.tensor(dt, requires_grad=True)
            t_bias = torch.tensor(bias, requires_grad=True)
            u = t_dt + t_bias
            if softplus:
                u = torch.where(u <= 20.0, F.softplus(u), u)
            (u.clamp(*limit) * torch.tensor(ddtp)).sum().backward()
            assert_close(got["ddt"], t_dt.grad.numpy(), f"ddt softplus={softplus} {limit}")
            assert_close(got["ddt_bias"], t_bias.grad.numpy(), f"ddt_bias softplus={softplus}")


# ---- rung 2: each stage's backward against finite differences of its forward --------------


def _stage_inputs(name, seed):
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=seed)
    return spec, inputs, spec.reference(inputs), np.random.default_rng(seed)


STAGE_SHAPES = ["all-features", "seq-idx-mid-chunk", "l-not-multiple"]


def _check_stage(name, forward, backward, args, upstream, keys, gap=None):
    """<upstream, forward(args)>'s finite differences along a random direction per key
    against the stage backward's d<key> (``gap``: see ``directional_fd``)."""
    rng = np.random.default_rng(5)

    def loss(kw):
        out = forward(**kw)
        out = out if isinstance(out, tuple) else (out,)
        return float(sum((u * o).sum() for u, o in zip(upstream, out)))

    adjoint = backward(args)
    for key in keys:
        numeric, v = directional_fd(loss, args, key, rng, gap)
        assert_fd(numeric, adjoint["d" + key], v, f"{name} d{key}")


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_chunk_cumsum_backward(name):
    spec, inputs, ref, rng = _stage_inputs(name, 6)
    up = (rng.standard_normal(ref["dt_out"].shape), rng.standard_normal(ref["dA_cumsum"].shape))
    args = {"dt": inputs["dt"], "A": inputs["A"], "chunk_size": spec.chunk_size,
            "dt_bias": inputs.get("dt_bias"), **flags(spec)}
    keys = [k for k in ("dt", "A", "dt_bias") if args[k] is not None]
    _check_stage(name, R.chunk_cumsum, lambda a: RB.chunk_cumsum_backward(*up, **a), args, up,
                 keys, gap=kink_gap(spec, inputs))


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_chunk_state_backward(name):
    spec, inputs, ref, rng = _stage_inputs(name, 7)
    up = (rng.standard_normal(ref["states"].shape),)
    args = {"B": inputs["B"], "x": inputs["x"], "dt_out": ref["dt_out"],
            "dA_cumsum": ref["dA_cumsum"], "seq_idx": inputs.get("seq_idx")}
    _check_stage(name, R.chunk_state, lambda a: RB.chunk_state_backward(*up, **a), args, up,
                 ["B", "x", "dt_out", "dA_cumsum"])


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_state_passing_backward(name):
    spec, inputs, ref, rng = _stage_inputs(name, 8)
    up = (rng.standard_normal(ref["prev_states"].shape),
          rng.standard_normal(ref["final_states"].shape))
    args = {"states": ref["states"], "dA_cumsum": ref["dA_cumsum"],
            "initial_states": inputs.get("initial_states"), "seq_idx": inputs.get("seq_idx"),
            "chunk_size": spec.chunk_size}
    keys = ["states", "dA_cumsum"] + (["initial_states"] if spec.initial_states else [])
    _check_stage(name, R.state_passing,
                 lambda a: RB.state_passing_backward(up[0], **a, dfinal_states=up[1]),
                 args, up, keys)


@pytest.mark.parametrize("name", STAGE_SHAPES)
def test_chunk_scan_backward(name):
    spec, inputs, ref, rng = _stage_inputs(name, 9)
    up = (rng.standard_normal(ref["y"].shape),)
    args = {"B": inputs["B"], "C": inputs["C"], "x": inputs["x"], "dt_out": ref["dt_out"],
            "dA_cumsum": ref["dA_cumsum"], "prev_states": ref["prev_states"],
            "D": inputs.get("D"), "z": inputs.get("z"), "seq_idx": inputs.get("seq_idx")}
    keys = [k for k in ("B", "C", "x", "dt_out", "dA_cumsum", "prev_states", "D", "z")
            if args[k] is not None]
    _check_stage(name, R.chunk_scan, lambda a: RB.chunk_scan_backward(*up, **a), args, up, keys)


# ---- rung 2 against rung 1 ------------------------------------------------------------------


def assert_backward_rungs_agree(spec, inputs, grads, chunk_size=None):
    want = RB.ssd_recurrence_backward(grads["dy"], **inputs, **flags(spec),
                                      dfinal_states=grads.get("dfinal_states"))
    got = RB.ssd_chunked_backward(grads["dy"], **inputs, chunk_size=chunk_size or spec.chunk_size,
                                  **flags(spec), dfinal_states=grads.get("dfinal_states"))
    assert list(got) == list(want)
    # ddt_bias sums ddt over batch and positions; in another order, and where the sum cancels to
    # far below its terms (3e-12 of it on one drawn problem), its rounding is relative to them
    scale = {"ddt_bias": np.linalg.norm(np.abs(want["ddt"]).sum((0, 1)))} if "ddt_bias" in want \
        else {}
    for key in want:
        assert_close(got[key], want[key], f"{spec.name} q={chunk_size or spec.chunk_size} "
                                          f"{key} chunked vs recurrence", scale=scale.get(key, 0.0))


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_chunked_backward_equals_recurrence_adjoint(name):
    spec = EDGE_SHAPES[name]
    assert_backward_rungs_agree(spec, spec.make_inputs(seed=10), spec.make_output_grads(seed=10))


def test_chunking_does_not_change_the_gradients():
    """Any chunk size, including 1, odd sizes and q > l; and no gradient on final_states."""
    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=11), spec.make_output_grads(seed=11)
    for q in (1, 3, 7, 64, 200):
        assert_backward_rungs_agree(spec, inputs, grads, chunk_size=q)
    assert_backward_rungs_agree(spec, inputs, {"dy": grads["dy"]})


def test_final_states_gradient_alone():
    """dy = 0: only dfinal_states drives the gradients; the skip and gate get none."""
    spec = EDGE_SHAPES["all-features"]
    inputs, grads = spec.make_inputs(seed=12), spec.make_output_grads(seed=12)
    grads["dy"] = np.zeros_like(grads["dy"])
    assert_backward_rungs_agree(spec, inputs, grads)
    got = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                  dfinal_states=grads["dfinal_states"])
    assert not got["dD"].any() and not got["dz"].any() and not got["dC"].any()
    assert np.abs(got["dx"]).max() > 0


@st.composite
def specs(draw):
    q = draw(st.sampled_from([1, 2, 3, 5, 8, 16]))
    l = draw(st.integers(1, 40))
    g = draw(st.integers(1, 3))
    b = draw(st.integers(1, 2))
    boundaries = ()
    if draw(st.booleans()):
        row = st.lists(st.integers(0, l - 1), max_size=4, unique=True).map(lambda r: tuple(sorted(r)))
        boundaries = tuple(draw(row) for _ in range(b))
    return ProblemSpec(
        batch=b, seqlen=l, nheads=g * draw(st.integers(1, 2)), headdim=draw(st.integers(1, 6)),
        dstate=draw(st.integers(1, 6)), ngroups=g, chunk_size=q,
        D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()),
        dt_bias=draw(st.booleans()), dt_softplus=draw(st.booleans()),
        dt_limit=(draw(st.sampled_from([0.0, 0.002, 0.01])), draw(st.sampled_from([np.inf, 0.05]))),
        initial_states=draw(st.booleans()), seq_boundaries=boundaries, name="hypothesis",
    )


@settings(max_examples=60, deadline=None)
@given(spec=specs(), seed=st.integers(0, 2**32 - 1))
@example(spec=ProblemSpec(2, 37, 1, 2, 3, 1, chunk_size=1, dt_bias=True, dt_softplus=True,
                          seq_boundaries=((4, 7, 24, 27),) * 2, name="hypothesis"), seed=0)
def test_backward_rungs_agree_on_random_problems(spec, seed):  # the example: ddt_bias cancels
    assert_backward_rungs_agree(spec, spec.make_inputs(seed), spec.make_output_grads(seed))


# ---- the checks can fail, and bad upstream gradients are refused ---------------------------


def test_a_wrong_gradient_is_caught():
    """Dropping softplus's slope, or the decay's gradient, fails the checks above."""
    spec, inputs = tiny_inputs("tiny-all-features")
    grads = spec.make_output_grads(seed=0)
    good = RB.ssd_recurrence_backward(grads["dy"], **inputs, **flags(spec),
                                      dfinal_states=grads["dfinal_states"])
    rng = np.random.default_rng(13)
    gap = kink_gap(spec, inputs)
    numeric, v = directional_fd(lambda kw: recurrence_loss(spec, kw, grads), inputs, "dt", rng, gap)
    u = inputs["dt"] + inputs["dt_bias"]
    no_slope = good["ddt"] / (1 / (1 + np.exp(-u)))  # as if softplus had slope 1
    with pytest.raises(AssertionError, match="finite differences"):
        assert_fd(numeric, no_slope, v, "ddt without softplus's slope")
    numeric, v = directional_fd(lambda kw: recurrence_loss(spec, kw, grads), inputs, "A", rng)
    with pytest.raises(AssertionError, match="finite differences"):
        assert_fd(numeric, 1.001 * good["dA"], v, "dA off by 0.1%")


@pytest.mark.parametrize("fn", ["recurrence", "chunked"])
def test_bad_upstream_gradients_name_the_argument(fn):
    spec = EDGE_SHAPES["initial-states"]
    inputs, grads = spec.make_inputs(seed=14), spec.make_output_grads(seed=14)
    call = ((lambda dy, **kw: RB.ssd_recurrence_backward(dy, **inputs, **kw)) if fn == "recurrence"
            else (lambda dy, **kw: RB.ssd_chunked_backward(dy, **inputs, **spec.options, **kw)))
    with pytest.raises(ValueError, match=r"^dy: expected shape \(b, l, h, p\) = \(2, 80, 4, 16\), got \(2, 80, 4\)"):
        call(grads["dy"][..., 0])
    with pytest.raises(ValueError, match=r"^dfinal_states: expected shape \(b, h, p, n\) = \(2, 4, 16, 16\)"):
        call(grads["dy"], dfinal_states=grads["dfinal_states"][:, :2])
    bad = grads["dy"].copy()
    bad[0, 3, 1, 2] = np.nan
    with pytest.raises(ValueError, match=r"^dy: contains NaN"):
        call(bad)
    with pytest.raises(ValueError, match=r"^x: expected shape"):  # the forward's checks too
        RB.ssd_recurrence_backward(grads["dy"], **{**inputs, "x": inputs["x"][..., 0]})
