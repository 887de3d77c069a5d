"""The decode step on the CPU: its float64 reference is one step of the ladder's recurrence, its
forms and errors, the GPU tests' elementwise bounds against an fp32 emulation of the kernel, and
the public function's argument checks.

The kernel itself compiles in tests/test_aot.py and runs in tests/test_gpu_decode.py.
"""
import math

import numpy as np
import pytest

from ssd import reference as R
from ssd.problem import EDGE_SHAPES, ProblemSpec

# ---- the reference step is the recurrence's step ------------------------------------------


def decode_all(spec, inputs):
    """The whole sequence token by token through ``R.selective_state_update``, the state kept
    between calls and reset to zero where seq_idx starts a new sequence (as a serving engine
    starts each request from a zero state). Returns y (b, l, h, p) and every state."""
    b, l, h, p, n, g = spec.dims
    state = inputs.get("initial_states", np.zeros((b, h, p, n)))
    prev = np.zeros(b, dtype=np.int64)  # the virtual seq_idx[-1] = 0
    ys, states = [], []
    for t in range(l):
        if "seq_idx" in inputs:
            seq = inputs["seq_idx"][:, t]
            state = np.where((seq != prev)[:, None, None, None], 0.0, state)
            prev = seq
        z = inputs["z"][:, t] if "z" in inputs else None
        y, state = R.selective_state_update(
            state, inputs["x"][:, t], inputs["dt"][:, t], inputs["A"], inputs["B"][:, t],
            inputs["C"][:, t], D=inputs.get("D"), z=z, dt_bias=inputs.get("dt_bias"),
            dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
        ys.append(y)
        states.append(state)
    return np.stack(ys, axis=1), np.stack(states, axis=1)


def assert_close(actual, expected, name, rtol=1e-12):
    """Relative Frobenius error and max-abs error (scaled by max(1, max|expected|)), as
    tests/test_reference.py compares the rungs."""
    err = actual - expected
    rel = np.linalg.norm(err) / np.linalg.norm(expected)
    max_abs = float(np.abs(err).max())
    print(f"{name}: rel {rel:.2e}, max-abs {max_abs:.2e}")
    assert rel <= rtol and max_abs <= rtol * max(1.0, float(np.abs(expected).max())), name


@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_decoding_token_by_token_is_the_recurrence(name):
    """Every edge shape (D per head and per channel, z, dt_bias, softplus, limits, groups,
    initial states, packed sequences) decoded one token at a time through the decode step's
    reference gives the recurrence's y and every state: ``R.recurrence_step`` is the step of
    ``R.ssd_recurrence``'s loop, up to float64 round-off (the rungs' tolerance: a wrong decay,
    write or read-out moves them by 1e-4 or more)."""
    spec = EDGE_SHAPES[name]
    inputs = spec.make_inputs(seed=3)
    y, states = decode_all(spec, inputs)
    flags = dict(dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
    assert_close(y, R.ssd_recurrence(**inputs, **flags), f"{name} y")
    no_gate = {k: v for k, v in inputs.items() if k not in ("D", "z")}
    assert_close(states, R.recurrence_states(**no_gate, **flags), f"{name} states")


def test_a_step_after_a_prefill_is_the_forward_one_token_longer():
    """The serving relation: the chunked forward's final state over l tokens, advanced by one
    decode step, gives what the chunked forward computes over l + 1 tokens (its last output and
    final state), to float64 round-off (rungs agree to 1e-12, tests/test_reference.py)."""
    spec = ProblemSpec(2, 97, 6, 16, 12, 3, chunk_size=32, D="hp", z=True, dt_bias=True,
                       dt_softplus=True, initial_states=True, name="prefill-then-step")
    inputs = spec.make_inputs(seed=5)
    head = {k: (v[:, :-1] if k in ("x", "dt", "B", "C", "z") else v) for k, v in inputs.items()}
    _, state = R.ssd_chunked(**head, **spec.options, return_final_states=True)
    y, state = R.selective_state_update(
        state, inputs["x"][:, -1], inputs["dt"][:, -1], inputs["A"], inputs["B"][:, -1],
        inputs["C"][:, -1], D=inputs["D"], z=inputs["z"][:, -1], dt_bias=inputs["dt_bias"],
        dt_softplus=True, dt_limit=spec.dt_limit)
    y_all, final = R.ssd_chunked(**inputs, **spec.options, return_final_states=True)
    np.testing.assert_allclose(y, y_all[:, -1], rtol=1e-12, atol=1e-12 * np.abs(y).max())
    np.testing.assert_allclose(state, final, rtol=1e-12, atol=1e-12 * np.abs(final).max())


# ---- the reference's forms and its paged cache --------------------------------------------

B_, H, P, N, G = 3, 4, 5, 6, 2


def step_inputs(seed=0, slots=None):
    """Inputs of one decode step in their per-head forms (state of ``slots`` rows if given)."""
    rng = np.random.default_rng(seed)
    return dict(state=rng.normal(size=(slots or B_, H, P, N)), x=rng.normal(size=(B_, H, P)),
                dt=rng.normal(size=(B_, H)), A=-rng.uniform(0.5, 4, size=H),
                B=rng.normal(size=(B_, G, N)), C=rng.normal(size=(B_, G, N)),
                D=rng.normal(size=H), z=rng.normal(size=(B_, H, P)), dt_bias=rng.normal(size=H))


def test_per_head_forms_are_their_broadcasts():
    """dt (b, h), A (h,), D and dt_bias (h,) mean the full forms they broadcast to, which is
    how mamba_ssm's Mamba-2 layer passes them (expanded views)."""
    args = step_inputs()
    full = dict(args, dt=np.repeat(args["dt"][..., None], P, -1),
                A=np.broadcast_to(args["A"][:, None, None], (H, P, N)),
                D=np.repeat(args["D"][:, None], P, -1),
                dt_bias=np.repeat(args["dt_bias"][:, None], P, -1))
    for a, b in zip(R.selective_state_update(**args, dt_softplus=True),
                    R.selective_state_update(**full, dt_softplus=True)):
        np.testing.assert_array_equal(a, b)


def test_per_channel_forms_act_per_channel():
    """A (h, p, n), dt (b, h, p), D and dt_bias (h, p) act per channel: one channel of the full
    forms gives what per-head forms of that channel's values give (bit for bit), and another
    channel differs."""
    rng = np.random.default_rng(1)
    args = step_inputs(1)
    full = dict(args, dt=rng.normal(size=(B_, H, P)), A=-rng.uniform(0.5, 4, size=(H, P, N)),
                D=rng.normal(size=(H, P)), dt_bias=rng.normal(size=(H, P)))
    full["A"][:, 1, :] = full["A"][:, 1, :1]  # constant along n in channel 1: a per-head A
    one = dict(args, dt=full["dt"][:, :, 1], A=full["A"][:, 1, 0], D=full["D"][:, 1],
               dt_bias=full["dt_bias"][:, 1])
    y, state = R.selective_state_update(**full, dt_softplus=True)
    y1, state1 = R.selective_state_update(**one, dt_softplus=True)
    np.testing.assert_array_equal(y[:, :, 1], y1[:, :, 1])
    np.testing.assert_array_equal(state[:, :, 1], state1[:, :, 1])
    assert not np.allclose(state[:, :, 0], state1[:, :, 0])


def test_paged_cache_reads_and_writes_only_its_rows():
    """state_batch_indices: entry i reads and advances row rows[i]; rows no entry names are
    untouched; a negative entry is padding (y = 0). The same as the step on the gathered rows."""
    args = step_inputs(2, slots=7)
    rows = np.array([5, -1, 2])
    y, state = R.selective_state_update(**args, state_batch_indices=rows, dt_softplus=True)
    gathered = dict(args, state=args["state"][[5, 0, 2]])
    y_dense, dense = R.selective_state_update(**gathered, dt_softplus=True)
    np.testing.assert_array_equal(y[[0, 2]], y_dense[[0, 2]])
    assert (y[1] == 0).all()
    np.testing.assert_array_equal(state[[5, 2]], dense[[0, 2]])
    untouched = [0, 1, 3, 4, 6]
    np.testing.assert_array_equal(state[untouched], args["state"][untouched])


def test_dt_is_not_clamped_unless_asked():
    """As mamba_ssm's decode step: dt' = dt + dt_bias may be negative (the state grows);
    dt_limit=(0, inf), the forward's default, clamps it to 0 (the state stays)."""
    args = dict(step_inputs(3), dt=-np.ones((B_, H)), D=None, z=None, dt_bias=None)
    _, grown = R.selective_state_update(**args)
    assert (np.abs(grown) > 0).any() and not np.allclose(grown, args["state"])
    _, kept = R.selective_state_update(**args, dt_limit=(0.0, np.inf))
    np.testing.assert_array_equal(kept, args["state"])


REF_ERRORS = [
    ("state", dict(state=np.zeros((B_, P, N))), "head-less form"),
    ("state", dict(state=np.zeros((B_, H, P, N + 1))), "dstate n=7 does not match"),
    ("x", dict(x=np.zeros((B_, H, P, 1))), "expected shape"),
    ("dt", dict(dt=np.zeros((B_, H, P + 1))), "headdim p=6"),
    ("A", dict(A=np.zeros((H, P))), r"expected shape \(h, p, n\) = \(4, 5, n\) or \(h,\)"),
    ("B", dict(B=np.zeros((B_, 3, N)), C=np.zeros((B_, 3, N))), "not divisible by ngroups"),
    ("C", dict(C=np.zeros((B_, G, N - 1))), "dstate n=5"),
    ("D", dict(D=np.zeros(H + 1)), "nheads h=5"),
    ("dt_bias", dict(dt_bias=np.zeros((H, P, 1))), "expected shape"),
    ("z", dict(z=np.zeros((B_ + 1, H, P))), "batch b=4"),
    ("x", dict(x=np.full((B_, H, P), np.nan)), "contains NaN"),
    ("dt_limit", dict(dt_limit=(-1.0, 1.0)), "0 <= lo <= hi"),
    ("state_batch_indices", dict(state_batch_indices=np.array([0, 1, 3])), "past the state"),
    ("state_batch_indices", dict(state_batch_indices=np.array([1, -1, 1])), "named twice"),
    ("state_batch_indices", dict(state_batch_indices=np.zeros(B_)), "integer array"),
    ("state_batch_indices", dict(state_batch_indices=np.arange(B_ + 1)), "batch b=4"),
]


@pytest.mark.parametrize("name, over, message", REF_ERRORS,
                         ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(REF_ERRORS)])
def test_reference_errors_name_the_argument(name, over, message):
    with pytest.raises((ValueError, TypeError), match=rf"^{name}: .*{message}"):
        R.selective_state_update(**{**step_inputs(), **over})


# ---- the GPU tests' bounds against an fp32 emulation of the kernel ------------------------

torch = pytest.importorskip("torch")


def rounded(a, dtype):
    """``a`` rounded to ``dtype`` (a name), as float64: what the kernel reads."""
    return torch.from_numpy(np.asarray(a, np.float64)).to(getattr(torch, dtype)).double().numpy()


def emulate_kernel(host, dt_softplus, state_dtype, dtype, fault=None):
    """The kernel's arithmetic in NumPy float32, op for op (ssd.kernels.state_update), on the
    per-channel forms; returns (y rounded to ``dtype``, new state rows rounded to
    ``state_dtype``). ``fault`` puts in one mistake a broken kernel could make."""
    f = np.float32
    ops, _ = R.step_operands(**host)  # only to expand the forms; the arithmetic is redone
    d = (np.asarray(host["dt"], f)[..., None] if np.ndim(host["dt"]) == 2
         else np.asarray(host["dt"], f))
    if host.get("dt_bias") is not None:
        bias = np.asarray(host["dt_bias"], f)
        d = d + (bias[:, None] if bias.ndim == 1 else bias)
    if dt_softplus and fault != "no-softplus":
        e = np.exp(np.minimum(d, f(20)))
        u = f(1) + e
        log1p = np.where(u == 1, e, np.log(u) * e / (u - f(1)))
        d = np.where(d <= 20, log1p, d).astype(f)
    d = np.broadcast_to(d, ops.x.shape)
    a = ops.A.astype(f)
    decay = np.exp2(d[..., None] * a * f(math.log2(math.e)))  # LOG2E
    if fault == "no-decay":
        decay = np.ones_like(decay)
    B, C = ops.B.astype(f), ops.C.astype(f)
    if fault == "wrong-group":
        B = np.roll(B, 1, axis=1)
    h1 = ops.state.astype(f) * decay + (d * ops.x.astype(f))[..., None] * B[:, :, None, :]
    stored = rounded(h1, state_dtype)
    read = stored.astype(f) if fault == "y-from-stored-state" else h1
    out = np.sum(read * C[:, :, None, :], axis=-1, dtype=f)
    if ops.D is not None:
        out = out + ops.D.astype(f) * ops.x.astype(f)
    if ops.z is not None and fault != "no-gate":
        z = ops.z.astype(f)
        out = out * z / (f(1) + np.exp(-z))
    return rounded(out, dtype), stored


FAULTS = ("no-decay", "wrong-group", "no-softplus", "no-gate", "y-from-stored-state")


@pytest.mark.parametrize("dtype, state_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                ("bfloat16", "bfloat16"),
                                                ("float16", "float16")])
