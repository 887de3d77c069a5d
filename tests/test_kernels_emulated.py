"""The cuTile kernels' tile code run on the CPU by tests/tile_emulator.py, against the float64
PyTorch and NumPy references: every backward stage, the forward's stages in each layout (split
and fused stage 2, the grouped walk, the fused scan, chunk_scan's tilings), the varlen states,
the layer's conv and norm with their backwards, the conv's decode step, and the SSM decode step.
Index arithmetic, masks, padding and which elements each kernel writes (outputs poisoned with NaN) are checked in CI without a GPU; the
rounding of real MMAs, scheduling and speed are the GPU tests' (tests/test_gpu_*.py).

Small shapes and few blocks (the emulator runs a block's Python body per block): the edge
cases are l < q, l % q != 0, l = 1, several groups, packed sequences (seq_idx), with and without
each optional input, tiles smaller than the chunk and the state.
"""
import dataclasses
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

import cuda.tile as ct  # noqa: E402

import tile_emulator as emu  # noqa: E402
from ssd import backward as TB  # noqa: E402
from ssd.api import forward_stages  # noqa: E402
from ssd import layer_reference as layer_ref  # noqa: E402
from ssd.config import (Conv1dConfig, ConvStepConfig, CumsumBackwardConfig,  # noqa: E402
                        GatedNormConfig, PassingBackwardConfig, ScanBackwardConfig,
                        StateBackwardConfig, StateUpdateConfig, default_config)
from ssd.kernels import causal_conv1d as CONV  # noqa: E402
from ssd.kernels import chunk_cumsum_backward as CUMSUM  # noqa: E402
from ssd.kernels import chunk_scan_backward as SCAN  # noqa: E402
from ssd.kernels import chunk_state_backward as STATE  # noqa: E402
from ssd.kernels import conv_step as STEP  # noqa: E402
from ssd.kernels import gated_rmsnorm as NORM  # noqa: E402
from ssd.kernels import state_passing_backward as PASSING  # noqa: E402
from ssd.kernels import state_update as UPDATE  # noqa: E402
from ssd.launch import capture  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec, random_spec  # noqa: E402
from ssd.reference import check_shapes, chunk_state_varlen  # noqa: E402
from ssd.reference import selective_state_update as reference_step  # noqa: E402
from ssd.validate import poisoned_memory  # noqa: E402

# fp32 arithmetic against float64 references of the same (fp32-rounded) inputs: the emulated
# MMAs are exact, so what remains is fp32 rounding of elementwise terms and short sums.
RTOL = 2e-5
# fp16 MMA operands (weights, dy, entering states rounded to 2^-11) in sums of a few dozen
# terms: errors up to about 5e-4 of the largest magnitude on these shapes
FP16_RTOL = 3e-3
# bf16 operands (2^-8, eight times fp16's unit roundoff) in the same sums
BF16_RTOL = 8 * FP16_RTOL
HALF = {"float16": (torch.float16, FP16_RTOL), "bfloat16": (torch.bfloat16, BF16_RTOL)}

SHAPES = {
    "l-less-than-q": EDGE_SHAPES["l-less-than-q"].replace(batch=1, nheads=2),
    "l-not-multiple": EDGE_SHAPES["l-not-multiple"].replace(batch=1, nheads=2, headdim=8,
                                                            dstate=8, chunk_size=16, seqlen=37),
    "l-one": ProblemSpec(1, 1, 2, 8, 8, 1, chunk_size=16, initial_states=True, dt_bias=True,
                         dt_softplus=True, name="l-one"),
    "ngroups-2-seq-idx": ProblemSpec(1, 40, 4, 8, 8, 2, chunk_size=16, initial_states=True,
                                     seq_boundaries=((0, 16, 23, 39),), name="ngroups-2-seq-idx"),
    "all-features": EDGE_SHAPES["all-features"].replace(batch=1, seqlen=45,
                                                        seq_boundaries=((3, 16, 33),)),
    "full-chunks": ProblemSpec(2, 32, 4, 12, 8, 2, chunk_size=16, D="h", z=True,
                               initial_states=True, seq_boundaries=((5, 16), (0, 20)),
                               name="full-chunks"),
}


# chunk_scan's backward also on a chunk of several default tiles (q128: 64-row tiles), eight
# groups, a head width that is no power of two, one position, and D without z
SCAN_SHAPES = {
    "q128": ProblemSpec(2, 300, 4, 24, 40, 2, chunk_size=128,
                        seq_boundaries=((5, 130, 200), (0, 64, 255)), name="q128"),
    "ngroups-8": ProblemSpec(1, 70, 16, 8, 8, 8, chunk_size=32, seq_boundaries=((10, 33, 64),),
                             name="ngroups-8"),
    "headdim-not-pow2": EDGE_SHAPES["headdim-not-pow2"],
    "D-per-head": EDGE_SHAPES["D-per-head"],        # the skip's gradients in the columns kernel,
    "D-per-channel": EDGE_SHAPES["D-per-channel"],  # without a gate around them
    "l-one-q32": ProblemSpec(2, 1, 4, 16, 16, 1, chunk_size=32, name="l-one-q32"),
}


