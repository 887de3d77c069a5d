"""The cuTile kernels' tile code run on the CPU by tests/tile_emulator.py, against the float64
PyTorch and NumPy references: index arithmetic, masks, padding and which elements each kernel
writes (outputs poisoned with NaN), checked in CI without a GPU. The rounding of real MMAs,
scheduling and speed are the GPU tests' (tests/test_gpu_*.py).

Small shapes and few blocks (the emulator runs a block's Python body per block): the edge
cases are l < q, l % q != 0, l = 1, several groups, packed sequences (seq_idx), with and without
each optional input, tiles smaller than the chunk and the state.
"""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

import cuda.tile as ct  # noqa: E402

import tile_emulator as emu  # noqa: E402
from ssd import backward as TB  # noqa: E402
from ssd.api import forward_stages  # noqa: E402
from ssd.config import (CumsumBackwardConfig, PassingBackwardConfig, ScanBackwardConfig,  # noqa: E402
                        StateBackwardConfig, default_config)
from ssd.kernels import chunk_cumsum_backward as CUMSUM  # noqa: E402
from ssd.kernels import chunk_scan_backward as SCAN  # noqa: E402
from ssd.kernels import chunk_state_backward as STATE  # noqa: E402
from ssd.kernels import state_passing_backward as PASSING  # noqa: E402
from ssd.launch import capture  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec  # noqa: E402
from ssd.reference import check_shapes  # noqa: E402
from ssd.validate import poisoned_memory  # noqa: E402

# fp32 arithmetic against float64 references of the same (fp32-rounded) inputs: the emulated
# MMAs are exact, so what remains is fp32 rounding of elementwise terms and short sums.
RTOL = 2e-5

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
}


def close(got, want, what):
    """``got`` (any float tensor) equals the float64 ``want`` to RTOL of want's largest
    magnitude; NaN (an element no block wrote) fails."""
    got, want = got.double(), want.double()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} elements " \
                                      "not written (NaN poison) or not finite"
    err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
    assert err < RTOL, f"{what}: relative error {err:.2e}"


def problem(name, seed=5):
    """Inputs as fp32 tensors (their float64 copies are the references' inputs), the float64
    forward's intermediates, and random upstream gradients for each stage."""
    spec = SHAPES[name]
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
                      state=StateBackwardConfig(block_s=8, block_p=8, block_n=4),
                      passing=PassingBackwardConfig(block_p=8, block_n=4),
                      scan=ScanBackwardConfig(block_q=8, block_k=8, block_n=4))
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
    got = emulated(SCAN.chunk_scan_backward_cutile, g["dy"].float(), t["B"], t["C"], t["x"],
                   ref["dt_out"].float(), ref["dA_cumsum"].float(), ref["prev_states"].float(), D,
                   z, seq, config=config)
    assert list(got) == list(want)
    for k in want:
        close(got[k], want[k], k)


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("name", SHAPES)
def test_chunk_scan_backward(name, tiles, monkeypatch):
    scan_backward(name, CONFIGS[tiles].get("scan", ScanBackwardConfig()), monkeypatch)


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


@pytest.mark.parametrize("mutation", ["causal-mask-off-by-one", "end-decay-wrong-column"])
def test_a_broken_kernel_fails(mutation, monkeypatch):
    """The emulated tests can fail: a deliberately broken helper of the tile code (an
    off-by-one causal mask; the chunk's decay read from a wrong column) makes them fail."""
    if mutation == "causal-mask-off-by-one":
        monkeypatch.setattr(SCAN, "pair_keep", _causal_without_diagonal)
        with pytest.raises(AssertionError, match="relative error"):
            scan_backward("l-not-multiple", SMALL_BACKWARD["scan"], monkeypatch)
    else:
        monkeypatch.setattr(PASSING, "chunk_end_decay", _end_decay_one_early)
        with pytest.raises(AssertionError, match="relative error"):
            test_state_passing_backward("l-not-multiple", "small-tiles")


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
    }


FORWARD = forward_configs()


@pytest.mark.parametrize("config", FORWARD)
@pytest.mark.parametrize("name", ["l-not-multiple", "l-one", "all-features"])
def test_forward_stages(name, config):
    spec, t, ref, _ = problem(name)
    keys = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states", "seq_idx")
    got = emulated(forward_stages, **{k: t.get(k) for k in keys}, chunk_size=spec.chunk_size,
                   dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit, config=FORWARD[config])
    for k in ("dt_out", "dA_cumsum", "states", "prev_states", "final_states", "y"):
        if k in got and not (k == "prev_states" and "group_enter" in got):
            close(got[k], ref[k], k)


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


def test_emulator_finds_two_blocks_writing_one_element():
    with pytest.raises(emu.EmulationError, match="wrote in the same launch"):
        emu.run(_same_tile_kernel, (2,), torch.zeros(4), 4)
    with pytest.raises(emu.EmulationError, match="explicit astype"):
        emu.run(_same_tile_kernel, (1,), torch.zeros(4, dtype=torch.float16), 4)
