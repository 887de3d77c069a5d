"""ssd.validate on the CPU: the elementwise bounds and the check that names a wrong tile, the
NaN-poisoned buffers, the norm, the injected faults, and the GPU tests' comparison code run on
outputs that carry the kernels' roundings.

A GPU run cannot happen here, so ``kernel_like`` stands in for the kernels: it computes the
stages from the float64 reference's inputs the way the kernels round them (the MMA operands
built on chip -- dt- and decay-scaled B, decay-weighted C·Bᵀ, the entering state -- rounded to
the input dtype, everything accumulated in fp32, y stored in the input dtype). Its norm errors
match those recorded on the H200 (about 2e-3 in bf16, 3e-4 in fp16), so a bound that passes it
with room to spare is not tight against real kernels, and a fault it catches on top of it is
caught on top of real kernel outputs.
"""
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import validate as V  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec  # noqa: E402
from ssd.reference import _chunk, _heads, silu  # noqa: E402

TESTS = Path(__file__).resolve().parent

MODEL_LIKE = ProblemSpec(2, 1000, 8, 64, 128, 1, chunk_size=64, D="h", dt_bias=True,
                         dt_softplus=True, initial_states=True, z=True, name="model-like")
ALL_FEATURES = EDGE_SHAPES["all-features"].replace(seq_boundaries=(), name="all-features-no-seq")
KERNEL_LIKE_SPECS = [EDGE_SHAPES[k] for k in ("l-not-multiple", "initial-states", "z-gate",
                                               "D-per-channel", "ngroups-gt-1")] + [ALL_FEATURES]


def rounded_inputs(spec, seed, dtype):
    """Host float64 inputs holding exactly what the kernels read (device_inputs on the CPU)."""
    return V.host_inputs(V.device_inputs(spec, seed, dtype, device="cpu"))


def kernel_like(spec, host, ref, dtype):
    """The stage outputs as kernels that round their MMA operands to ``dtype`` would write them
    (no seq_idx): torch CPU tensors keyed and typed as ssd.validate.run_stages returns them with
    the default configuration (entering states stored in the input dtype) plus states."""
    assert "seq_idx" not in host
    low, f32 = getattr(torch, dtype), torch.float32
    rnd = lambda t: t.to(low).to(f32)  # noqa: E731
    q = spec.chunk_size
    b, l, h, p, n, g = spec.dims
    as32 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(f32)  # noqa: E731
    dt_out, dA = as32(ref["dt_out"]), as32(ref["dA_cumsum"])   # (b, h, c, q): stage 1 in fp32
    x = as32(_chunk(host["x"], q))                              # (b, c, q, h, p)
    B = as32(_heads(_chunk(host["B"], q), h))                   # (b, c, q, h, n)
    C = as32(_heads(_chunk(host["C"], q), h))
    # chunk_state: B scaled by dt' and the decay to the chunk's end, rounded; x·Bᵀ in fp32
    w = (torch.exp(dA[..., -1:] - dA) * dt_out).permute(0, 2, 3, 1)[..., None]
    states = torch.einsum("bcshp,bcshn->bchpn", x, rnd(B * w))
    running = as32(host["initial_states"]) if "initial_states" in host else torch.zeros(b, h, p, n)
    prev = torch.empty_like(states)
    for ci in range(states.shape[1]):
        prev[:, ci] = running
        running = torch.exp(dA[:, :, ci, -1])[..., None, None] * running + states[:, ci]
    prev = rnd(prev)                                            # stored in the input dtype
    # chunk_scan: decay-weighted C·Bᵀ rounded, times x; C times the rounded entering state
    causal = torch.ones(q, q, dtype=torch.bool).tril()
    L = torch.exp((dA[..., :, None] - dA[..., None, :]).masked_fill(~causal, -math.inf))
    W = rnd(torch.einsum("bcthn,bcshn->bhcts", C, B) * L * dt_out[..., None, :])
    y = torch.einsum("bhcts,bcshp->bcthp", W, x) + torch.einsum(
        "bcthn,bchpn->bcthp", C, prev) * torch.exp(dA).permute(0, 2, 3, 1)[..., None]
    y = y.reshape(b, -1, h, p)[:, :l]
    if "D" in host:
        D = as32(host["D"])
        y = y + (D[:, None] if D.ndim == 1 else D) * as32(host["x"])
    if "z" in host:
        y = y * torch.nn.functional.silu(as32(host["z"]))
    return dict(dt_out=dt_out, dA_cumsum=dA, states=states, prev_states=prev,
                final_states=running, y=y.to(low))