def close(got, want, what, rtol=RTOL):
    """``got`` (any float tensor) equals the float64 ``want`` to RTOL of want's largest
    magnitude; NaN (an element no block wrote) fails."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements " \
                                      "not written (NaN poison) or not finite"
    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    assert err < rtol, f"{what}: relative error {err:.2e}"


def problem(name, seed=5):
    """For ``name`` (a key of SHAPES, or a ProblemSpec): inputs as fp32 tensors (their float64
    copies are the references' inputs), the float64 forward's intermediates, and random upstream
    gradients for each stage."""
    spec = SHAPES[name] if isinstance(name, str) else name
    inputs = {k: torch.from_numpy(v) for k, v in spec.make_inputs(seed).items()}
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    ref = spec.reference({k: v.double().numpy() if v.is_floating_point() else v.numpy()
                          for k, v in inputs.items()})
    ref = {k: torch.from_numpy(v).float().double() for k, v in ref.items()}
    rng = np.random.default_rng(seed)
    grads = {k: torch.from_numpy(rng.standard_normal(ref[v].shape)).float().double()
             for k, v in (("dstates", "states"), ("dprev_states", "prev_states"),
                          ("dfinal_states", "final_states"), ("ddt_out", "dt_out"),
                          ("ddA_cumsum", "dA_cumsum"), ("dy", "y"))}
    return spec, inputs, ref, grads


def emulated(launcher, *args, **kwargs):
    """``launcher(*args, **kwargs)`` with its kernels emulated and its buffers NaN-poisoned."""
    with poisoned_memory(), emu.emulated():
        return launcher(*args, **kwargs)


# --- backward stages --------------------------------------------------------------------------

SMALL_BACKWARD = dict(cumsum=CumsumBackwardConfig(block_h=2, block_rows=2),
                      state=StateBackwardConfig(block_s=8, block_p=8, block_n=4, head_splits=1),
                      passing=PassingBackwardConfig(block_p=8, block_n=4),
                      scan=ScanBackwardConfig(block_q=8, block_k=8, block_n=4, head_splits=1))
CONFIGS = {"default": {}, "small-tiles": SMALL_BACKWARD}


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_state_passing_backward(name, tiles):
    spec, t, ref, g = problem(name)
    config = CONFIGS[tiles].get("passing", PassingBackwardConfig())
    init, seq = t.get("initial_states"), t.get("seq_idx")
    for dfinal in (g["dfinal_states"], None):
        want = TB.state_passing_backward_torch(g["dprev_states"], ref["prev_states"],
                                               ref["dA_cumsum"], init, seq, dfinal_states=dfinal)
        got = emulated(PASSING.state_passing_backward_cutile, g["dprev_states"].float(),
                       ref["prev_states"].float(), ref["dA_cumsum"].float(), init, seq,
                       dfinal_states=None if dfinal is None else dfinal.float(), config=config)
        assert list(got) == list(want)
        for k in want:
            close(got[k], want[k], k)


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_chunk_state_backward(name, tiles):
    spec, t, ref, g = problem(name)
    config = CONFIGS[tiles].get("state", StateBackwardConfig())
    seq = t.get("seq_idx")
    want = TB.chunk_state_backward_torch(g["dstates"], t["B"].double(), t["x"].double(),
                                         ref["dt_out"], ref["dA_cumsum"], seq)
    got = emulated(STATE.chunk_state_backward_cutile, g["dstates"].float(), t["B"], t["x"],
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), seq, config=config)
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k], k)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["l-not-multiple", "ngroups-2-seq-idx", "full-chunks"])
def test_chunk_state_backward_half_inputs(name, dtype):
    """fp16 or bf16 x and B: the MMAs take operands in that dtype (dS and w x rounded once to
    it; the emulator enforces the operands' matching dtypes), fp32 accumulation; against the
    float64 function of the same rounded values, within the operands' rounding."""
    half, rtol = HALF[dtype]
    spec, t, ref, g = problem(name)
    B, x = t["B"].to(half), t["x"].to(half)
    want = TB.chunk_state_backward_torch(g["dstates"], B.double(), x.double(), ref["dt_out"],
                                         ref["dA_cumsum"], t.get("seq_idx"))
    got = emulated(STATE.chunk_state_backward_cutile, g["dstates"].float(), B, x,
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), t.get("seq_idx"),
                   config=SMALL_BACKWARD["state"])
    for k in want:
        close(got[k], want[k], k, rtol=rtol)


@pytest.mark.parametrize("name", ["l-not-multiple", "ngroups-2-seq-idx"])
def test_dstates_stored_in_the_dtype_chunk_state_reads(name):
    """The backward asks state_passing for dstates in x's dtype (``dstates_dtype``): the walk
    stores R rounded once, the rest stays fp32, and chunk_state reads the rounded dstates as its
    MMA operand, computing and returning fp32."""
    spec, t, ref, g = problem(name)
    init, seq = t.get("initial_states"), t.get("seq_idx")
    walk = emulated(PASSING.state_passing_backward_cutile, g["dprev_states"].float(),
                    ref["prev_states"].float(), ref["dA_cumsum"].float(), init, seq,
                    dfinal_states=g["dfinal_states"].float(), dstates_dtype=torch.float16,
                    config=SMALL_BACKWARD["passing"])
    want = TB.state_passing_backward_torch(g["dprev_states"], ref["prev_states"],
                                           ref["dA_cumsum"], init, seq,
                                           dfinal_states=g["dfinal_states"])
    assert walk["dstates"].dtype == torch.float16
    assert all(v.dtype == torch.float32 for k, v in walk.items() if k != "dstates")
    for k in want:
        close(walk[k], want[k], k, rtol=FP16_RTOL if k == "dstates" else RTOL)
    B, x = t["B"].half(), t["x"].half()
    got = emulated(STATE.chunk_state_backward_cutile, walk["dstates"], B, x,
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), seq,
                   config=SMALL_BACKWARD["state"])
    assert all(v.dtype == torch.float32 for v in got.values())
    want = TB.chunk_state_backward_torch(walk["dstates"].double(), B.double(), x.double(),
                                         ref["dt_out"], ref["dA_cumsum"], seq)
    for k in want:
        close(got[k], want[k], k, rtol=FP16_RTOL)


