"""chunk_scan's backward in cuTile, on the CPU: input validation, the tile configuration, and the
kernels' tile code run with NumPy in place of cuda.tile.

The kernels need a GPU (tests/test_gpu_chunk_scan_backward.py checks them there; CI compiles them,
tests/test_aot.py). Their tile code is plain Python over ``ct`` calls, so :class:`NumPyTiles`
can stand in for ``cuda.tile`` and run it on arrays: every load, store, MMA, mask and loop bound
as the kernels write them, in float64, with a load or store of a tile wholly outside its array
(undefined in cuTile) raising. That checks the index arithmetic, the walks over tiles and that
every output element is written (outputs start as NaN), against ``chunk_scan_backward_torch``;
not cuTile's semantics, the compiler or the roundings, which only the GPU tests see.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd import reference as R  # noqa: E402
from ssd.backward import chunk_scan_backward_cutile, chunk_scan_backward_torch  # noqa: E402
from ssd.config import ScanBackwardConfig, next_pow2  # noqa: E402
from ssd.kernels import chunk_scan_backward as K  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec  # noqa: E402

# float64 throughout: the two sides differ only in the order of their sums
RTOL = 1e-12


# ---- input validation -----------------------------------------------------------------------


def cpu_args(b=2, l=40, h=4, p=8, n=16, g=2, q=16, dtype=torch.float32, **extra):
    c = math.ceil(l / q)
    args = dict(dy=torch.zeros(b, l, h, p, dtype=dtype), B=torch.zeros(b, l, g, n, dtype=dtype),
                C=torch.zeros(b, l, g, n, dtype=dtype), x=torch.zeros(b, l, h, p, dtype=dtype),
                dt_out=torch.zeros(b, h, c, q), dA_cumsum=torch.zeros(b, h, c, q),
                prev_states=torch.zeros(b, c, h, p, n, dtype=dtype), D=None, z=None, seq_idx=None)
    args.update(extra)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(dy=torch.zeros(2, 40, 4, 9)), r"^dy: expected x's shape"),
    (dict(dy=None), r"^dy: expected a torch.Tensor"),
    (dict(x=np.zeros((2, 40, 4, 8))), r"^x: expected a torch.Tensor"),
    (dict(B=torch.zeros(2, 40, 3, 16), C=torch.zeros(2, 40, 3, 16)), r"^B: .*not divisible"),
    (dict(C=torch.zeros(2, 40, 2, 8)), r"^C: "),                   # n differs from B's
    (dict(dt_out=torch.zeros(2, 4, 2, 16)), r"^dt_out: "),         # c = 2, ceil(40 / 16) = 3
    (dict(dA_cumsum=torch.zeros(2, 4, 2, 24)), r"^dA_cumsum: .*power of two"),
    (dict(dA_cumsum=torch.zeros(2, 4, 3, 16, dtype=torch.float16)), r"^dA_cumsum: dtype"),
    (dict(prev_states=torch.zeros(2, 3, 4, 8, 12)), r"^prev_states: "),
    (dict(D=torch.zeros(5)), r"^D: "),
    (dict(D=torch.zeros(4, 8, 1)), r"^D: "),
    (dict(z=torch.zeros(2, 40, 4, 7)), r"^z: "),
    (dict(seq_idx=torch.zeros(2, 41, dtype=torch.int32)), r"^seq_idx: "),
    (dict(seq_idx=torch.zeros(2, 40)), r"^seq_idx: dtype"),
    (dict(x=torch.zeros(2, 40, 4, 8, dtype=torch.float64)), r"^x: dtype .*float64 is the PyTorch"),
    (dict(x=torch.zeros(2, 40, 4, 512), dy=torch.zeros(2, 40, 4, 512),
          prev_states=torch.zeros(2, 3, 4, 512, 16)), r"^x: headdim p=512"),
    ({}, r"^x: must be a CUDA tensor"),                            # valid, but on the CPU
])
def test_bad_input_is_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        chunk_scan_backward_cutile(**cpu_args(**change))


@pytest.mark.parametrize("kwargs", [dict(block_q=48), dict(block_k=0), dict(block_n=3),
                                    dict(occupancy=0)])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ScanBackwardConfig(**kwargs)


@pytest.mark.parametrize("q, n, dtype, tiles", [(16, 24, "bfloat16", (16, 16, 32)),
                                                (256, 128, "bfloat16", (64, 64, 64)),
                                                (256, 128, torch.float32, (32, 32, 32)),
                                                (16, 8, "float32", (16, 16, 8))])
def test_config_is_fitted_to_the_problem(q, n, dtype, tiles):
    config = ScanBackwardConfig().for_problem(q, n, dtype)
    assert (config.block_q, config.block_k, config.block_n) == tiles


# ---- the tile code with NumPy in place of cuda.tile -----------------------------------------


class NumPyTiles:
    """The ``ct`` calls the kernels' tile code makes, on NumPy arrays, in float64."""

    float32, int32, bool_ = np.float64, np.int64, np.bool_
    arange = staticmethod(lambda n, dtype: np.arange(n, dtype=dtype))
    zeros = staticmethod(lambda shape, dtype: np.zeros(shape, dtype=dtype))
    where, minimum, maximum = staticmethod(np.where), staticmethod(min), staticmethod(max)
    exp2 = staticmethod(lambda x, flush_to_zero=False: np.exp2(x))
    sum = staticmethod(lambda x, axis: x.sum(axis=axis))
    transpose = staticmethod(lambda x: x.T)
    mma = staticmethod(lambda a, b, acc: a @ b + acc)
    cdiv = staticmethod(lambda a, b: -(-a // b))

    @staticmethod
    def _window(arr, index, shape):
        """The array's part of the tile ``index`` of shape ``shape`` and where it sits in the
        tile; a tile wholly outside the array raises (undefined in cuTile)."""
        starts = [i * s for i, s in zip(index, shape)]
        if any(st >= n for st, n in zip(starts, arr.shape)):
            raise AssertionError(f"tile {index} of shape {shape} lies outside {arr.shape}")
        inside = tuple(slice(st, min(st + s, n)) for st, s, n in zip(starts, shape, arr.shape))
        return inside, tuple(slice(0, w.stop - w.start) for w in inside)

    @classmethod
    def load(cls, arr, index, shape, padding_mode=None):
        inside, part = cls._window(arr, index, shape)
        tile = np.zeros(shape, dtype=arr.dtype)  # the kernels load with zero padding
        tile[part] = arr[inside]
        return tile

    @classmethod
    def store(cls, arr, index, tile):
        inside, part = cls._window(arr, index, tile.shape)
        arr[inside] = tile[part]


@pytest.fixture
def numpy_tiles(monkeypatch):
    """The kernels' tile code runs with NumPyTiles as its ``ct``."""
    monkeypatch.setattr(K, "ct", NumPyTiles)


def emulated(dy, B, C, x, dt_out, dA_cumsum, prev_states, seq_idx, config, rebuild_y=True):
    """The three kernels' grids walked in launch order with NumPy arrays (float64; seq_idx
    integer), outputs starting as NaN: (dict of chunk_scan_backward's outputs, y_ssm)."""
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    _, _, c, q = dt_out.shape
    config = config.for_problem(q, n)
    bq, r, p_pad, n_pad = config.block_q, h // g, next_pow2(p), next_pow2(n)
    nan = lambda *shape: np.full(shape, np.nan)  # noqa: E731
    out = dict(dB=nan(b, l, g, n), dC=nan(b, l, g, n), dx=nan(b, l, h, p),
               ddt_out=nan(b, h, c, q), ddA_cumsum=nan(b, h, c, q),
               dprev_states=nan(b, c, h, p, n))
    y = nan(b, l, h, p)
    has_seq = seq_idx is not None
    if has_seq:
        seq_last = seq_idx[:, np.minimum(np.arange(q - 1, l + q - 1, q), l - 1)]
    else:
        seq_idx = seq_last = np.zeros((1, 1), dtype=np.int64)
    blocks = [(bc // c, bc % c, ig, j) for bc in range(b * c) for ig in range(g)
              for j in range(q // bq)]
    for ib, ic, ig, js in blocks:
        K.column_block(ib, ic, ig, js, x, B, C, dy, dt_out, dA_cumsum, seq_idx, out["dx"],
                       out["dB"], out["ddt_out"], out["ddA_cumsum"], l, r, q, bq, p_pad, n_pad,
                       has_seq)
    for ib, ic, ig, it in blocks:
        K.row_block(ib, ic, ig, it, x, B, C, dy, dt_out, dA_cumsum, prev_states, seq_idx,
                    seq_last, out["dC"], out["ddA_cumsum"], y, l, r, q, bq, p_pad, n_pad, has_seq,
                    rebuild_y)
    for bc in range(b * c):
        for ih in range(h):
            for jn in range(-(-n // config.block_n)):
                K.entering_gradient(bc // c, bc % c, ih, jn, dy, C, dA_cumsum, seq_idx, seq_last,
                                    out["dprev_states"], l, r, q, config.block_k, p_pad,
                                    config.block_n, has_seq)
    return out, y


def stage_case(spec, seed=5):
    """float64 NumPy arguments of chunk_scan_backward: the spec's inputs, its reference's
    intermediates, dy ~ N(0, 1)."""
    inputs = spec.make_inputs(seed)
    ref = spec.reference(inputs)
    return dict(dy=spec.make_output_grads(seed)["dy"], B=inputs["B"], C=inputs["C"],
                x=inputs["x"], dt_out=ref["dt_out"], dA_cumsum=ref["dA_cumsum"],
                prev_states=ref["prev_states"], D=inputs.get("D"), z=inputs.get("z"),
                seq_idx=inputs.get("seq_idx"))


def as_torch(args):
    return {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in args.items()}


def assert_close(got, want, name):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert np.isfinite(got).all(), f"{name}: an element no kernel writes"
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))  # ddA_cumsum at l = 1 is 0
    error = float(np.abs(got - want).max(initial=0.0))
    assert error <= RTOL * scale, f"{name}: max error {error:.2e}"


# The chunk of one 16- or 32-row tile (the edge shapes), chunks of several tiles (small tiles,
# or 128 and 256 with the default's 64), one position, eight groups.
EMULATED = {
    "all-features": (EDGE_SHAPES["all-features"], ScanBackwardConfig()),
    "seq-idx-mid-chunk/8": (EDGE_SHAPES["seq-idx-mid-chunk"], ScanBackwardConfig(8, 8, 8)),
    "l-not-multiple/16": (EDGE_SHAPES["l-not-multiple"], ScanBackwardConfig(16, 16, 8)),
    "headdim-not-pow2": (EDGE_SHAPES["headdim-not-pow2"], ScanBackwardConfig()),
    "l-one": (ProblemSpec(2, 1, 4, 16, 16, 1, chunk_size=32), ScanBackwardConfig()),
    "ngroups-8": (ProblemSpec(1, 70, 16, 8, 8, 8, chunk_size=32,
                              seq_boundaries=((10, 33, 64),)), ScanBackwardConfig(16, 16, 8)),
    "q128": (ProblemSpec(2, 300, 4, 24, 40, 2, chunk_size=128,
                         seq_boundaries=((5, 130, 200), (0, 64, 255))), ScanBackwardConfig()),
}


@pytest.mark.parametrize("name", list(EMULATED))
def test_tile_code_matches_the_pytorch_backward(name, numpy_tiles):
    """The tile code, run with NumPy, against chunk_scan_backward_torch without D and z (what
    the kernels see), and the rebuilt y_ssm against the forward reference."""
    spec, config = EMULATED[name]
    args = stage_case(spec) | dict(D=None, z=None)
    want = chunk_scan_backward_torch(**as_torch(args))
    got, y = emulated(args["dy"], args["B"], args["C"], args["x"], args["dt_out"],
                      args["dA_cumsum"], args["prev_states"], args["seq_idx"], config)
    assert list(got) == list(want)
    for key in want:
        assert_close(got[key], want[key].numpy(), f"{name} {key}")
    y_ssm = R.chunk_scan(args["B"], args["C"], args["x"], args["dt_out"], args["dA_cumsum"],
                         args["prev_states"], seq_idx=args["seq_idx"])
    assert_close(y, y_ssm, f"{name} y_ssm")


@pytest.mark.parametrize("name", ["all-features", "D-per-head", "z-gate"])
def test_gate_and_skip_around_the_kernels(name, monkeypatch, numpy_tiles):
    """chunk_scan_backward_cutile's PyTorch part (dy through the gate before the kernels; dx's
    skip term, dD and dz after), with the emulated kernels and the device check passed: the
    result and its key order are chunk_scan_backward_torch's."""
    args = stage_case(EDGE_SHAPES[name])
    tensors = {k: None if v is None else torch.from_numpy(np.asarray(v)) for k, v in args.items()}
    tensors = {k: v if v is None or not v.is_floating_point() else v.float()
               for k, v in tensors.items()}
    want = chunk_scan_backward_torch(**{k: v if v is None or not v.is_floating_point()
                                        else v.double() for k, v in tensors.items()})

    def launcher(dy, B, C, x, dt_out, dA_cumsum, prev_states, seq_idx, seq_last, config,
                 rebuild_y=False):
        host = [None if t is None else t.double().numpy() if t.is_floating_point() else t.numpy()
                for t in (dy, B, C, x, dt_out, dA_cumsum, prev_states, seq_idx)]
        got, y = emulated(*host, config, rebuild_y)
        got = {k: torch.from_numpy(v).float() for k, v in got.items()}
        return got | ({"y_ssm": torch.from_numpy(y).float()} if rebuild_y else {})

    checked = K.check_inputs

    def on_the_cpu(*a):
        try:
            return checked(*a)
        except ValueError as exc:  # the one error valid CPU arguments meet
            assert str(exc).startswith("x: must be a CUDA tensor")
            return {"q": a[5].shape[-1]}

    monkeypatch.setattr(K, "check_inputs", on_the_cpu)
    monkeypatch.setattr(K, "chunk_scan_backward", launcher)
    got = chunk_scan_backward_cutile(**tensors)
    assert list(got) == list(want)
    for key in want:
        assert got[key].dtype == torch.float32
        err = float((got[key].double() - want[key]).norm() / want[key].norm())
        assert err < 1e-6, f"{name} {key}: relative error {err:.2e}"  # fp32 around float64
