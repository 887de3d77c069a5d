"""The Mamba-2 mixer of ssd.layer: backends agree, the whole layer equals a token-by-token
recurrence written here, presets have the benchmark suite's dimensions, errors are clear.

Error metric: relative Frobenius error ||out - ref|| / ||ref||, printed and asserted.
CPU tests run in float64, where every implementation should agree to round-off (~1e-15);
1e-10 leaves room for accumulation order and is still 1e6x below what a wrong term gives
(the mutation tests below show 1e-3 .. 1).
"""
import math
import os
import zlib
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd.tools.bench import SUITES, Shape  # noqa: E402
from ssd.layer import (BACKENDS, PRESET_LAYERS, PRESETS, BackendUnavailable,  # noqa: E402
                        Mamba2Config, Mamba2Mixer, Mamba2Stack, available_backends,
                        backend_function, capture_ssd_calls, config_for_shape, preset,
                        ssd_reference_torch, ssd_replaced, ssd_torch)
from ssd.problem import EDGE_SHAPES  # noqa: E402

F64_TOL = 1e-10


def rel_err(out, ref) -> float:
    out, ref = (np.asarray(t.detach().cpu().double()) if torch.is_tensor(t) else np.asarray(t)
                for t in (out, ref))
    if not np.isfinite(out).all():
        return math.inf
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def check(label, out, ref, tol):
    err = rel_err(out, ref)
    print(f"{label}: rel err {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{label}: rel err {err:.3e} > {tol:.0e}"
    return err


# Small mixers: ngroups 1 and > 1, seqlen a multiple of q, not a multiple, shorter than q.
SMALL = {
    "g1-tail": (Mamba2Config(d_model=32, d_state=8, headdim=16, chunk_size=16, dtype="float64"),
                2, 45),
    "g2-tail": (Mamba2Config(d_model=48, d_state=12, headdim=8, ngroups=2, chunk_size=32,
                             dtype="float64"), 2, 83),
    "g4-exact": (Mamba2Config(d_model=64, d_state=16, headdim=16, ngroups=4, chunk_size=16,
                              dtype="float64"), 1, 64),
    "l-less-than-q": (Mamba2Config(d_model=32, d_state=8, headdim=16, ngroups=2, chunk_size=64,
                                   dtype="float64"), 2, 21),
    "d_conv-2-expand-3": (Mamba2Config(d_model=16, d_state=8, d_conv=2, expand=3, headdim=12,
                                       ngroups=2, chunk_size=16, dtype="float64"), 1, 40),
}


def inputs(config, b, l, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(1000 + seed)
    return torch.randn(b, l, config.d_model, generator=gen, device=device,
                       dtype=torch.float32).to(config.torch_dtype)


# ----------------------------------------------------------------------------- ssd_torch


NO_SEQ_IDX = [name for name, spec in EDGE_SHAPES.items() if not spec.seq_boundaries]


@pytest.mark.parametrize("name", NO_SEQ_IDX + ["all-features-no-seq-idx"])
def test_ssd_torch_matches_numpy_reference(name):
    """The plain-PyTorch chunked SSD == ssd.reference, y and final state, every edge shape."""
    spec = (EDGE_SHAPES[name] if name in EDGE_SHAPES
            else EDGE_SHAPES["all-features"].replace(seq_boundaries=()))
    arrays = spec.make_inputs(seed=3)
    ref = spec.reference(arrays)
    t = {k: torch.from_numpy(v) for k, v in arrays.items()}
    y, final = ssd_torch(**t, **spec.options, return_final_states=True)
    assert y.dtype == torch.float64 and y.shape == ref["y"].shape
    check(f"{name} y", y, ref["y"], 1e-12)
    check(f"{name} final_states", final, ref["final_states"], 1e-12)


def test_ssd_torch_float32_and_reference_wrapper():
    """fp32 inputs: fp32 compute (error ~1e-6, not 1e-15); the NumPy wrapper returns x's dtype."""
    spec = EDGE_SHAPES["all-features"].replace(seq_boundaries=())
    arrays = spec.make_inputs(seed=5)
    ref = spec.reference(arrays)["y"]
    t32 = {k: torch.from_numpy(v).float() for k, v in arrays.items()}
    y32 = ssd_torch(**t32, **spec.options)
    assert y32.dtype == torch.float32
    err = check("fp32 y", y32, ref, 1e-5)
    assert err > 1e-12  # really computed in fp32
    y_ref = ssd_reference_torch(**t32, **spec.options)
    assert y_ref.dtype == torch.float32
    check("reference wrapper", y_ref, ref, 1e-6)


# ----------------------------------------------------------------------------- mixer: backends


@pytest.mark.parametrize("name", list(SMALL))
def test_mixer_torch_backend_equals_reference_backend(name):
    config, b, l = SMALL[name]
    mixer = Mamba2Mixer(config, "torch", seed=1)
    u = inputs(config, b, l)
    out = mixer(u)
    assert out.shape == (b, l, config.d_model) and out.dtype == torch.float64
    ref = mixer.set_backend("reference")(u)
    check(f"{name}: torch vs reference backend", out, ref, F64_TOL)


# ----------------------------------------------------------------------------- mixer: recurrence


def silu(v):
    return v * torch.sigmoid(v)


def recurrent_mixer(m, u, mutation=None):
    """The whole Mamba-2 layer, one token at a time: a conv state (the last d_conv inputs of
    xBC) and an SSM state h (b, heads, p, n) per token. Independent of the module's code: it
    reads only its weights.

    ``mutation`` breaks one piece on purpose (the test that shows the check can fail).
    """
    cfg = m.config
    b, l, _ = u.shape
    H, P, N, G, K = cfg.nheads, cfg.headdim, cfg.d_state, cfg.ngroups, cfg.d_conv
    di, R = cfg.d_inner, cfg.nheads // cfg.ngroups
    W_in, W_out = m.in_proj.weight, m.out_proj.weight  # (d_in_proj, d_model), (d_model, di)
    w_conv, b_conv = m.conv1d.weight[:, 0, :], m.conv1d.bias  # (conv_dim, K), (conv_dim,)
    A = -torch.exp(m.A_log)  # (H,)
    conv_state = torch.zeros(b, cfg.conv_dim, K, dtype=u.dtype)  # inputs t-K+1 .. t
    h = torch.zeros(b, H, P, N, dtype=u.dtype)
    outs = []
    for t in range(l):
        zxbcdt = u[:, t] @ W_in.T  # (b, d_in_proj)
        z, xbc, dt = zxbcdt[:, :di], zxbcdt[:, di:di + cfg.conv_dim], zxbcdt[:, di + cfg.conv_dim:]
        conv_state = torch.cat([conv_state[:, :, 1:], xbc[:, :, None]], dim=2)
        if mutation == "conv-not-causal-aligned":  # newest input at the wrong tap
            xbc = silu((conv_state.flip(-1) * w_conv).sum(-1) + b_conv)
        else:
            xbc = silu((conv_state * w_conv).sum(-1) + b_conv)  # (b, conv_dim)
        x = xbc[:, :di].reshape(b, H, P)
        Bg = xbc[:, di:di + G * N].reshape(b, G, N)
        Cg = xbc[:, di + G * N:].reshape(b, G, N)
        if mutation == "B-C-swapped":
            Bg, Cg = Cg, Bg
        group = torch.arange(H) // R  # head -> its group of B and C
        if mutation == "heads-groups-interleaved":  # head i -> group i % G instead of i // R
            group = torch.arange(H) % G
        Bh, Ch = Bg[:, group], Cg[:, group]  # (b, H, N)
        step = torch.log1p(torch.exp(dt + m.dt_bias))  # softplus; (b, H)
        write = step[..., None, None] * x[..., None] * Bh[:, :, None, :]  # dt' x B^T: (b, H, P, N)
        h = torch.exp(step * A)[..., None, None] * h + write
        y = (h * Ch[:, :, None, :]).sum(-1) + m.D[:, None] * x  # (b, H, P)
        v = y.reshape(b, di) * silu(z)
        if mutation == "norm-over-full-width":
            v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + 1e-5)
        else:  # per group of di/G channels
            vg = v.reshape(b, G, di // G)
            v = (vg * torch.rsqrt(vg.square().mean(-1, keepdim=True) + 1e-5)).reshape(b, di)
        outs.append((v * m.norm.weight) @ W_out.T)
    return torch.stack(outs, dim=1)  # (b, l, d_model)


@pytest.mark.parametrize("name", list(SMALL))
def test_mixer_equals_token_by_token_recurrence(name):
    config, b, l = SMALL[name]
    mixer = Mamba2Mixer(config, "torch", seed=2)
    u = inputs(config, b, l, seed=1)
    check(f"{name}: chunked layer vs recurrence", mixer(u), recurrent_mixer(mixer, u), F64_TOL)


@pytest.mark.parametrize("mutation", ["B-C-swapped", "heads-groups-interleaved",
                                      "norm-over-full-width", "conv-not-causal-aligned"])
def test_recurrence_check_can_fail(mutation):
    """Break one piece of the recurrence: the comparison must see it (err >> F64_TOL)."""
    config, b, l = SMALL["g2-tail"]
    mixer = Mamba2Mixer(config, "torch", seed=2)
    u = inputs(config, b, l, seed=1)
    err = rel_err(mixer(u), recurrent_mixer(mixer, u, mutation))
    print(f"{mutation}: rel err {err:.2e}")
    assert err > 1e-3


# ----------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_the_bench_suite_dims(name):
    shape = next(s for s in SUITES["models"] if s.name == name)
    config = PRESETS[name]
    assert config.nheads == config.expand * config.d_model // config.headdim
    assert config.ssd_dims(shape.b, shape.l) == shape.dims
    # The published Mamba-2 configurations' chunk size, whatever the benchmark runs ours at.
    assert config.chunk_size == 256 and config.dtype == "bfloat16"
    assert config_for_shape(shape) == config
    assert PRESET_LAYERS[name] > 0


def test_named_preset_dims():
    assert (PRESETS["130m"].d_model, PRESETS["130m"].nheads) == (768, 24)
    assert (PRESETS["2.7b"].d_model, PRESETS["2.7b"].nheads) == (2560, 80)
    c = PRESETS["codestral-7b"]
    assert (c.d_model, c.nheads, c.ngroups, c.d_state) == (4096, 128, 8, 128)
    # in_proj width: z and x (d_inner each), B and C (g n each), dt (h)
    assert c.d_in_proj == 2 * 8192 + 2 * 8 * 128 + 128
    assert preset("2.7b", dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="preset"):
        preset("7b")


def test_every_suite_shape_has_a_config():
    for suite in SUITES.values():
        for shape in suite:
            assert config_for_shape(shape).ssd_dims(shape.b, shape.l) == shape.dims


def test_config_validation():
    with pytest.raises(ValueError, match="headdim"):
        Mamba2Config(d_model=100, d_state=16, headdim=64)
    with pytest.raises(ValueError, match="ngroups"):
        Mamba2Config(d_model=64, d_state=16, headdim=16, ngroups=3)
    with pytest.raises(ValueError, match="dtype"):
        Mamba2Config(d_model=64, d_state=16, dtype="int8")
    with pytest.raises(ValueError, match="d_state"):
        Mamba2Config(d_model=64, d_state=0)
    assert Mamba2Config(d_model=64, d_state=16, dtype=torch.float32).dtype == "float32"
    with pytest.raises(ValueError, match="expand"):
        config_for_shape(Shape("odd", 1, 8, 3, 1, 4))


# ----------------------------------------------------------------------------- weights


def test_initialisation_like_mamba2():
    config = Mamba2Config(d_model=256, d_state=16, headdim=8, dtype="float64")  # 64 heads
    m = Mamba2Mixer(config, seed=0)
    A = torch.exp(m.A_log)
    assert ((A >= 1) & (A <= 16)).all()
    step = torch.nn.functional.softplus(m.dt_bias)  # dt' of a zero input
    assert ((step >= 1e-3 - 1e-12) & (step <= 1e-1 + 1e-12)).all()
    assert step.min() < 3e-3 and step.max() > 3e-2  # spread over the log-uniform range
    assert (m.D == 1).all() and (m.norm.weight == 1).all()
    bound = 1 / math.sqrt(config.d_model)
    assert m.in_proj.weight.abs().max() <= bound and m.in_proj.weight.abs().max() > 0.9 * bound
    assert not any(p.requires_grad for p in m.parameters())


def test_seeded_weights():
    config = SMALL["g2-tail"][0]
    a, b, c = (Mamba2Mixer(config, seed=s) for s in (7, 7, 8))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.in_proj.weight, c.in_proj.weight)
    # the same real numbers, rounded, whatever the dtype
    lo = Mamba2Mixer(replace(config, dtype="bfloat16"), seed=7)
    assert torch.equal(lo.in_proj.weight, a.in_proj.weight.to(torch.bfloat16))
    assert lo.A_log.dtype == torch.float32 and torch.equal(lo.A_log, a.A_log.float())


def test_low_precision_mixer_runs_and_tracks_float64():
    """bf16 weights and activations on the CPU (torch backend): same layer up to bf16 error."""
    config, b, l = SMALL["g2-tail"]
    m64 = Mamba2Mixer(config, seed=3)
    m16 = Mamba2Mixer(replace(config, dtype="bfloat16"), seed=3)
    u = inputs(config, b, l)
    out = m16(u.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    check("bf16 vs fp64 layer", out, m64(u), 5e-2)


# ----------------------------------------------------------------------------- stack


def test_stack_is_prenorm_residual_composition():
    config, b, l = SMALL["g2-tail"]
    stack = Mamba2Stack(config, 3, seed=4)
    u = inputs(config, b, l)
    out = stack(u)
    assert out.shape == u.shape and out.dtype == u.dtype and torch.isfinite(out).all()
    r = u
    for norm, mixer in zip(stack.norms, stack.mixers):
        delta = mixer(norm(r))
        assert delta.shape == r.shape  # residual branch keeps the stream's shape
        r = r + delta
    check("stack vs manual composition", out, stack.norm_f(r), 1e-14)
    # layers get different weights; out_proj scaled by 1/sqrt(n_layers)
    w = [m.in_proj.weight for m in stack.mixers]
    assert not torch.equal(w[0], w[1])
    lone = Mamba2Mixer(config, seed=4)
    assert torch.equal(stack.mixers[0].in_proj.weight, lone.in_proj.weight)
    scaled = stack.mixers[0].out_proj.weight
    assert torch.allclose(scaled, lone.out_proj.weight / math.sqrt(3), rtol=1e-14, atol=0)


def test_stack_backend_switch():
    config, b, l = SMALL["g1-tail"]
    stack = Mamba2Stack(config, 2)
    u = inputs(config, b, l)
    out = stack(u)
    assert stack.set_backend("reference").backend == "reference"
    assert all(m.backend == "reference" for m in stack.mixers)
    check("stack torch vs reference backend", out, stack(u), F64_TOL)
    with pytest.raises(ValueError):
        Mamba2Stack(config, 0)


def test_ssd_replaced_swaps_and_restores():
    config, b, l = SMALL["g1-tail"]
    m = Mamba2Mixer(config)
    u = inputs(config, b, l)
    calls = []

    def zero(x, *args, **kwargs):
        calls.append(x.shape)
        return torch.zeros_like(x)

    with ssd_replaced(m, zero):
        out = m(u)
    assert calls == [(b, l, config.nheads, config.headdim)]
    assert torch.count_nonzero(out) == 0  # y = 0 -> gated norm 0 -> out 0
    assert torch.count_nonzero(m(u)) > 0  # restored


# ----------------------------------------------------------------------------- errors


def test_unknown_backend_is_a_clear_error():
    config = SMALL["g1-tail"][0]
    with pytest.raises(ValueError, match=r"backend: unknown SSD backend 'triton'.*cutile"):
        Mamba2Mixer(config, "triton")
    m = Mamba2Mixer(config, "torch")
    with pytest.raises(ValueError, match="triton"):
        m.set_backend("triton")
    assert m.backend == "torch"  # unchanged after the failed switch
    stack = Mamba2Stack(config, 2)
    with pytest.raises(ValueError):
        stack.set_backend("nope")
    assert [x.backend for x in stack.mixers] == ["torch", "torch"]


def test_unavailable_backend_names_itself_and_why():
    status = available_backends()
    assert set(status) == set(BACKENDS) and status["torch"] is None and status["reference"] is None
    for name in ("cutile", "mamba_ssm"):
        if status[name] is None:
            continue  # it can run here (a GPU machine)
        assert f"'{name}'" in status[name] and "unavailable" in status[name]
        with pytest.raises(BackendUnavailable, match=f"'{name}' is unavailable: "):
            Mamba2Mixer(SMALL["g1-tail"][0], name)


def test_bad_input_is_a_clear_error():
    config = SMALL["g1-tail"][0]
    m = Mamba2Mixer(config)
    with pytest.raises(ValueError, match="u: expected a .*d_model=32"):
        m(torch.zeros(2, 5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="u: dtype torch.float32"):
        m(torch.zeros(2, 5, 32))
    with pytest.raises(TypeError, match="u: dtype"):
        Mamba2Stack(config, 1)(torch.zeros(2, 5, 32))


def test_gpu_backend_on_cpu_tensor_is_refused(monkeypatch):
    """A GPU backend given CPU tensors fails with a message naming it (faked GPU backend)."""
    import ssd.layer as mm

    monkeypatch.setattr(mm, "backend_function", lambda name: ssd_torch)
    m = Mamba2Mixer(SMALL["g1-tail"][0], "cutile")
    with pytest.raises(BackendUnavailable, match="'cutile' runs on CUDA tensors only"):
        m(inputs(m.config, 1, 8))


# ----------------------------------------------------------------------------- GPU


# Tolerances (relative Frobenius error against the torch backend on the same weights and input,
# for the mixer output and for the SSD call alone without D). The torch backend computes the
# SSD in fp32 from the same rounded inputs, so the difference is the kernel's own error
# (ssd.validate.TOL: bf16 1.5e-2, fp32 2e-5), carried through the gated RMSNorm (scale-free)
# and out_proj (a fixed linear map, the same on both sides), plus the rounding of y to bf16
# on both sides (u = 3.9e-3). Margins of 2x (bf16) and 5x (fp32). The rows carry record="mixer": conftest writes them to
# results/<gpu>/gpu_mixer_tests.json, apart from the per-stage checks of gpu_tests.json.
GPU_TOL = {"bfloat16": 3e-2, "float32": 1e-4}
# mamba_ssm as the backend, in fp32: its SSD alone measured 1.43e-3 against the torch backend
# on g4-l1000 on the H200 (the other two fp32 cases missed 1e-4 too). That size is TF32's (10-bit mantissa, u = 4.9e-4),
# Triton's default precision for fp32 tl.dot, which mamba_ssm's kernels leave as it is: an
# inference from the size, not verified (TRITON_F32_DEFAULT=ieee would tell). This check
# exists to catch a wrong wiring of the peer into the layer (errors of order 1), so the peer
# gets TF32's tolerance: 5e-3, about 10 u. Ours is held to 1e-4 in fp32.
PEER_TOL = {**GPU_TOL, "float32": 5e-3}
GPU_CASES = {
    "130m-l777": (PRESETS["130m"], 2, 777),  # seqlen not a multiple of 256
    "g4-l1000": (Mamba2Config(d_model=512, d_state=128, ngroups=4), 2, 1000),  # 16 heads
    "codestral-l512": (PRESETS["codestral-7b"], 1, 512),
}
# A fresh seed per run for the GPU cases' weights and inputs (SSD_TEST_SEED replays a run);
# every GPU row records the seed it used, and every failure prints it.
RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


def ssd_call_vs_float64(backend, call, chunk_size, dtype):
    """The layer's SSD call alone (``call``, as capture_ssd_calls returns it; without the D
    skip) against the float64 reference of the very same tensors, with ssd.validate's two
    criteria (the norm and the elementwise bound). For ``cutile`` every stage output is checked,
    written into NaN-poisoned buffers (ssd.validate.run_stages, the default configuration for
    this GPU and problem); for another backend, its y. Returns {stage: StageCheck}."""
    import ssd.validate as V
    from ssd.problem import ProblemSpec

    x, dt, A, B, C, _, dt_bias = call
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    spec = ProblemSpec(b, l, h, p, n, g, chunk_size=chunk_size, dt_bias=True, dt_softplus=True,
                       name="layer")
    inputs = dict(x=x, dt=dt, A=A, B=B, C=C, dt_bias=dt_bias)
    ref = spec.reference(V.host_inputs(inputs))
    state_dtype = None
    if backend == "cutile":
        from ssd.api import resolve_config, takes_fused_scan

        config = resolve_config(None, chunk_size, x, B)
        got = V.run_stages(spec, inputs, dtype, config)
        if not takes_fused_scan(config, None):
            state_dtype = config.state.storage_dtype(dtype)
    else:
        got = {"y": backend_function(backend)(x, dt, A, B, C, chunk_size, dt_bias=dt_bias,
                                              dt_softplus=True)}
    return V.check_outputs(spec, got, ref, dtype, state_dtype)


def backend_vs_torch(backend, config, b, l, device, tol, record, label, seed=11):
    """Checks on one layer whose weights and input are drawn from ``seed``:

    1. the mixer output, backend vs the torch backend (the same layer code around another SSD:
       a wrong wiring of the backend into the layer shows);
    2. the SSD call alone on the tensors the layer passed it, without the D skip, against the
       torch backend's SSD: needed because at Mamba-2's initialisation the skip D x dominates
       y (dt' ~ 1e-3..1e-1 keeps the state term small), so that on the CPU a wrong B/C pairing
       moves the layer output by only ~1e-2, which (1) alone would not see at bf16 tolerance;
    3. the same SSD call against the float64 reference of those tensors, as the kernel tests
       check a stage (:func:`ssd_call_vs_float64`): ours must meet both of ssd.validate's
       criteria, a peer the norm within ``tol``;
    4. the mixer output against the same layer in float64 (the same weights, upcast, the same
       input): no further from it than twice the torch backend's layer plus the SSD's own
       tolerance (ssd.validate.TOL for ours, ``tol`` for a peer).

    Rows: (1) and (2) as test "mixer-<backend>-vs-torch", stages "mixer" and "ssd-no-D"; (3)
    and (4) as "mixer-<backend>-vs-float64", stages "ssd-no-D" (y), "ssd-no-D/<stage>" (the
    other stage outputs, ours only) and "mixer"; each with the seed."""
    import ssd.validate as V

    try:
        mixer = Mamba2Mixer(config, backend, device=device, seed=seed)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    u = inputs(config, b, l, seed=seed, device=device)
    out, calls = capture_ssd_calls(mixer, u)
    ref = mixer.set_backend("torch")(u)
    assert out.dtype == config.torch_dtype and out.shape == (b, l, config.d_model)
    assert len(calls) == 1
    x, dt, A, B, C, D, dt_bias = calls[0]
    kw = dict(dt_bias=dt_bias, dt_softplus=True)
    y = backend_function(backend)(x, dt, A, B, C, config.chunk_size, **kw)
    y_ref = ssd_torch(x, dt, A, B, C, config.chunk_size, **kw)
    common = dict(record="mixer", shape=label, dims=list(config.ssd_dims(b, l)),
                  chunk_size=config.chunk_size, dtype=config.dtype, seed=seed)
    failures = []
    for stage, err in {"mixer": rel_err(out, ref), "ssd-no-D": rel_err(y, y_ref)}.items():
        record.append(dict(test=f"mixer-{backend}-vs-torch", stage=stage, rel_err=err, tol=tol,
                           **common))
        print(f"{backend} {label} {config.dtype} {stage}: rel err vs torch backend {err:.2e} "
              f"(tol {tol:.0e})")
        if not err <= tol:
            failures.append(f"{stage} vs torch backend: rel err {err:.3e} > {tol:.0e}")
    ours = backend != "mamba_ssm"
    for key, check in ssd_call_vs_float64(backend, calls[0], config.chunk_size,
                                          config.dtype).items():
        stage = "ssd-no-D" if key == "y" else f"ssd-no-D/{key}"
        record.append(dict(test=f"mixer-{backend}-vs-float64", stage=stage, **check.fields(),
                           **common))
        print(f"{backend} {label} {config.dtype} {stage}: vs float64 rel err {check.rel_err:.2e}, "
              f"worst element {check.elem.ratio:.2f} of its bound")
        if ours and not check.ok:
            failures.append(f"{stage} vs float64: {check.failure()}")
        if not ours and not check.rel_err <= tol:
            failures.append(f"{stage} vs float64: rel err {check.rel_err:.3e} > {tol:.0e}")
    m64 = Mamba2Mixer(replace(config, dtype="float64"), "torch", device=device, seed=seed)
    m64.load_state_dict({k: v.double() for k, v in mixer.state_dict().items()})
    out64 = m64(u.double())
    base = rel_err(ref, out64)                 # the torch backend's layer against float64
    # the backend's SSD tolerance on top: ssd.validate's for ours, ``tol`` (PEER_TOL) for a peer
    err, allowed = rel_err(out, out64), 2 * base + (V.TOL[config.dtype] if ours else tol)
    record.append(dict(test=f"mixer-{backend}-vs-float64", stage="mixer", rel_err=err,
                       tol=allowed, torch_rel_err=base, **common))
    print(f"{backend} {label} {config.dtype} mixer: vs float64 {err:.2e} (the torch backend's "
          f"{base:.2e}; allowed {allowed:.1e})")
    if not err <= allowed:
        failures.append(f"mixer vs float64: rel err {err:.3e} > {allowed:.1e}")
    assert not failures, (f"{backend} {label} {config.dtype} [seed {seed}; SSD_TEST_SEED="
                          f"{RUN_SEED} replays the run]: " + "; ".join(failures))


def test_backend_vs_torch_check_on_cpu():
    """The GPU check's code path, on the CPU: the NumPy reference backend (float64, result
    rounded to fp32) against the torch backend in fp32 and against float64."""
    config, b, l = SMALL["g2-tail"]
    record = []
    backend_vs_torch("reference", replace(config, dtype="float32"), b, l, "cpu", 1e-5, record,
                     "g2-tail")
    assert [(r["test"], r["stage"]) for r in record] == [
        ("mixer-reference-vs-torch", "mixer"), ("mixer-reference-vs-torch", "ssd-no-D"),
        ("mixer-reference-vs-float64", "ssd-no-D"), ("mixer-reference-vs-float64", "mixer")]
    assert all(0 < r["rel_err"] < 1e-5 for r in record)
    assert record[2]["elem_ratio"] < 0.1 and record[3]["torch_rel_err"] > 0


def test_backend_vs_torch_check_can_fail_on_cpu(monkeypatch):
    """A wrong SSD (B and C swapped) behind the layer fails the check, and the message
    carries the seed that replays it."""
    import ssd.layer

    def swapped(x, dt, A, B, C, chunk_size, **kw):
        return ssd_torch(x, dt, A, C, B, chunk_size, **kw)

    real = ssd.layer.backend_function
    monkeypatch.setattr(ssd.layer, "backend_function",
                        lambda name: swapped if name == "reference" else real(name))
    monkeypatch.setitem(globals(), "backend_function", ssd.layer.backend_function)
    config, b, l = SMALL["g2-tail"]
    with pytest.raises(AssertionError, match=r"seed 5; SSD_TEST_SEED=\d+ replays.*ssd-no-D vs"):
        backend_vs_torch("reference", replace(config, dtype="float32"), b, l, "cpu", 1e-5, [],
                         "g2-tail", seed=5)


def _gpu_backend_vs_torch(backend, case, dtype, record):
    config, b, l = GPU_CASES[case]
    tol = (PEER_TOL if backend == "mamba_ssm" else GPU_TOL)[dtype]
    backend_vs_torch(backend, replace(config, dtype=dtype), b, l, "cuda", tol, record, case,
                     seed=seed_for(f"{backend}/{case}/{dtype}"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_cutile_mixer_matches_torch_backend(case, dtype, gpu_record):
    _gpu_backend_vs_torch("cutile", case, dtype, gpu_record)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_TOL))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_mamba_ssm_mixer_matches_torch_backend(case, dtype, gpu_record):
    _gpu_backend_vs_torch("mamba_ssm", case, dtype, gpu_record)


@pytest.mark.gpu
def test_gpu_torch_backend_matches_float64_reference(gpu_record):
    """The yardstick itself: the torch backend on the GPU in fp32 vs the fp64 CPU layer."""
    config, b, l = GPU_CASES["g4-l1000"]
    seed = seed_for("torch-fp32-vs-fp64")
    c64 = replace(config, dtype="float64")
    c32 = replace(config, dtype="float32")
    m64 = Mamba2Mixer(c64, "torch", device="cuda", seed=seed)
    m32 = Mamba2Mixer(c32, "torch", device="cuda", seed=seed)
    u = inputs(c64, b, l, seed=seed, device="cuda")
    err = check(f"torch backend fp32 vs fp64 (GPU, seed {seed})", m32(u.float()), m64(u), 1e-5)
    gpu_record.append(dict(record="mixer", test="mixer-torch-fp32-vs-fp64", shape="g4-l1000",
                           dims=list(config.ssd_dims(b, l)), chunk_size=config.chunk_size,
                           dtype="float32", stage="mixer", rel_err=err, tol=1e-5, seed=seed))


def test_the_library_imports_no_tool():
    """ssd's library modules (the layer among them) import neither ssd.tools nor ssd.book: the
    tools and the book sit on the library, not under it (mamba_ssm's backend comes from
    ssd.mamba_ssm_loader). Only the command line entry point, ssd/__main__.py, reaches up."""
    import ast
    from pathlib import Path

    import ssd

    root = Path(ssd.__file__).parent
    for package, folder in (("ssd", root), ("ssd.kernels", root / "kernels")):
        for path in folder.glob("*.py"):
            if path.name == "__main__.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):  # resolve relative imports
                    base = package.split(".")[:len(package.split(".")) - max(node.level - 1, 0)]
                    names = [".".join(base + [node.module or ""]) if node.level else node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    assert not name.startswith(("ssd.tools", "ssd.book")), \
                        f"{path.relative_to(root)} imports {name}"