@pytest.mark.parametrize("name", ["l-not-multiple", "ngroups-2-seq-idx"])
def test_chunk_state_backward_adds_dx_prior(name):
    """With dx_prior (chunk_scan's dx, as the backward passes it), the dx kernel adds it to its
    own part, every element, padded tails included, and writes the sum in dx_dtype (x's, where
    dx is the final gradient); dx_prior is only read."""
    spec, t, ref, g = problem(name)
    prior = torch.randn(t["x"].shape, generator=torch.Generator().manual_seed(3))
    want = TB.chunk_state_backward_torch(g["dstates"], t["B"].double(), t["x"].double(),
                                         ref["dt_out"], ref["dA_cumsum"], t.get("seq_idx"))
    for dtype, rtol in ((None, RTOL), (torch.float16, FP16_RTOL)):
        kept = prior.clone()
        got = emulated(STATE.chunk_state_backward_cutile, g["dstates"].float(), t["B"], t["x"],
                       ref["dt_out"].float(), ref["dA_cumsum"].float(), t.get("seq_idx"),
                       dx_prior=kept, dx_dtype=dtype, config=SMALL_BACKWARD["state"])
        assert got["dx"].dtype == (dtype or torch.float32) and torch.equal(kept, prior)
        close(got["dx"], want["dx"] + prior.double(), f"dx {dtype}", rtol=rtol)
    with pytest.raises(ValueError, match="dx_prior: must be contiguous"):
        strided = prior.transpose(1, 2).contiguous().transpose(1, 2)
        STATE.chunk_state_backward_cutile(g["dstates"].float(), t["B"], t["x"],
                                          ref["dt_out"].float(), ref["dA_cumsum"].float(),
                                          dx_prior=strided)


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_chunk_cumsum_backward(name, tiles):
    spec, t, ref, g = problem(name)
    config = CONFIGS[tiles].get("cumsum", CumsumBackwardConfig())
    bias = t.get("dt_bias")
    options = dict(dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
    for saved in (True, False):  # the forward's dt' given, or recomputed in the kernel
        want = TB.chunk_cumsum_backward_torch(
            g["ddt_out"], g["ddA_cumsum"], t["dt"].double(), t["A"].double(), spec.chunk_size,
            None if bias is None else bias.double(), **options,
            dt_out=ref["dt_out"] if saved else None)
        got = emulated(CUMSUM.chunk_cumsum_backward_cutile, g["ddt_out"].float(),
                       g["ddA_cumsum"].float(), t["dt"], t["A"], spec.chunk_size, bias, **options,
                       dt_out=ref["dt_out"].float() if saved else None, config=config)
        assert list(got) == list(want)
        for k in want:
            close(got[k], want[k], f"{k} (dt_out {'given' if saved else 'recomputed'})")


def check_inputs_on_cpu(dy, B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None,
                        seq_idx=None):
    """chunk_scan_backward's input check but its last one, that the tensors are on a GPU."""
    try:
        return SCAN_CHECK_INPUTS(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx)
    except ValueError as e:
        if "must be a CUDA tensor" not in str(e):
            raise
    shapes = dict(x=x, B=B, C=C, D=D, z=z, seq_idx=seq_idx, dt_out=dt_out, dA_cumsum=dA_cumsum,
                  prev_states=prev_states)
    return check_shapes(chunk_size=int(dA_cumsum.shape[-1]),
                        **{k: None if v is None else tuple(v.shape) for k, v in shapes.items()})


SCAN_CHECK_INPUTS = SCAN.check_inputs


def scan_backward(name, config, monkeypatch):
    """chunk_scan_backward_cutile's result against chunk_scan_backward_torch's."""
    spec, t, ref, g = problem(name)
    monkeypatch.setattr(SCAN, "check_inputs", check_inputs_on_cpu)
    D, z, seq = t.get("D"), t.get("z"), t.get("seq_idx")
    want = TB.chunk_scan_backward_torch(
        g["dy"], t["B"].double(), t["C"].double(), t["x"].double(), ref["dt_out"],
        ref["dA_cumsum"], ref["prev_states"], None if D is None else D.double(),
        None if z is None else z.double(), seq)
    got = emulated(TB.chunk_scan_backward_cutile, g["dy"].float(), t["B"], t["C"], t["x"],
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), ref["prev_states"].float(), D,
                   z, seq, config=config)
    assert list(got) == list(want)
    assert isinstance(got["dprev_states"], TB.EnteringGradient) == config.dprev_in_walk
    close_scan(got, want, t, ref, g)


def close_scan(got, want, t, ref, g, rtol=RTOL):
    """chunk_scan's backward results against the float64 ones; an unformed dprev_states
    (EnteringGradient) through the walk that forms it: state_passing's backward from it against
    the float64 one from the formed tensor."""
    for k in want:
        if not isinstance(got[k], TB.EnteringGradient):
            close(got[k], want[k], k, rtol=rtol)
            continue
        kw = dict(initial_states=t.get("initial_states"), seq_idx=t.get("seq_idx"))
        walk = emulated(PASSING.state_passing_backward_cutile, got[k], ref["prev_states"].float(),
                        ref["dA_cumsum"].float(), **kw, dfinal_states=g["dfinal_states"].float(),
                        config=SMALL_BACKWARD["passing"])
        walked = TB.state_passing_backward_torch(want[k], ref["prev_states"], ref["dA_cumsum"],
                                                 **kw, dfinal_states=g["dfinal_states"])
        for j in walked:
            close(walk[j], walked[j], f"{j} of the walk that forms {k}", rtol=rtol)


@pytest.mark.parametrize("dprev", ["walk", "kernel"])
@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_chunk_scan_backward(name, tiles, dprev, monkeypatch):
    """dprev_states formed in state_passing's walk (the default) or by chunk_scan's states
    kernel."""
    config = CONFIGS[tiles].get("scan", ScanBackwardConfig())
    scan_backward(name, dataclasses.replace(config, dprev_in_walk=dprev == "walk"), monkeypatch)


@pytest.mark.parametrize("name", SCAN_SHAPES)
def test_chunk_scan_backward_default_tiles(name, monkeypatch):
    scan_backward(SCAN_SHAPES[name], ScanBackwardConfig(), monkeypatch)


@pytest.mark.parametrize("name", ["ngroups-2-seq-idx", "full-chunks", "l-not-multiple"])
def test_chunk_scan_backward_head_splits(name, monkeypatch):
    """Each head its own block (head_splits = the heads per group), the runs' dB and dC summed
    after the kernels, on tiles that make several row and column blocks a chunk."""
    spec = SHAPES[name]
    splits = spec.nheads // spec.ngroups
    assert splits > 1
    scan_backward(name, dataclasses.replace(SMALL_BACKWARD["scan"], head_splits=splits),
                  monkeypatch)


