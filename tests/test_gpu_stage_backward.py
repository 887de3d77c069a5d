"""GPU tests of the backward's cuTile stage kernels (``pytest -m gpu``; skipped without a GPU).

Each ``<stage>_backward_cutile`` (``ssd.kernels.<stage>_backward``: state_passing, chunk_state,
chunk_cumsum) against its specification, the PyTorch ``<stage>_backward_torch`` of
``ssd.backward``, computed in float64 from exactly the same values: the inputs rounded to the
dtype under test (x, B, dt, the saved entering states) and fp32 where the forward leaves fp32
(dt_out, dA_cumsum, A, dt_bias), the forward intermediates from the float64 reference of those
inputs, and fresh N(0, 1) upstream gradients, fp32 but for dstates, which the backward stores
in the input dtype (a new seed per run, printed on failure; ``SSD_TEST_SEED`` replays one). The outputs are the kernels' own ``torch.empty`` buffers,
NaN-poisoned (``ssd.validate.poisoned_memory``), so an element no kernel writes fails. Each
result must have the torch function's keys, shapes and dtypes.

Both sides read the same rounded values and the kernels compute in fp32, so the error is fp32
arithmetic whatever the input dtype (:data:`STAGE_TOL`), except where a kernel rounds an MMA
operand to the input dtype (:data:`ROUNDING_STAGES`); what a wrong index, mask or decay does
is orders of magnitude larger.
"""
import math
import os
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import backward as TB  # noqa: E402
from ssd.config import (CumsumBackwardConfig, PassingBackwardConfig,  # noqa: E402
                        StateBackwardConfig)
from ssd.problem import EDGE_SHAPES, ProblemSpec, random_spec  # noqa: E402
from ssd.validate import (DTYPE_NAMES, GRAD_TOL, as_float64, device_inputs,  # noqa: E402
                          poisoned_memory, reference_of, rel_err)

pytestmark = pytest.mark.gpu

RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))

#: Relative error (Frobenius norm) of every stage output against the float64 torch function.
STAGE_TOL = {
    # fp32 sums of up to q p n products and exp2 within a few ulp: about 1e-6 in an fp32 NumPy
    # run of the same tile code; 2e-5 is the forward's fp32 tolerance (ssd.validate.TOL)
    "float32": 2e-5,
    # bf16 inputs reach both sides rounded alike, and the kernels compute in fp32 from them:
    # the same arithmetic, the same tolerance
    "bfloat16": 2e-5,
    # fp16 likewise: rounded alike on both sides, fp32 arithmetic
    "float16": 2e-5,
}
#: Stages whose MMAs take operands in the input dtype: chunk_state's backward reads dS in it (the
#: backward stores it so, and so does :func:`stage_problem`) and rounds w x once to it
#: (tensor-core MMAs; fp32 operands run on CUDA cores), as chunk_scan's backward rounds its
#: weights. In bf16 and fp16 their outputs take the gradients' bound (``ssd.validate.GRAD_TOL``:
#: an operand rounded once, fp32 accumulation); in fp32 nothing is rounded and STAGE_TOL holds.
#: (With dS rounded by the kernel alone, a float64 reference of the fp32 dS saw ddt_out elements
#: that cancel within their sum miss the element bound 5x in bf16, in a NumPy simulation.)
ROUNDING_STAGES = ("chunk_state",)
#: Every element within this many STAGE_TOL of max(|ref|, the reference's RMS): a sum's
#: rounding is a few ulp of its terms' scale, a wrong or unwritten tile is off by its own size.
ELEMENT_FACTOR = 10.0

#: Tiles smaller than the problem (several state slices, channel, state, row and head tiles, a
#: multi-tile second pass), so that every tile loop and cross-tile sum runs more than once.
SMALL = dict(passing=PassingBackwardConfig(block_p=16, block_n=8),
             state=StateBackwardConfig(block_s=16, block_p=16, block_n=16),
             cumsum=CumsumBackwardConfig(block_h=2, block_rows=2))
DEFAULT = dict(passing=PassingBackwardConfig(), state=StateBackwardConfig(),
               cumsum=CumsumBackwardConfig())

#: Edge shapes beyond ssd.problem's: one position, one chunk of a full chunk's length, eight
#: groups of one head with resets, and a model-like head and state (two state tiles).
EXTRA_SHAPES = {
    "l-one": ProblemSpec(2, 1, 4, 16, 16, 2, chunk_size=32, dt_bias=True, dt_softplus=True,
                         initial_states=True, name="l-one"),
    "ngroups-8": ProblemSpec(2, 70, 8, 16, 16, 8, chunk_size=16, dt_limit=(0.002, 0.05),
                             seq_boundaries=((0, 17, 69), (30,)), name="ngroups-8"),
    "model-like": ProblemSpec(2, 300, 4, 64, 128, 1, chunk_size=256, D="h", dt_bias=True,
                              dt_softplus=True, initial_states=True, seq_boundaries=(100, 256),
                              name="model-like"),
}
SHAPES = {**EDGE_SHAPES, **EXTRA_SHAPES}


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