def problem(spec, dtype, seed=0):
    host = rounded_inputs(spec, seed, dtype)
    ref = spec.reference(host)
    return host, ref, kernel_like(spec, host, ref, dtype)


# ------------------------------------------------------------------------------------------
# The bounds


def test_bounds_are_derived_from_unit_roundoff_and_accumulation_length():
    kw = dict(chunk_size=64, dstate=128, nchunks=16, decay=40.0)
    u32 = V.UNIT_ROUNDOFF["float32"]
    for dtype in V.DTYPE_NAMES:
        u = V.UNIT_ROUNDOFF[dtype]
        for key in V.STAGE_KEYS:
            b = V.elementwise_bound(key, dtype, **kw)
            m, K, decays = V._stage_model(key, 64, 128, 16)
            eps = math.sqrt(m / 3) * u + (math.sqrt(K) + V.FN_UNITS + (40.0 if decays else 0)) * u32
            assert math.isclose(b.eps, eps) and math.isclose(b.arel, V.ELEMENT_Z * eps)
            stored = u if key == "y" else u32
            assert math.isclose(b.rtol, V.ELEMENT_Z * eps + stored)
    y = {d: V.elementwise_bound("y", d, **kw).rtol for d in V.DTYPE_NAMES}
    assert y["float32"] < 1e-4 < y["float16"] < 1e-2 < y["bfloat16"] < 0.05, y
    # the decay term enters only the stages that take exp of dA_cumsum differences
    assert V.elementwise_bound("dA_cumsum", "float32", **kw).decay == 0.0
    assert V.elementwise_bound("y", "float32", **{**kw, "decay": 400.0}).rtol > 4 * y["float32"]
    # entering states stored in bf16: one more rounding of the stored value
    plain = V.elementwise_bound("prev_states", "bfloat16", **kw)
    stored = V.elementwise_bound("prev_states", "bfloat16", state_dtype="bfloat16", **kw)
    assert math.isclose(stored.rtol - plain.rtol, V.UNIT_ROUNDOFF["bfloat16"] - u32)


def test_tile_of_names_chunk_and_head():
    assert V.tile_of("y", (1, 130, 3, 7), 64) == (1, 2, 3)
    assert V.tile_of("prev_states", (0, 4, 5, 1, 2), 64) == (0, 4, 5)
    assert V.tile_of("final_states", (1, 5, 0, 9), 64) == (1, 5)
    assert V.tile_of("dA_cumsum", (1, 5, 2, 9), 64) == (1, 5, 2)
    assert set(V.TILE_AXES) == set(V.STAGE_KEYS)