@pytest.mark.parametrize("name", ["l-not-multiple", "full-chunks", "ngroups-2-seq-idx"])
@pytest.mark.parametrize("rows", [8, 16])
def test_chunk_scan_backward_rows_take_their_own_tiles(name, rows, monkeypatch):
    """The rows kernel with tiles other than the columns kernel's (16 and 8 positions): it
    completes ddA_cumsum's column part position by position, whatever tiling wrote it."""
    columns = 16 if rows == 8 else 8
    scan_backward(name, dataclasses.replace(SMALL_BACKWARD["scan"], block_q=columns,
                                            rows_block_q=rows), monkeypatch)


def folded_backward(name, config, monkeypatch, dtype="float32"):
    """chunk_scan's backward with chunk_state's folded into its kernels (``walk`` given) against
    the float64 stages run one after the other: chunk_scan's, state_passing's from its
    dprev_states, chunk_state's from that walk's dstates; dx, dB, ddt_out and ddA_cumsum hold
    both stages' parts, and the walk's result comes back under "passing". ``dtype``: x, B, C,
    dy and the entering states' (the references read the same rounded values)."""
    spec, t, ref, g = problem(name)
    half, rtol = HALF.get(dtype, (torch.float32, RTOL))
    t = {k: v.to(half) if k in ("x", "B", "C") else v for k, v in t.items()}
    g["dy"] = g["dy"].to(half).double()
    ref["prev_states"] = ref["prev_states"].to(half).double()
    monkeypatch.setattr(SCAN, "check_inputs", check_inputs_on_cpu)
    D, z, seq = t.get("D"), t.get("z"), t.get("seq_idx")
    kw = dict(initial_states=t.get("initial_states"), seq_idx=seq)
    scan = TB.chunk_scan_backward_torch(
        g["dy"], t["B"].double(), t["C"].double(), t["x"].double(), ref["dt_out"],
        ref["dA_cumsum"], ref["prev_states"], None if D is None else D.double(),
        None if z is None else z.double(), seq)
    passing = TB.state_passing_backward_torch(scan.pop("dprev_states"), ref["prev_states"],
                                              ref["dA_cumsum"], **kw,
                                              dfinal_states=g["dfinal_states"])
    state = TB.chunk_state_backward_torch(passing["dstates"], t["B"].double(), t["x"].double(),
                                          ref["dt_out"], ref["dA_cumsum"], seq)
    for k in ("dx", "dB", "ddt_out", "ddA_cumsum"):
        scan[k] = scan[k] + state[k]

    def walk(dprev_states):
        return PASSING.state_passing_backward_cutile(
            dprev_states, ref["prev_states"].float(), ref["dA_cumsum"].float(), **kw,
            dfinal_states=g["dfinal_states"].float(), config=SMALL_BACKWARD["passing"])

    got = emulated(TB.chunk_scan_backward_cutile, g["dy"].to(half), t["B"], t["C"], t["x"],
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), ref["prev_states"].to(half),
                   D, z, seq, config=config, walk=walk, dx_dtype=torch.float16)
    assert got["dx"].dtype == torch.float16  # where dx is final: the caller's dtype
    assert sorted(got) == sorted([*scan, "passing"])
    for k in scan:
        close(got[k], scan[k], k, rtol=max(rtol, FP16_RTOL) if k == "dx" else rtol)
    for k in passing:
        close(got["passing"][k], passing[k], f"{k} of the walk", rtol=rtol)


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_chunk_state_backward_folds_into_chunk_scan_backward(name, tiles, monkeypatch):
    folded_backward(name, CONFIGS[tiles].get("scan", ScanBackwardConfig()), monkeypatch)


@pytest.mark.parametrize("name", ["q128", "ngroups-8", "l-one-q32"])
def test_chunk_state_backward_folds_at_default_tiles(name, monkeypatch):
    folded_backward(SCAN_SHAPES[name], ScanBackwardConfig(), monkeypatch)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("name", ["full-chunks", "ngroups-2-seq-idx", "all-features"])
def test_chunk_state_backward_folds_on_half_inputs(name, dtype, monkeypatch):
    """The MMAs' operands in x's dtype, dS among them (as chunk_state's own kernels round it)."""
    folded_backward(name, SMALL_BACKWARD["scan"], monkeypatch, dtype)


@pytest.mark.parametrize("name", ["l-not-multiple", "full-chunks", "ngroups-2-seq-idx"])
@pytest.mark.parametrize("rows", [8, 16])
def test_folded_sum_reaches_the_last_column_through_any_tiling(name, rows, monkeypatch):
    """chunk_state's sum over a chunk, which its last column takes, gathered from the columns
    kernel's blocks by the rows kernel's last block, whatever either's tiles; with each head its
    own block as well."""
    spec = SHAPES[name]
    config = dataclasses.replace(SMALL_BACKWARD["scan"], block_q=16 if rows == 8 else 8,
                                 rows_block_q=rows, head_splits=spec.nheads // spec.ngroups)
    folded_backward(name, config, monkeypatch)


@pytest.mark.parametrize("name", ["all-features", "full-chunks", "l-one"])
def test_backward_composes_the_folded_stages(name, monkeypatch):
    """ssd_chunked_backward with StageBackwards.fold: the walk, then chunk_scan's kernels with
    chunk_state's backward folded in, then chunk_cumsum's; chunk_scan's and chunk_state's own
    entries are never called. Every gradient against the PyTorch stages' in float64."""
    spec, t, ref, g = problem(name)
    monkeypatch.setattr(SCAN, "check_inputs", check_inputs_on_cpu)
    calls = []

    def spy(stage, fn):
        def call(*args, **kwargs):
            calls.append(stage)
            return fn(*args, **kwargs)
        return call

    table = TB.StageBackwards(*(spy(k, fn) for k, fn in TB.cutile_backwards(fold=True)._asdict()
                                .items()))
    kw = dict(D=t.get("D"), z=t.get("z"), dt_bias=t.get("dt_bias"),
              initial_states=t.get("initial_states"), seq_idx=t.get("seq_idx"),
              dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)
    args = [t[k] for k in ("x", "dt", "A", "B", "C")] + [spec.chunk_size]
    got = emulated(TB.ssd_chunked_backward, g["dy"].float(), *args, **kw,
                   dfinal_states=g["dfinal_states"].float(), backwards=table)
    assert calls == ["fold", "state_passing", "chunk_cumsum"]
    double = {k: v.double() if v is not None and v.is_floating_point() else v
              for k, v in kw.items() if not isinstance(v, (bool, tuple))}
    want = TB.ssd_chunked_backward_torch(g["dy"], *[a.double() for a in args[:-1]], args[-1],
                                         **{**kw, **double}, dfinal_states=g["dfinal_states"])
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k], k)