def test_bounds_hold_for_the_kernels_roundings_and_catch_its_mistakes(dtype, state_dtype):
    """The bounds of ssd.validate.step_bounds on a model-like step (2.7b's head dim and state
    width, two groups, inputs drawn as the benchmark draws them, D, z, bias, softplus): the kernel's fp32
    arithmetic, emulated op for op, meets both criteria everywhere (NumPy's exp and log are
    correctly rounded, the GPU's within the FN_UNITS units the bounds allow them), and each
    fault fails one of them. (y from the stored state is a fault only where that storage
    rounds: it is what mamba_ssm's slow reference computes.)"""
    from ssd.validate import check_step, step_bounds

    rng = np.random.default_rng(11)
    b, h, p, n, g = 8, 16, 64, 128, 2
    host = dict(state=rounded(rng.normal(size=(b, h, p, n)), state_dtype),
                x=rounded(rng.normal(size=(b, h, p)), dtype),
                dt=rounded(0.5 * rng.normal(size=(b, h)), dtype),
                A=-np.exp(rng.uniform(0, np.log(16), size=h)),
                B=rounded(rng.normal(size=(b, g, n)), dtype),
                C=rounded(rng.normal(size=(b, g, n)), dtype), D=rng.normal(size=h),
                z=rounded(rng.normal(size=(b, h, p)), dtype),
                dt_bias=np.log(np.expm1(np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h)))))
    y_ref, state_ref = R.selective_state_update(**host, dt_softplus=True)
    bounds = step_bounds(host, True, None, dtype, state_dtype)
    ok_y, ok_state = emulate_kernel(host, True, state_dtype, dtype)
    checks = (check_step("y", ok_y, y_ref, bounds.y, dtype),
              check_step("state", ok_state, state_ref, bounds.state, state_dtype))
    for c in checks:
        print(f"{dtype}/{state_dtype} {c.key}: rel {c.rel_err:.2e} (tol {c.tol:.0e}), "
              f"worst element {c.ratio:.3f} of its bound")
        assert c.ok, c.failure()
    for fault in FAULTS:
        with np.errstate(over="ignore", invalid="ignore"):  # no-softplus: decays overflow
            y, state = emulate_kernel(host, True, state_dtype, dtype, fault)
        caught = [not check_step("y", y, y_ref, bounds.y, dtype).ok,
                  not check_step("state", state, state_ref, bounds.state, state_dtype).ok]
        print(f"  {fault}: caught by y {caught[0]}, state {caught[1]}")
        if fault == "y-from-stored-state" and state_dtype == "float32":
            assert not any(caught)
        else:
            assert any(caught), fault