def test_tile_scale_follows_the_tile_and_the_gate():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 70, 2, 4))
    ref[:, 64:, 1] *= 5                           # the (chunk 2, head 1) tile is 5x louder
    scale = V.tile_scale("y", ref, 32)
    tile = ref[0, 64:, 1]
    assert np.allclose(scale[0, 64:, 1], np.sqrt(np.mean(tile**2)))
    assert np.allclose(scale[0, :32, 0], np.sqrt(np.mean(ref[0, :32, 0] ** 2)))
    # a constant gate changes nothing; a gate of 20 on one element scales that element's bound
    gate = np.full(ref.shape, 0.5)
    assert np.allclose(V.tile_scale("y", ref * 0.5, 32, gate), V.tile_scale("y", ref * 0.5, 32))
    gate[0, 3, 0, 1] = 20.0
    gated = V.tile_scale("y", ref * gate, 32, gate)
    assert math.isclose(gated[0, 3, 0, 1], 20 * V.tile_scale("y", ref, 32)[0, 3, 0, 1], rel_tol=0.02)
    # a tile of zeros keeps a floor of a tenth of the output's RMS; dt_out's scale is >= 1
    zero = ref.copy()
    zero[:, :32, 0] = 0
    whole = np.sqrt(np.mean(zero**2))
    assert np.allclose(V.tile_scale("y", zero, 32)[0, :32, 0], V.SCALE_FLOOR * whole)
    assert (V.tile_scale("dt_out", np.full((1, 2, 3, 4), 0.01), 4) == 1.0).all()


# ------------------------------------------------------------------------------------------
# The elementwise check


@pytest.mark.parametrize("dtype", V.DTYPE_NAMES)
@pytest.mark.parametrize("spec", KERNEL_LIKE_SPECS + [MODEL_LIKE], ids=lambda s: s.name)
def test_outputs_with_the_kernels_roundings_pass(spec, dtype):
    """Both criteria hold on kernel-like outputs, the elementwise one with room to spare."""
    host, ref, got = problem(spec, dtype, seed=3)
    checks = V.check_outputs(spec, got, ref, dtype, state_dtype=dtype, z=host.get("z"))
    print(", ".join(f"{k} {c.rel_err:.1e} ({c.elem.ratio:.2f} of the bound)"
                    for k, c in checks.items()))
    assert all(c.ok for c in checks.values()), [c.failure() for c in checks.values()]
    assert max(c.elem.ratio for c in checks.values()) < 0.75