def stage_problem(spec, seed, dtype, state_dtype=None):
    """(inputs, forward, upstream) on the GPU: the inputs as ``device_inputs`` rounds them; the
    forward's dt_out, dA_cumsum (fp32) and entering states (``state_dtype``, default the input
    dtype, as the fused stage 2 stores them) from the float64 reference of those inputs; fresh
    fp32 upstream gradients of every stage output."""
    inputs = device_inputs(spec, seed, dtype)
    ref = reference_of(spec, inputs)
    cuda = lambda a, t: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", t)  # noqa: E731
    forward = dict(dt_out=cuda(ref["dt_out"], torch.float32),
                   dA_cumsum=cuda(ref["dA_cumsum"], torch.float32),
                   prev_states=cuda(ref["prev_states"], getattr(torch, state_dtype or dtype)))
    rng = np.random.default_rng([seed, 1])
    shapes = dict(dprev_states=ref["prev_states"].shape, dfinal_states=ref["final_states"].shape,
                  dstates=ref["states"].shape, ddt_out=ref["dt_out"].shape,
                  ddA_cumsum=ref["dA_cumsum"].shape)
    upstream = {k: cuda(rng.standard_normal(s), torch.float32) for k, s in shapes.items()}
    # dstates in the input dtype, as the backward stores it (state_passing's dstates_dtype): both
    # sides then read the same rounded values
    upstream["dstates"] = upstream["dstates"].to(getattr(torch, dtype))
    return inputs, forward, upstream


def f64(d: dict) -> dict:
    """The float tensors of ``d`` in float64 (the same values), the others as they are."""
    return {k: v.double() if v is not None and v.is_floating_point() else v for k, v in d.items()}


def run_stages(spec, inputs, forward, upstream, configs=None, final=True, saved_dt=True):
    """{stage: result dict} of the three cuTile stage backwards, or with ``configs`` None of
    the torch functions on float64 copies of the same values."""
    cutile = configs is not None
    i, fw, up = (d if cutile else f64(d) for d in (inputs, forward, upstream))
    kw = (lambda name: dict(config=configs[name])) if cutile else (lambda name: {})  # noqa: E731
    table = TB.cutile_backwards() if cutile else TB.TORCH_BACKWARDS
    return dict(
        state_passing=table.state_passing(
            up["dprev_states"], fw["prev_states"], fw["dA_cumsum"], i.get("initial_states"),
            i.get("seq_idx"), dfinal_states=up["dfinal_states"] if final else None,
            **kw("passing")),
        chunk_state=table.chunk_state(up["dstates"], i["B"], i["x"], fw["dt_out"],
                                      fw["dA_cumsum"], i.get("seq_idx"), **kw("state")),
        chunk_cumsum=table.chunk_cumsum(
            up["ddt_out"], up["ddA_cumsum"], i["dt"], i["A"], spec.chunk_size, i.get("dt_bias"),
            spec.dt_softplus, spec.dt_limit, dt_out=fw["dt_out"] if saved_dt else None,
            **kw("cumsum")))


def check_stages(spec, dtype, seed, configs=DEFAULT, state_dtype=None, final=True,
                 saved_dt=True):
    """Every output of every stage against the float64 torch function: keys (and their order),
    shape, dtype (fp32, the upstream gradients'), the norm and the worst element."""
    inputs, forward, upstream = stage_problem(spec, seed, dtype, state_dtype)
    with poisoned_memory():
        got = run_stages(spec, inputs, forward, upstream, configs, final, saved_dt)
        torch.cuda.synchronize()
    want = run_stages(spec, inputs, forward, upstream, None, final, saved_dt)
    failures = []
    for stage, outputs in want.items():
        assert list(got[stage]) == list(outputs), f"{stage}: keys {list(got[stage])}"
        rounded = stage in ROUNDING_STAGES and dtype != "float32"
        tol = GRAD_TOL[dtype] if rounded else STAGE_TOL[dtype]
        for key, ref in outputs.items():
            out = got[stage][key]
            assert out.shape == ref.shape and out.dtype == torch.float32, \
                f"{stage} {key}: {tuple(out.shape)} {out.dtype}"
            ref = as_float64(ref)
            err = rel_err(out, ref)
            rms = math.sqrt(float(np.mean(ref ** 2))) if ref.size else 0.0
            ratio = np.abs(as_float64(out) - ref) / (
                ELEMENT_FACTOR * tol * np.maximum(np.abs(ref), rms if rms > 0 else 1.0))
            ratio = np.where(np.isfinite(ratio), ratio, np.inf)  # an unwritten (NaN) element
            index = np.unravel_index(np.argmax(ratio), ratio.shape) if ref.size else ()
            worst = float(ratio[index]) if ref.size else 0.0
            if not (err <= tol and worst <= 1.0):
                failures.append(f"{stage} {key}: relative error {err:.3e} (tolerance {tol:.0e}), "
                                f"worst element {tuple(int(j) for j in index)} at {worst:.3g}x")
    assert not failures, f"{spec} [{dtype}, seed {seed}]: " + "; ".join(failures)
    return got


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_edge_shapes(name, dtype):
    """Every named edge shape (l < q, l % q != 0, l = 1, one chunk, ngroups 1 / 2 / 3 / 8,
    seq_idx resets at and inside chunk borders, initial states, dt_bias, softplus and the clamp)
    in every dtype, the default tiles, every stage."""
    check_stages(SHAPES[name], dtype, seed_for(name + dtype))