def test_fold_needs_the_walk_to_form_dprev_states(monkeypatch):
    with pytest.raises(ValueError, match="walk: chunk_state's backward folds"):
        folded_backward("full-chunks", ScanBackwardConfig(dprev_in_walk=False), monkeypatch)


def test_head_splits_must_divide_the_heads_per_group(monkeypatch):
    with pytest.raises(ValueError, match="head_splits=3 must divide the heads per group"):
        scan_backward("full-chunks", dataclasses.replace(SMALL_BACKWARD["scan"], head_splits=3),
                      monkeypatch)


def test_chunk_scan_backward_rebuilds_y():
    """The rows kernel's y_ssm (the gate's gradient reads it) is chunk_scan's SSM part."""
    spec, t, ref, g = problem("ngroups-2-seq-idx")
    got = emulated(SCAN.chunk_scan_backward, g["dy"].float(), t["B"], t["C"], t["x"],
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), ref["prev_states"].float(),
                   t["seq_idx"], config=SMALL_BACKWARD["scan"], rebuild_y=True)
    want = TB.chunk_scan_torch(t["B"].double(), t["C"].double(), t["x"].double(), ref["dt_out"],
                               ref["dA_cumsum"], ref["prev_states"], seq_idx=t["seq_idx"])
    close(got["y_ssm"], want, "y_ssm")


def _causal_without_diagonal(t_pos, s_pos, seq_t, seq_s, HAS_SEQ):
    keep = t_pos > s_pos  # the mutation: the diagonal (s = t) dropped
    if HAS_SEQ:
        keep = keep & (seq_t == seq_s)
    return keep