def test_one_zeroed_tile_of_a_large_output_passes_the_norm_but_not_the_elementwise_check():
    """y of 5,120 (chunk, head) tiles in bf16: one zeroed tile moves the norm by 1/sqrt(5120) =
    1.4e-2, under the 1.5e-2 tolerance; the elementwise check fails on it and names it."""
    rng = np.random.default_rng(1)
    b, l, h, p, q = 1, 4096, 80, 16, 64
    ref = rng.standard_normal((b, l, h, p))
    out = torch.from_numpy(ref).to(torch.bfloat16)          # correct up to y's rounding
    bound = V.elementwise_bound("y", "bfloat16", chunk_size=q, dstate=64, nchunks=l // q)
    clean = V.check_elementwise("y", out, ref, bound, q)
    assert clean.ok and clean.bad_tiles == 0 and V.rel_err(out, ref) < 3e-3
    broken = out.clone()
    broken[0, 17 * q:18 * q, 42] = 0                         # tile (b=0, c=17, h=42)
    check = V.check_elementwise("y", broken, ref, bound, q)
    assert V.rel_err(broken, ref) <= V.TOL["bfloat16"]     # the norm does not see it
    assert not check.ok and check.ratio > 10
    assert check.tile == (0, 17, 42) and check.bad_tiles == 1 and check.tiles == l // q * h
    assert check.index[1] // q == 17 and check.index[2] == 42 and check.out == 0.0
    assert "tile (b=0, c=17, h=42), 1 of 5120 tiles fail" in check.describe()
    assert np.argmax(check.tile_ratio) == np.ravel_multi_index((0, 17, 42), check.tile_ratio.shape)


def test_an_unwritten_element_fails_both_criteria_and_is_named():
    host, ref, got = problem(EDGE_SHAPES["three-chunks"], "float32")
    got["final_states"][1, 2, 3, 4] = math.nan
    check = V.check_outputs(EDGE_SHAPES["three-chunks"], got, ref, "float32")["final_states"]
    assert check.rel_err == math.inf and not check.ok_norm
    assert check.elem.ratio == math.inf and check.elem.index == (1, 2, 3, 4)
    assert check.elem.tile == (1, 2) and check.elem.bad_tiles == 1
    assert "final_states" in check.failure() and "tile (b=1, h=2)" in check.failure()


def test_a_tile_of_exact_zeros_must_stay_near_zero():
    """prev_states of chunk 0 without initial states is exactly 0: written as 0 it passes,
    written with a few percent of the output's size it fails (the scale floor)."""
    spec = EDGE_SHAPES["three-chunks"]
    host, ref, got = problem(spec, "bfloat16")
    assert not ref["prev_states"][:, 0].any()
    bound = V.bound_for("prev_states", "bfloat16", spec, ref, "bfloat16")
    assert V.check_elementwise("prev_states", got["prev_states"], ref["prev_states"], bound, 32).ok
    rms = np.sqrt(np.mean(ref["prev_states"] ** 2))
    got["prev_states"][1, 0, 2] = 0.05 * rms
    check = V.check_elementwise("prev_states", got["prev_states"], ref["prev_states"], bound, 32)
    assert not check.ok and check.tile == (1, 0, 2)


def test_a_large_gate_widens_its_elements_bound():
    """y = (SSD output) · silu(z): where z is large and the SSD output cancels, the element's
    error is that of its tile's ungated sums times its gate. check_outputs scales the bound by
    the gate, so such an error passes; judged by the gated tile's RMS alone it would not."""
    spec = EDGE_SHAPES["z-gate"]
    host, ref, got = problem(spec, "bfloat16")
    e = (1, 40, 2, 5)                                  # chunk 1, head 2
    z = host["z"].copy()
    z[e] = 6.0
    y = ref["y"].copy()
    y[e] = 0.01 * silu(6.0)                             # the SSD output cancels here
    bound = V.bound_for("y", "bfloat16", spec, ref)
    out = y.copy()
    out[e] += 0.5 * bound.arel * V.tile_scale("y", y, spec.chunk_size, silu(z))[e]
    gated = V.check_outputs(spec, {"y": out}, {**ref, "y": y}, "bfloat16", z=z)["y"]
    assert gated.ok and gated.elem.index == e and 0.4 < gated.elem.ratio < 0.6
    plain = V.check_outputs(spec, {"y": out}, {**ref, "y": y}, "bfloat16")["y"]
    assert not plain.ok and plain.elem.index == e


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="^y: output shape"):
        V.check_elementwise("y", np.zeros((1, 3, 1, 1)), np.zeros((1, 4, 1, 1)),
                            V.elementwise_bound("y", "float32", chunk_size=4, dstate=1,
                                                nchunks=1), 4)


def test_recorded_fields_are_json():
    spec = EDGE_SHAPES["z-gate"]
    host, ref, got = problem(spec, "float16")
    check = V.check_outputs(spec, got, ref, "float16", "float16", z=host["z"])["y"]
    fields = json.loads(json.dumps(check.fields()))
    assert set(fields) == {"rel_err", "tol", "elem_ratio", "elem_index", "elem_tile", "bad_tiles",
                           "rtol", "atol_rel"}
    assert len(fields["elem_index"]) == 4 and len(fields["elem_tile"]) == 3


# ------------------------------------------------------------------------------------------
# Norm, tolerances, inputs and poisoned buffers


def test_rel_err():
    ref = np.array([[3.0, 4.0]])
    assert V.rel_err(torch.tensor([[3.0, 4.0]]), ref) == 0.0
    assert math.isclose(V.rel_err(np.array([[3.0, 3.0]]), ref), 1 / 5)
    assert math.isclose(V.rel_err(torch.tensor([[3.0, 3.0]], dtype=torch.bfloat16), ref), 1 / 5)
    assert V.rel_err(np.array([[math.nan, 4.0]]), ref) == math.inf
    assert V.rel_err(torch.tensor([[math.inf, 4.0]]), ref) == math.inf
    assert V.rel_err(np.array([0.5, 0.0]), np.zeros(2)) == 0.5   # ‖ref‖ = 0 counts as 1