# ---- the public function's argument checks ------------------------------------------------

pytest.importorskip("cuda.tile")


def good(**over):
    bf = torch.bfloat16
    args = dict(state=torch.randn(B_, H, P, N), x=torch.randn(B_, H, P, dtype=bf),
                dt=torch.rand(B_, H, dtype=bf), A=-torch.rand(H),
                B=torch.randn(B_, G, N, dtype=bf), C=torch.randn(B_, G, N, dtype=bf))
    args.update(over)
    return args


def validate_step(**args):
    from ssd.decode import validate_step

    return validate_step(**args)


def test_valid_calls_reach_the_device_check():
    """Every form the docstring lists: per head, per channel, broadcast views, a paged cache."""
    full = dict(dt=torch.rand(B_, H, P), A=-torch.rand(H, P, N), D=torch.randn(H, P),
                dt_bias=torch.randn(H, P), z=torch.randn(B_, H, P, dtype=torch.float16))
    views = dict(dt=torch.rand(B_, H)[..., None].expand(B_, H, P),
                 A=(-torch.rand(H))[:, None, None].expand(H, P, N),
                 D=torch.randn(H)[:, None].expand(H, P), dt_bias=torch.randn(H)[:, None].expand(H, P))
    paged = dict(state=torch.randn(9, H, P, N, dtype=torch.bfloat16),
                 state_batch_indices=torch.tensor([8, -1, 0]))
    for over in ({}, full, views, paged, dict(D=torch.randn(H), dt_bias=torch.randn(H))):
        with pytest.raises(ValueError, match=r"^x: must be a CUDA tensor"):
            validate_step(**good(**over))