def _end_decay_one_early(dA_cumsum, ib, ih, ic, Q, BLOCK_K):
    tail = ct.load(dA_cumsum, index=(ib, ih, ic, Q // BLOCK_K - 1), shape=(1, 1, 1, BLOCK_K))
    return ct.extract(tail.reshape((BLOCK_K,)), index=(BLOCK_K // 2 - 1,), shape=(1,))


def _columns_without_the_tail(*args):
    a = inspect.signature(SCAN_COLUMN_BLOCK).bind(*args).arguments
    if a["ic"] * a["Q"] + a["js"] * a["BLOCK_Q"] < a["seqlen"]:  # the mutation: tiles past the
        SCAN_COLUMN_BLOCK(*args)  # end left unwritten


SCAN_COLUMN_BLOCK = SCAN.column_block


@pytest.mark.parametrize("mutation", ["causal-mask-off-by-one", "end-decay-wrong-column",
                                      "tail-unwritten"])
def test_a_broken_kernel_fails(mutation, monkeypatch):
    """The emulated tests can fail: a deliberately broken helper of the tile code (an
    off-by-one causal mask; the chunk's decay read from a wrong column; the gradients of row
    tiles past the sequence end never stored) makes them fail."""
    if mutation == "causal-mask-off-by-one":
        monkeypatch.setattr(SCAN, "pair_keep", _causal_without_diagonal)
        with pytest.raises(AssertionError, match="relative error"):
            scan_backward("l-not-multiple", SMALL_BACKWARD["scan"], monkeypatch)
    elif mutation == "end-decay-wrong-column":
        monkeypatch.setattr(PASSING, "chunk_end_decay", _end_decay_one_early)
        with pytest.raises(AssertionError, match="relative error"):
            test_state_passing_backward("l-not-multiple", "small-tiles")
    else:
        monkeypatch.setattr(SCAN, "column_block", _columns_without_the_tail)
        with pytest.raises(AssertionError, match="not written"):
            scan_backward("l-less-than-q", SMALL_BACKWARD["scan"], monkeypatch)


@pytest.mark.parametrize("fold", [True, False], ids=["fold", "stages"])
def test_the_layers_backward_makes_no_pytorch_pass_over_x(fold, monkeypatch, torch_ops):
    """The SSD's backward as the layer calls it (D per head, dt_bias, softplus, no z): around the
    kernels PyTorch writes nothing of x's size but the kernels' own outputs (torch.empty): the
    skip's gradients come from chunk_scan's columns kernel, which with chunk_state's backward
    folded in (the default) writes dx once in x's dtype, and chunk_state's own dx kernel adds
    chunk_scan's dx and writes the sum in x's dtype, so neither way leaves a sum, skip or cast
    pass over (b, l, h, p) (each would cost a read and a write of x's size, in fp32)."""
    spec = SHAPES["full-chunks"].replace(z=False, dt_bias=True, dt_softplus=True)
    _, t, ref, g = problem(spec)
    monkeypatch.setattr(SCAN, "check_inputs", check_inputs_on_cpu)
    args = {k: t[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "seq_idx")}
    saved = {k: ref[k].float() for k in ("dt_out", "dA_cumsum", "prev_states")}
    dy = g["dy"].float()
    with capture() as launches, torch_ops() as ops:  # the host's work only: kernels recorded
        grads = TB.ssd_chunked_backward(dy, args.pop("x"), args.pop("dt"), args.pop("A"),
                                        args.pop("B"), args.pop("C"), spec.chunk_size, **args,
                                        dt_softplus=True, **saved,
                                        backwards=TB.cutile_backwards(fold),
                                        dx_dtype=torch.float16)
    assert grads["dx"].dtype == torch.float16 and len(launches) >= (6 if fold else 8)
    full = {name.split(".")[0] for name, shape in zip(ops.names, ops.shapes)
            if shape == tuple(t["x"].shape)}
    assert full == {"empty"}, full


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes(seed, monkeypatch):
    """Every backward stage and the forward on a random small problem (ssd.problem.random_spec:
    any chunk size, groups, head and state widths, features), with random tiles."""
    rng = np.random.default_rng(100 + seed)
    spec = random_spec(rng, max_chunks=2)
    pick = lambda *v: int(rng.choice(v))  # noqa: E731
    tiles = dict(cumsum=CumsumBackwardConfig(block_h=pick(1, 2, 8), block_rows=pick(1, 4)),
                 state=StateBackwardConfig(block_s=pick(8, 16), block_p=pick(8, 32),
                                           block_n=pick(4, 32)),
                 passing=PassingBackwardConfig(block_p=pick(8, 64), block_n=pick(4, 64)),
                 scan=ScanBackwardConfig(block_q=pick(8, 16), block_k=pick(8, 64),
                                         block_n=pick(4, 64)))
    monkeypatch.setitem(CONFIGS, "random", tiles)
    test_state_passing_backward(spec, "random")
    test_chunk_state_backward(spec, "random")
    test_chunk_cumsum_backward(spec, "random")
    scan_backward(spec, tiles["scan"], monkeypatch)
    test_forward_stages(spec, "small-tiles")


# --- forward stages ---------------------------------------------------------------------------


def forward_configs():
    base = default_config((9, 0))
    state = base.state
    return {
        "fused-stage-2": base,
        "split-stage-2": dataclasses.replace(base, state=dataclasses.replace(state, fused=False)),
        "grouped-walk": dataclasses.replace(base, state=dataclasses.replace(state, groups=2)),
        "fused-scan": dataclasses.replace(base, fused_scan=dataclasses.replace(
            base.fused_scan, enabled=True)),
        "small-tiles": dataclasses.replace(
            base, cumsum=dataclasses.replace(base.cumsum, block_h=2),
            state=dataclasses.replace(state, block_p=8, block_n=8, block_k=8, transposed=False),
            scan=dataclasses.replace(base.scan, block_h=1, block_m=8, block_s=8, block_p=8)),
        "scan-grid-of-tiles": dataclasses.replace(base, scan=dataclasses.replace(
            base.scan, persistent=False, block_h=2, block_m=16, block_s=8, block_p=8)),
        "scan-whole-chunk": dataclasses.replace(base, scan=dataclasses.replace(
            base.scan, whole_chunk=True, block_m=8, block_s=8, block_p=8)),
        "scan-shared": dataclasses.replace(base, scan=dataclasses.replace(
            base.scan, whole_chunk=True, shared=True, block_m=8, block_s=8, block_p=8)),
        "scan-shared-2-column-blocks": dataclasses.replace(base, scan=dataclasses.replace(
            base.scan, whole_chunk=True, shared=True, block_m=16, block_s=8, block_p=8)),
    }


FORWARD = forward_configs()


@pytest.mark.parametrize("config", FORWARD)
@pytest.mark.parametrize("name", ["l-not-multiple", "l-one", "all-features", "full-chunks"])
def test_forward_stages(name, config):
    spec, t, ref, _ = problem(name)
    keys = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
    got = emulated(forward_stages, **{k: t.get(k) for k in keys}, chunk_size=spec.chunk_size,
                   dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit, config=FORWARD[config])
    for k in ("dt_out", "dA_cumsum", "states", "prev_states", "final_states", "y"):
        if k in got and not (k == "prev_states" and "group_enter" in got):
            close(got[k], ref[k], k)


@pytest.mark.parametrize("name", ["all-features", "l-not-multiple"])
def test_replayed_calls_compute_each_calls_own_inputs(name, monkeypatch):
    """The public forward called three times with fresh inputs of one signature: the first call
    runs in full, the second traces its plan and runs it, the third replays it (``ssd.api``):
    each returns its own inputs' y and final states, with every buffer poisoned."""
    from ssd import api

    api._plans.clear()
    spec = SHAPES[name]
    keys = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
    replays = []
    monkeypatch.setattr(api.Plan, "replay", lambda self, *a, replay=api.Plan.replay:
                        replays.append(1) or replay(self, *a))
    for seed in (5, 6, 7):
        _, t, ref, _ = problem(spec, seed)
        y, final = emulated(api.mamba_chunk_scan_combined, **{k: t.get(k) for k in keys},
                            chunk_size=spec.chunk_size, dt_softplus=spec.dt_softplus,
                            dt_limit=spec.dt_limit, config=FORWARD["small-tiles"],
                            return_final_states=True)
        close(y, ref["y"], f"y, call {seed - 4}")
        close(final, ref["final_states"], f"final_states, call {seed - 4}")
    assert replays == [1, 1], "the second call (tracing) and the third ran the plan"
    api._plans.clear()


@pytest.mark.parametrize("config", ["small-tiles", "grouped-walk"])
def test_forward_varlen_states(config):
    """With cu_seqlens, chunk_state_varlen's final state of every packed sequence."""
    spec, t, ref, _ = problem("ngroups-2-seq-idx")
    bounds = (0, 16, 23, 39, spec.seqlen)  # row 0's sequences: seq_boundaries, then the end
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    keys = ("x", "dt", "A", "B", "C", "initial_states", "seq_idx")
    got = emulated(forward_stages, **{k: t[k] for k in keys}, chunk_size=spec.chunk_size,
                   config=FORWARD[config], cu_seqlens=cu_seqlens)
    want = chunk_state_varlen(t["B"].double().numpy(), t["x"].double().numpy(),
                              ref["dt_out"].numpy(), ref["dA_cumsum"].numpy(),
                              ref["prev_states"].numpy(), np.array(bounds), t["seq_idx"].numpy())
    close(got["varlen_states"], torch.from_numpy(want), "varlen_states")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("config", ["fused-stage-2", "split-stage-2", "fused-scan"])
def test_half_inputs(config, dtype, monkeypatch):
    """fp16 or bf16 inputs: the MMA operands rounded to x's dtype with fp32 accumulators, and
    every store's cast explicit where it narrows (the emulator enforces cuTile's dtype rules);
    values against the float64 references of the rounded inputs, within the operands'
    rounding."""
    dtype, rtol = HALF[dtype]
    spec, t, ref, g = problem("l-not-multiple")
    half = {k: v.to(dtype) if v.is_floating_point() and k in ("x", "B", "C", "dt") else v
            for k, v in t.items()}
    ref = {k: torch.from_numpy(v) for k, v in spec.reference(
        {k: v.double().numpy() if v.is_floating_point() else v.numpy()
         for k, v in half.items()}).items()}
    got = emulated(forward_stages, half["x"], half["dt"], half["A"], half["B"], half["C"],
                   spec.chunk_size, config=FORWARD[config])
    for k in ("dt_out", "dA_cumsum", "final_states", "y"):
        close(got[k], ref[k], k, rtol=rtol)
    monkeypatch.setattr(SCAN, "check_inputs", check_inputs_on_cpu)
    want = TB.chunk_scan_backward_torch(g["dy"], *(half[k].double() for k in ("B", "C", "x")),
                                        ref["dt_out"], ref["dA_cumsum"], ref["prev_states"])
    got = emulated(TB.chunk_scan_backward_cutile, g["dy"].to(dtype), half["B"], half["C"],
                   half["x"], ref["dt_out"].float(), ref["dA_cumsum"].float(),
                   ref["prev_states"].to(dtype), config=SMALL_BACKWARD["scan"])
    close_scan(got, want, t, ref, g, rtol=rtol)


# --- the layer's conv and norm, the decode step -----------------------------------------------


@pytest.mark.parametrize("block", [8, 64])
def test_causal_conv1d(block):
    rng = np.random.default_rng(7)
    b, l, c, w = 2, 21, 12, 4
    x, weight, bias = (torch.from_numpy(rng.standard_normal(s)).float()
                       for s in ((b, l, c), (c, w), (c,)))
    init = torch.from_numpy(rng.standard_normal((b, c, w - 1))).float()
    seq_idx = torch.tensor([[0] * 9 + [1] * 12, [0] * 20 + [1]], dtype=torch.int32)
    for options in (dict(), dict(bias=bias, seq_idx=seq_idx, initial_states=init)):
        got = emulated(CONV.causal_conv1d, x, weight, **options,
                       config=Conv1dConfig(block_l=block, block_c=block))
        want = layer_ref.causal_conv1d(*(v.double().numpy() if v.is_floating_point() else
                                         v.numpy() for v in (x, weight)),
                                       **{k: v.double().numpy() if v.is_floating_point() else
                                          v.numpy() for k, v in options.items()})
        close(got, torch.from_numpy(want), f"conv {sorted(options)}")


@pytest.mark.parametrize("block", [8, 64])
@pytest.mark.parametrize("silu", [True, False])
def test_causal_conv1d_backward(block, silu):
    """The conv's backward kernel against layer_autograd's PyTorch backward in float64: x a
    column slice (strided rows, as in the layer), with and without bias, seq_idx and an initial
    state; 8 x 8 blocks leave the last row and channel blocks part-filled."""
    from ssd.layer_autograd import causal_conv1d_backward

    rng = np.random.default_rng(10)
    b, l, c, w = 2, 21, 12, 4
    wide = torch.from_numpy(rng.standard_normal((b, l, c + 5))).float()
    x = wide[..., 3:3 + c]
    weight, bias, dout = (torch.from_numpy(rng.standard_normal(s)).float()
                          for s in ((c, w), (c,), (b, l, c)))
    init = torch.from_numpy(rng.standard_normal((b, c, w - 1))).float()
    seq_idx = torch.tensor([[0] * 9 + [1] * 12, [0] * 2 + [1] * 19], dtype=torch.int32)
    for options in (dict(), dict(bias=bias, seq_idx=seq_idx, initial_states=init)):
        got = emulated(CONV.causal_conv1d_backward, dout, x, weight, **options, silu=silu,
                       config=Conv1dConfig(backward_block_l=block, backward_block_c=block))
        want = causal_conv1d_backward(dout.double(), x.double(), weight.double(),
                                      **{k: v.double() if v.is_floating_point() else v
                                         for k, v in options.items()},
                                      activation="silu" if silu else None)
        assert list(got) == list(want)
        for k in want:
            if want[k] is None:
                assert got[k] is None, k
            else:
                close(got[k], want[k], f"{k} {sorted(options)}")


@pytest.mark.parametrize("group_size", [4, 6])
def test_gated_rmsnorm(group_size):
    rng = np.random.default_rng(8)
    y, z = (torch.from_numpy(rng.standard_normal((3, 5, 12))).float() for _ in range(2))
    weight = torch.from_numpy(rng.standard_normal(12)).float()
    got = emulated(NORM.gated_rmsnorm, y, z, weight, group_size, 1e-5,
                   config=GatedNormConfig(block_elems=16))
    want = layer_ref.gated_rmsnorm(*(v.double().numpy() for v in (y, z, weight)), group_size,
                                   1e-5)
    close(got, torch.from_numpy(want), "gated_rmsnorm")


@pytest.mark.parametrize("group_size", [12, 4, 3])
def test_gated_rmsnorm_backward(group_size, monkeypatch):
    """The norm's backward kernel against layer_autograd's PyTorch backward in float64: dy and
    dz in y's and z's dtypes, dweight from the blocks' parts; z a column slice (strided rows).
    Tiles of 8 elements: a group of 12 in two channel tiles (the second part-filled), of 4 or 3
    two rows a block (15 rows: the last block part-filled)."""
    from ssd.layer_autograd import gated_rmsnorm_backward

    monkeypatch.setattr(NORM, "BACKWARD_TILE", 8)
    rng = np.random.default_rng(9)
    y, dout = (torch.from_numpy(rng.standard_normal((3, 5, 12))).float() for _ in range(2))
    zx = torch.from_numpy(rng.standard_normal((3, 5, 20))).float()
    z = zx[..., 4:16]  # in_proj's z columns, read in place
    weight = torch.from_numpy(rng.standard_normal(12)).float()
    got = emulated(NORM.gated_rmsnorm_backward, dout, y, z, weight, group_size, 1e-5)
    want = gated_rmsnorm_backward(dout.double(), y.double(), z.double(), weight.double(),
                                  group_size, 1e-5)
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k], k)


@pytest.mark.parametrize("per_head", [True, False])
def test_state_update(per_head):
    """The decode step: y and the state rows it advances in place (a padding entry, -1, touches
    none)."""
    rng = np.random.default_rng(9)
    b, h, p, n, g, slots = 3, 4, 12, 8, 2, 5
    f = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    state, x, B, C, z = f(slots, h, p, n), f(b, h, p), f(b, g, n), f(b, g, n), f(b, h, p)
    dt, A, D, bias = ((f(b, h), -f(h).abs(), f(h), f(h)) if per_head else
                      (f(b, h, p), -f(h, p, n).abs(), f(h, p), f(h, p)))
    rows = torch.tensor([4, -1, 1], dtype=torch.int32)
    args = dict(D=D, z=z, dt_bias=bias, dt_softplus=True, state_batch_indices=rows,
                dt_limit=(0.0, 5.0))
    want_y, want_state = reference_step(*(v.double().numpy() for v in (state, x, dt, A, B, C)),
                                        **{k: v.double().numpy() if torch.is_tensor(v) and
                                           v.is_floating_point() else
                                           v.numpy() if torch.is_tensor(v) else v
                                           for k, v in args.items()})
    got = emulated(UPDATE.state_update, state, x, dt, A, B, C, **args,
                   config=StateUpdateConfig(block_p=4))
    close(got, torch.from_numpy(want_y), "y")
    close(state, torch.from_numpy(want_state), "state")


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_conv_step(width, paged):
    """The decode step's conv: the output and the state rows it rolls in place (a padding
    entry, -1, writes a zero output and touches no row)."""
    rng = np.random.default_rng(10)
    b, c, slots = 3, 37, 7
    f = lambda *s: torch.from_numpy(rng.standard_normal(s)).float()  # noqa: E731
    x = f(b, 50)[:, 5:5 + c]  # a strided view, as the mixer passes in_proj's slice
    weight, bias = f(c, width), f(c)
    state = f(slots if paged else b, c, width - 1)
    before = state.double().numpy().copy()
    rows = np.array([4, -1, 1]) if paged else np.arange(b)
    index = torch.from_numpy(rows) if paged else None
    got = emulated(STEP.conv_step, state, x, weight, bias, index,
                   config=ConvStepConfig(block_c=16))
    live = rows >= 0
    want, want_state = np.zeros((b, c)), before.copy()
    want[live], want_state[rows[live]] = layer_ref.conv_step(
        before[rows[live]], x.double().numpy()[live], weight.double().numpy(),
        bias.double().numpy())
    close(got, torch.from_numpy(want), "conv step")
    assert np.array_equal(state.double().numpy(), want_state), "conv state rolled wrong"


# --- the emulator itself ----------------------------------------------------------------------


@ct.kernel
def _copy_kernel(src, dst, TILE: ct.Constant[int], PAD: ct.Constant[bool]):
    i = ct.bid(0)
    if PAD:
        t = ct.load(src, index=(i,), shape=(TILE,), padding_mode=ct.PaddingMode.ZERO)
    else:
        t = ct.load(src, index=(i,), shape=(TILE,))
    ct.store(dst, index=(i,), tile=t + 1.0)


@ct.kernel
def _same_tile_kernel(dst, TILE: ct.Constant[int]):
    ct.store(dst, index=(0,), tile=ct.full((TILE,), 1.0, dtype=ct.float32))


def test_emulator_padding_and_bounds():
    src, dst = torch.arange(6.0), torch.full((6,), float("nan"))
    emu.run(_copy_kernel, (2,), src, dst, 4, True)  # the second tile crosses the end
    assert dst.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with capture() as records:
        from ssd.launch import launch

        launch(_copy_kernel, (2,), dict(src=src, dst=dst, TILE=4, PAD=False))
    dst[:] = 0.0
    emu.replay(records)  # undetermined padding reads NaN, the store drops it past the end
    assert dst.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    with pytest.raises(emu.EmulationError, match="wholly outside"):
        emu.run(_copy_kernel, (3,), src, dst, 4, True)
    with pytest.raises(emu.EmulationError, match="power of two"):
        emu.run(_copy_kernel, (2,), src, dst, 3, True)
    with pytest.raises(emu.EmulationError, match="share memory"):
        emu.run(_copy_kernel, (2,), src, src[2:], 4, True)


def test_emulator_finds_two_blocks_writing_one_element():
    with pytest.raises(emu.EmulationError, match="wrote in the same launch"):
        emu.run(_same_tile_kernel, (2,), torch.zeros(4), 4)
    with pytest.raises(emu.EmulationError, match="explicit astype"):
        emu.run(_same_tile_kernel, (1,), torch.zeros(4, dtype=torch.float16), 4)


@ct.kernel
def _reverse_kernel(a, TILE: ct.Constant[int]):
    i = ct.bid(0)
    t = ct.load(a, index=(ct.num_blocks(0) - 1 - i,), shape=(TILE,))
    ct.store(a, index=(i,), tile=t)


def test_emulator_finds_a_block_reading_what_another_wrote():
    with pytest.raises(emu.EmulationError, match="reads elements block"):
        emu.run(_reverse_kernel, (2,), torch.arange(8.0), 4)


def test_emulator_load_order_follows_the_docs():
    """The examples of cuda.tile.load's docstring: order permutes the array's axes before the
    tile space is formed."""
    x = torch.arange(16).reshape(4, 4).numpy()
    assert emu.load(x, (1, 0), shape=(1, 4), order="F").tolist() == [[1, 5, 9, 13]]
    x = torch.arange(8).reshape(2, 2, 2).numpy()
    assert emu.load(x, (1, 0, 0), shape=(1, 2, 2), order=(0, 2, 1)).tolist() == [[[4, 6], [5, 7]]]
    x = torch.arange(10).numpy()
    assert emu.load(x, (2,), shape=4, padding_mode=ct.PaddingMode.ZERO).tolist() == [8, 9, 0, 0]
    with pytest.raises(emu.EmulationError, match="integer"):
        emu.load(x, (2,), shape=4)