def test_tol_for():
    for dtype in V.DTYPE_NAMES:
        assert V.tol_for("dt_out", dtype) == V.tol_for("dA_cumsum", dtype) == V.TOL_CUMSUM
        for key in ("states", "prev_states", "final_states", "y"):
            assert V.tol_for(key, dtype) == V.TOL[dtype]
    assert V.TOL["float32"] < V.TOL["float16"] < V.TOL["bfloat16"]


def test_device_inputs_on_the_cpu_and_their_reference():
    spec = EDGE_SHAPES["all-features"]
    inputs = V.device_inputs(spec, 5, "bfloat16", device="cpu")
    assert {k: str(v.dtype) for k, v in inputs.items()} == {
        **{k: "torch.bfloat16" for k in V.LOW_PRECISION},
        **{k: "torch.float32" for k in ("A", "D", "dt_bias", "initial_states")},
        "seq_idx": "torch.int32"}
    ref = V.reference_of(spec, inputs)
    exact = spec.reference(spec.make_inputs(5))
    assert V.rel_err(torch.from_numpy(exact["y"]), ref["y"]) > 1e-3   # the cast is not the kernel's
    again = spec.reference({k: v.double().numpy() if v.is_floating_point() else v.numpy()
                            for k, v in inputs.items()})
    assert all(np.array_equal(ref[k], again[k]) for k in ref)


@pytest.mark.parametrize("split,entering", [(False, True), (True, True), (False, False)])
def test_poisoned_outputs_are_nan_on_the_cpu(split, entering):
    spec = EDGE_SHAPES["l-not-multiple"]
    b, l, h, p, n, g = spec.dims
    c, q = spec.nchunks, spec.chunk_size
    out = V.poisoned_outputs(spec, "float16", split, state_dtype="bfloat16", device="cpu",
                             entering=entering)
    shapes = {"dt_out": (b, h, c, q), "dA_cumsum": (b, h, c, q), "final_states": (b, h, p, n),
              "y": (b, l, h, p), **({"prev_states": (b, c, h, p, n)} if entering else {}),
              **({"states": (b, c, h, p, n)} if split else {})}
    assert {k: tuple(t.shape) for k, t in out.items()} == shapes
    assert all(torch.isnan(t).all() for t in out.values())
    assert out["y"].dtype == torch.float16 and out["final_states"].dtype == torch.float32
    if entering:
        assert out["prev_states"].dtype == torch.bfloat16


def test_poisoned_outputs_of_the_grouped_walk():
    pytest.importorskip("cuda.tile")
    from ssd.kernels.tiles import DECAY_ROW

    spec = EDGE_SHAPES["three-chunks"]
    out = V.poisoned_outputs(spec, "bfloat16", False, device="cpu", groups=2)
    assert out["chunk_decay"].shape[-1] == DECAY_ROW and out["group_enter"].shape[1] == 2
    assert all(torch.isnan(t).all() for t in out.values())


# ------------------------------------------------------------------------------------------
# Injected faults


@pytest.mark.parametrize("spec,dtype", [(EDGE_SHAPES["l-not-multiple"], "float32"),
                                        (EDGE_SHAPES["l-not-multiple"], "bfloat16"),
                                        (ALL_FEATURES, "float16"), (MODEL_LIKE, "bfloat16")],
                         ids=lambda v: getattr(v, "name", v))