BAD = [
    ("x", dict(x=[1.0]), TypeError),
    ("x", dict(x=torch.randn(B_, H, P, dtype=torch.float64)), TypeError),
    ("state", dict(state=None), TypeError),
    ("state", dict(state=torch.randn(B_, H, P, N, dtype=torch.float64)), TypeError),
    ("state", dict(state=torch.randn(B_, P, N)), ValueError),  # head-less
    ("state", dict(state=torch.randn(B_, H, N, P).transpose(2, 3)), ValueError),  # strided n
    ("state", dict(state=torch.randn(B_ + 1, H, P, N)), ValueError),
    ("dt", dict(dt=torch.rand(B_, H, P + 1)), ValueError),
    ("A", dict(A=-torch.rand(H, P)), ValueError),
    ("B", dict(B=torch.randn(B_, G, 512), C=torch.randn(B_, G, 512),
               state=torch.randn(B_, H, P, 512)), ValueError),  # dstate above MAX_DSTATE
    ("B", dict(B=torch.randn(B_, 3, N), C=torch.randn(B_, 3, N)), ValueError),  # h % g
    ("C", dict(C=torch.randn(B_, G + 2, N)), ValueError),
    ("D", dict(D=torch.randn(H, P + 1)), ValueError),
    ("z", dict(z=torch.randn(B_, H, P - 1)), ValueError),
    ("dt_bias", dict(dt_bias=torch.randn(H + 1)), ValueError),
    ("state_batch_indices", dict(state_batch_indices=torch.zeros(B_)), TypeError),
    ("state_batch_indices", dict(state_batch_indices=torch.zeros(B_ + 1, dtype=torch.int64)),
     ValueError),
    ("dt_limit", dict(dt_limit=(0.1, 0.01)), ValueError),
    ("dt_limit", dict(dt_limit=5), TypeError),
    ("out", dict(out=torch.empty(B_, H, P)), TypeError),  # not x's dtype
    ("out", dict(out=torch.empty(B_, H, P + 1, dtype=torch.bfloat16)), ValueError),
    ("x", dict(x=torch.randn(B_, H, P, dtype=torch.bfloat16, requires_grad=True)),
     NotImplementedError),
]