@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "headdim-not-pow2",
                                  "dstate-ne-chunk", "ngroups-8", "model-like"])
def test_small_tiles(name):
    """Tiles smaller than the problem: several state slices summed by the second pass, the
    channel, state and row tile loops, several head blocks and rows of chunk parts."""
    check_stages(SHAPES[name], "bfloat16", seed_for("small" + name), configs=SMALL)


@pytest.mark.parametrize("which", ["no-dfinal-states", "dt-out-recomputed", "fp32-states"])
def test_options(which):
    """No gradient on final_states (R starts at 0); chunk_cumsum's backward recomputing dt'
    instead of reading the forward's; entering states saved in fp32 (split stage 2)."""
    spec = EDGE_SHAPES["all-features"]
    check_stages(spec, "bfloat16", seed_for("opt" + which), final=which != "no-dfinal-states",
                 saved_dt=which != "dt-out-recomputed",
                 state_dtype="float32" if which == "fp32-states" else None)


@pytest.mark.parametrize("index", range(12))
def test_random_shapes(index):
    """Random shapes and feature sets (ssd.problem.random_spec), the dtype drawn per case."""
    spec = random_spec(np.random.default_rng(seed_for(f"stage-random{index}")))
    check_stages(spec, DTYPE_NAMES[index % 3], seed_for(f"stage-r{index}"))


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "l-not-multiple",
                                  "ngroups-8", "model-like"])
def test_state_passing_forms_dprev_states_in_its_walk(name, dtype):
    """Given chunk_scan's dy and C (``ssd.backward.EnteringGradient``, as the default backward
    passes them) in place of dprev_states, the walk forms each chunk's, on the default tiles and
    on state slices smaller than the state. Against the torch function given the float64
    dprev_states of chunk_scan_backward_torch on the same values. The walk rounds e^{a} C to the
    dtype's MMA operand as chunk_scan's states kernel does, so the bound is the gradients'
    (``ssd.validate.GRAD_TOL``), not STAGE_TOL's fp32 one."""
    from ssd.launch import chunk_seq_last
    from ssd.validate import check_gradient

    spec = SHAPES[name]
    seed = seed_for("walk" + name + dtype)
    inputs, forward, upstream = stage_problem(spec, seed, dtype)
    dy = torch.from_numpy(np.random.default_rng([seed, 2]).standard_normal(
        inputs["x"].shape)).to("cuda", inputs["x"].dtype)
    seq = inputs.get("seq_idx")
    f64 = lambda t: None if t is None else t.cpu().double() if t.is_floating_point() \
        else t.cpu()  # noqa: E731
    dprev = TB.chunk_scan_backward_torch(
        f64(dy), f64(inputs["B"]), f64(inputs["C"]), f64(inputs["x"]), f64(forward["dt_out"]),
        f64(forward["dA_cumsum"]), f64(forward["prev_states"]), seq_idx=f64(seq))["dprev_states"]
    args = (forward["prev_states"], forward["dA_cumsum"], inputs.get("initial_states"), seq)
    want = TB.state_passing_backward_torch(dprev, *map(f64, args),
                                           dfinal_states=f64(upstream["dfinal_states"]))
    unformed = TB.EnteringGradient(dy, inputs["C"].to(dy.dtype),
                                   None if seq is None else chunk_seq_last(seq, spec.chunk_size))
    failures = []
    for config in (PassingBackwardConfig(), SMALL["passing"]):
        with poisoned_memory():
            got = TB.cutile_backwards().state_passing(
                unformed, *args, dfinal_states=upstream["dfinal_states"], config=config)
        torch.cuda.synchronize()
        assert list(got) == list(want)
        for key, ref in want.items():
            result = check_gradient(key, got[key], ref.numpy(), dtype)
            if not result.ok:
                failures.append(f"{config}: {result.failure()}")
    assert not failures, f"{spec} [{dtype}, seed {seed}]: " + "; ".join(failures)


def test_bitwise_identical_reruns():
    """Two runs give the same bits: the cross-block sums (state slices, dA and ddt_bias over
    (b, l)) are two passes in a fixed order, no atomics."""
    spec = EXTRA_SHAPES["model-like"]
    inputs, forward, upstream = stage_problem(spec, seed_for("stage-rerun"), "bfloat16")
    first, second = (run_stages(spec, inputs, forward, upstream, SMALL) for _ in range(2))
    for stage, outputs in first.items():
        for key, value in outputs.items():
            assert torch.equal(value, second[stage][key]), f"{stage} {key} differs"