def test_every_fault_is_caught_by_the_elementwise_check(spec, dtype):
    """Each fault put into kernel-like outputs: the elementwise check fails, on the tile a
    tile fault hit."""
    host, ref, got = problem(spec, dtype, seed=2)
    rows = V.check_faults(spec, host, ref, got, dtype, state_dtype=dtype, seed=2)
    assert {r["fault"] for r in rows} == set(V.FAULTS)
    assert {r["target"] for r in rows if r["fault"] == "tile-zero"} == set(got)
    for row in rows:
        print(row)
        assert row["applicable"] and row["visible"], row
        assert row["caught_elem"] and row["elem_ratio"] > 5, row
        if row["fault"] in V.TILE_FAULTS:
            assert row["named"] and row["caught_by"] == [row["target"]], row
    by = {r["fault"]: r for r in rows if r["target"] in ("y", "stages")}
    assert "final_states" in by["carry-dropped"]["changed"]   # the loss runs on to the end
    assert "states" not in by["carry-dropped"]["changed"]     # chunk_state itself was right
    assert "dA_cumsum" not in by["decay-off-by-one"]["changed"]
    assert {"dt_out", "dA_cumsum", "final_states"} <= set(by["padding-leak"]["changed"])
    assert "y" not in by["padding-leak"]["changed"]     # padded rows of y are never stored


def test_faults_a_problem_cannot_show():
    spec = EDGE_SHAPES["single-chunk"]                   # l = q, one chunk, no initial state
    host, ref, got = problem(spec, "float32")
    assert V.inject_fault("padding-leak", spec, host, ref, got) is None
    assert V.inject_fault("carry-dropped", spec, host, ref, got) is None
    del got["states"]
    assert V.inject_fault("tile-zero", spec, host, ref, got, target="states") is None
    assert V.inject_fault("decay-off-by-one", spec, host, ref, got) is not None
    with pytest.raises(ValueError, match="^fault: unknown"):
        V.inject_fault("bit-flip", spec, host, ref, got)


def test_a_tile_fault_hits_one_tile_only():
    spec = EDGE_SHAPES["l-not-multiple"]
    host, ref, got = problem(spec, "float32")
    injected = V.inject_fault("tile-unwritten", spec, host, ref, got, seed=4)
    y = injected.outputs["y"]
    b, c, h = injected.tile
    nan = np.isnan(y)
    assert nan[b, c * 32:(c + 1) * 32, h].all() and nan.sum() == nan[b, c * 32:(c + 1) * 32, h].size
    assert np.array_equal(injected.outputs["final_states"], V.as_float64(got["final_states"]))


def test_requested_faults():
    assert V.requested_faults("") == ()
    assert V.requested_faults("all") == tuple(V.FAULTS)
    assert V.requested_faults("tile-zero, carry-dropped") == ("tile-zero", "carry-dropped")
    with pytest.raises(ValueError, match="^SSD_INJECT_FAULT: unknown fault 'typo'"):
        V.requested_faults("tile-zero,typo")


# ------------------------------------------------------------------------------------------
# The GPU tests' comparison code, on the CPU


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_tests(monkeypatch):
    """tests/test_gpu_kernels.py with its device calls on the CPU: inputs on the CPU, and the
    kernels replaced by ``kernel_like`` (its ``broken`` list: tiles of y to zero)."""
    pytest.importorskip("cuda.tile")
    module = _load("gpu_kernels_copy", TESTS / "test_gpu_kernels.py")
    module.broken = []

    def run_stages(spec, inputs, dtype, config):
        host = V.host_inputs(inputs)
        got = kernel_like(spec, host, spec.reference(host), dtype)
        del got["states"]                                  # the default's fused stage 2
        for b, c, h in module.broken:
            got["y"][b, c * spec.chunk_size:(c + 1) * spec.chunk_size, h] = 0
        return got

    monkeypatch.setattr(module, "device_inputs",
                        lambda spec, seed, dtype: V.device_inputs(spec, seed, dtype, device="cpu"))
    monkeypatch.setattr(module, "run_stages", run_stages)
    return module


def test_check_stages_records_both_criteria(gpu_tests):
    spec, record = EDGE_SHAPES["z-gate"], []
    gpu_tests.check_stages(spec, "bfloat16", gpu_tests.FUSED, record, "edge/z-gate", 7)
    assert [r["stage"] for r in record] == ["dt_out", "dA_cumsum", "prev_states", "final_states", "y"]
    for row in record:
        assert row["elem_ratio"] <= 1 and row["rel_err"] <= row["tol"] and row["seed"] == 7
        assert len(row["elem_tile"]) == len(V.TILE_AXES[row["stage"]])