@pytest.mark.parametrize("name,over,exc", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(name, over, exc):
    with pytest.raises(exc, match=rf"^{name}\b"):
        validate_step(**good(**over))


VALUE_CASES = {
    "x-nan": ("x", dict(x=torch.full((B_, H, P), float("nan"), dtype=torch.bfloat16)),
              "contains NaN or inf"),
    "state-inf": ("state", dict(state=torch.full((B_, H, P, N), float("inf"))),
                  "contains NaN or inf"),
    "rows-past": ("state_batch_indices", dict(state_batch_indices=torch.tensor([0, 3, -1])),
                  "a row past"),
    "rows-twice": ("state_batch_indices", dict(state_batch_indices=torch.tensor([2, 2, 0])),
                   "a state row is named twice"),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_value_checks_on_request(case):
    name, over, message = VALUE_CASES[case]
    with pytest.raises(ValueError, match=rf"^{name}: {message}"):
        validate_step(**good(**over), check_values=True)
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):  # off by default
        validate_step(**good(**over))


# ---- the benchmark's pieces and its peer -------------------------------------------------


def test_layer_inputs_are_the_layers_views():
    """The benchmark's inputs are what mamba_ssm's Mamba-2 layer passes: per-head A, dt,
    dt_bias and D as views expanded over the head dim (and the state), which the step accepts,
    with dt' = softplus(dt + dt_bias) around Mamba-2's range."""
    from ssd.tools.decode_bench import HEADS, layer_inputs

    args = layer_inputs(HEADS["codestral-7b"], 4, state_dtype="bfloat16", device="cpu")
    assert args["A"].shape == (128, 64, 128) and args["A"].stride()[1:] == (0, 0)
    assert all(args[k].stride(-1) == 0 for k in ("dt", "D", "dt_bias"))
    assert args["state"].dtype == torch.bfloat16 and args["B"].shape == (4, 8, 128)
    dt = torch.nn.functional.softplus(args["dt"].float() + args["dt_bias"])
    assert 1e-4 < dt.median() < 0.1
    with pytest.raises(ValueError, match=r"^x: must be a CUDA tensor"):
        validate_step(**args)


def test_bench_traffic_speedups_and_table():
    from ssd.tools import decode_bench as db

    assert db.state_traffic((2, 80, 64, 128, 1), 4) == 2 * 2 * 80 * 64 * 128 * 4
    rec = lambda impl, ms: dict(shape="2.7b", dims=[8, 80, 64, 128, 1], impl=impl,  # noqa: E731
                                state_dtype="float32", median_ms=ms, state_bytes_per_s=3e12,
                                copy_fraction=0.9)
    payload = dict(records=[rec("ssd", 0.01), rec("mamba_ssm", 0.015)], failures=[],
                   skipped={"tilegym": "not a peer here"}, ceilings=dict(copy_bytes_per_s=3.3e12))
    assert db.speedups(payload["records"]) == {("2.7b", 8, "float32"): pytest.approx(1.5)}
    text = db.table(payload)
    assert "1.50x" in text and "90.0%" in text and "skipped tilegym" in text


@pytest.mark.parametrize("argv", [["--shapes", "7b"], ["--block-p", "3"], ["--impl", "tilegym"]])
def test_bench_rejects_bad_arguments(argv):
    from ssd.tools import decode_bench

    with pytest.raises(SystemExit):
        decode_bench.main(argv)


def test_mamba_ssm_decode_step_loads_without_its_cuda_extension(tmp_path, monkeypatch):
    """mamba_ssm's package __init__ imports its CUDA extension; where that is missing, the peer
    loader imports the Triton submodule alone (ssd.tools.peers)."""
    import sys

    from ssd.tools import peers

    triton = tmp_path / "mamba_ssm" / "ops" / "triton"
    triton.mkdir(parents=True)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda_missing\n")
    (tmp_path / "mamba_ssm" / "ops" / "__init__.py").write_text("")
    (triton / "__init__.py").write_text("")
    (triton / "selective_state_update.py").write_text(
        "def selective_state_update(*args, **kwargs):\n    return 'theirs'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        assert peers.mamba_ssm_state_update()() == "theirs"
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
            del sys.modules[name]