def test_check_stages_fails_on_one_wrong_tile_and_names_it(gpu_tests):
    gpu_tests.broken.append((1, 2, 3))
    with pytest.raises(AssertionError, match=r"tile \(b=1, c=2, h=3\), 1 of 24 tiles fail"):
        gpu_tests.check_stages(EDGE_SHAPES["z-gate"], "float16", gpu_tests.FUSED, [], "t", 7)


def test_check_stages_with_injected_faults(gpu_tests):
    record = []
    gpu_tests.check_stages(EDGE_SHAPES["l-not-multiple"], "bfloat16", gpu_tests.FUSED, record,
                           "faults/x", 8, faults=tuple(V.FAULTS), strict=True)
    faults = [r for r in record if r.get("kind") == "fault"]
    assert {r["fault"] for r in faults} == set(V.FAULTS)
    assert all(r["caught_elem"] for r in faults if r["applicable"])


def test_a_fault_run_writes_its_own_summary(tmp_path, monkeypatch):
    import ssd.tools.env

    plumbing = _load("conftest_faults_copy", TESTS / "conftest.py")
    monkeypatch.setattr(plumbing, "ROOT", tmp_path)
    monkeypatch.setattr(ssd.tools.env, "environment", lambda: {"gpu": "NVIDIA H200"})
    fault = dict(kind="fault", dtype="bfloat16", applicable=True, visible=True, caught_elem=True,
                 caught_norm=False)
    rows = [dict(test="edge/x", dtype="bfloat16", stage="y", rel_err=1e-3, tol=1.5e-2,
                 elem_ratio=0.3),
            dict(fault, test="edge/x", fault="tile-zero", target="y"),
            dict(fault, test="random/3", fault="tile-zero", target="y", caught_norm=True),
            dict(fault, test="random/3", fault="carry-dropped", target="stages", visible=False,
                 caught_elem=False),
            dict(fault, test="edge/x", fault="decay-off-by-one", target="stages", caught_elem=False),
            dict(test="edge/x", kind="fault", dtype="bfloat16", fault="padding-leak",
                 target="stages", applicable=False)]
    plumbing.pytest_runtest_logreport(SimpleNamespace(
        when="call", keywords={"gpu": True}, outcome="failed", failed=True, nodeid="t",
        user_properties=[("gpu_rows", rows)]))
    finish = SimpleNamespace(config=SimpleNamespace(getoption={"--gpu-merge": False}.get))
    plumbing.pytest_sessionfinish(finish, 0)                        # a plain run
    folder = tmp_path / "results" / "h200"
    summary = ssd.tools.env.read_json(folder / "gpu_tests.json.gz")
    assert summary["worst_elem_ratio_by_dtype"] == {"bfloat16": 0.3}
    assert summary["faults_caught"]["tile-zero"] == dict(injected=2, visible=2, caught_elem=2,
                                                         caught_norm=1)
    assert summary["faults_caught"]["carry-dropped"] == dict(injected=1, visible=0,
                                                             caught_elem=0, caught_norm=0)
    (folder / "gpu_tests.json.gz").unlink()
    monkeypatch.setenv("SSD_INJECT_FAULT", "all")                   # a fault run
    plumbing.pytest_sessionfinish(finish, 0)
    assert not (folder / "gpu_tests.json.gz").exists()
    faults = ssd.tools.env.read_json(folder / "gpu_faults.json.gz")
    assert faults["faults"] == list(V.FAULTS) and "rows" not in faults
    assert faults["faults_caught_by_family"]["random"]["tile-zero"]["caught_norm"] == 1
    assert faults["faults_caught_by_family"]["edge"]["tile-zero"]["caught_norm"] == 0
    missed = ssd.tools.env.unpack_rows(faults["missed"])
    assert [r["fault"] for r in missed] == ["decay-off-by-one"]
