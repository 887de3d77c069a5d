"""GPU tests of chunk_scan's backward in cuTile (``pytest -m gpu``; skipped without a GPU).

:func:`ssd.backward.chunk_scan_backward_cutile` against
``ssd.backward.chunk_scan_backward_torch`` run in float64 on exactly the values the kernels read
(on a few shapes also against the NumPy rung ``ssd.reference_backward.chunk_scan_backward``).
The inputs are a :class:`ssd.problem.ProblemSpec`'s, fresh each run (a new seed, printed on
failure; ``SSD_TEST_SEED`` replays one): x, z, B, C and dy in the dtype under test, dt_out and
dA_cumsum in fp32 as stage 1 stores them, the entering states in the dtype under test as the
default stage 2 stores them (fp32 in one test), all from the float64 forward reference.
Memory is poisoned: every ``torch.empty`` returns NaN-filled memory (the kernels' output buffers
among them, ``ssd.validate.poisoned_memory``), so an element no kernel writes
fails the check.

Every gradient is checked by both criteria of ``ssd.validate.check_gradient`` (the norm within
``GRAD_TOL``, the worst element within ``GRAD_ELEMENT_FACTOR`` tolerances of the reference's
RMS). The gradients stay fp32 here (the caller casts them), so GRAD_TOL, derived for gradients
rounded to the input dtype, is looser than needed, never tighter; per dtype:

* float32, 1e-4: fp32 MMAs and sums; the decays' exp2 of fp32 dA_cumsum differences (GRAD_TOL's
  fp32 derivation).
* float16, 2e-3: each MMA operand the kernels form (dy, the weights W and dM, e^{a} dy, the
  entering states) rounded once to fp16 (u = 4.9e-4), fp32 accumulation: about u in norm.
* bfloat16, 1.5e-2: the same roundings at u = 3.9e-3.

The kernels write every output element from one block, in a fixed order (no atomics): two runs
give the same bits. Rows go to ``results/<gpu>/gpu_backward_tests.json`` (``record="backward"``,
``kind="stage/chunk_scan"``).
"""
import dataclasses
import os
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd.backward import chunk_scan_backward_torch  # noqa: E402
from ssd.config import ScanBackwardConfig  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec, random_spec  # noqa: E402
from ssd.validate import (DTYPE_NAMES, as_float64, check_gradient, device_inputs,  # noqa: E402
                          reference_of)
from ssd.validate import poisoned_memory  # noqa: E402  (NaN-filled torch.empty)

pytestmark = pytest.mark.gpu

RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))

# Beyond the named edge shapes (whose chunks are one 16- or 32-row tile): one position; eight
# groups of two heads; chunks of two and four 64-row tiles (the walks over row and column
# blocks), ragged, with resets mid-tile, at a tile border and on a chunk's first position.
SHAPES = dict(EDGE_SHAPES) | {
    "l-one": ProblemSpec(2, 1, 4, 16, 16, 1, chunk_size=32, D="h", z=True, name="l-one"),
    "ngroups-8": ProblemSpec(1, 100, 16, 32, 32, 8, chunk_size=32, D="hp", z=True,
                             seq_boundaries=((10, 33, 64),), name="ngroups-8"),
    "q128-tiles": ProblemSpec(2, 300, 4, 24, 40, 2, chunk_size=128, z=True,
                              seq_boundaries=((5, 130, 200), (0, 64, 255)), name="q128-tiles"),
    "q256-tiles": ProblemSpec(1, 520, 4, 64, 128, 1, chunk_size=256, D="h",
                              seq_boundaries=((256, 300),), name="q256-tiles"),
}
# Small tiles on small chunks: several row and column blocks a chunk, state slices of 16.
SMALL_TILES = ScanBackwardConfig(block_q=16, block_k=16, block_n=16)


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


def stage_inputs(spec, seed, dtype, state_dtype=None) -> dict:
    """chunk_scan_backward's arguments on the GPU: the spec's inputs (device_inputs), its
    stage-1 outputs in fp32 and entering states in ``state_dtype`` (default: ``dtype``) from
    the float64 reference of those inputs, and dy ~ N(0, 1) in ``dtype``."""
    inputs = device_inputs(spec, seed, dtype)
    ref = reference_of(spec, inputs)
    as_dev = lambda a, t: torch.from_numpy(np.ascontiguousarray(a)).to("cuda", t)  # noqa: E731
    return dict(dy=as_dev(spec.make_output_grads(seed)["dy"], getattr(torch, dtype)),
                B=inputs["B"], C=inputs["C"], x=inputs["x"],
                dt_out=as_dev(ref["dt_out"], torch.float32),
                dA_cumsum=as_dev(ref["dA_cumsum"], torch.float32),
                prev_states=as_dev(ref["prev_states"], getattr(torch, state_dtype or dtype)),
                D=inputs.get("D"), z=inputs.get("z"), seq_idx=inputs.get("seq_idx"))


def torch_reference(args: dict) -> dict:
    """chunk_scan_backward_torch in float64 on the CPU, from exactly the values on the GPU."""
    cpu = {k: None if v is None else v.cpu().double() if v.is_floating_point() else v.cpu()
           for k, v in args.items()}
    return {k: v.numpy() for k, v in chunk_scan_backward_torch(**cpu).items()}


def run(args: dict, config=None) -> dict:
    """The kernels, dprev_states written by the states kernel (by default it is left for
    state_passing's walk to form: tests/test_gpu_stage_backward.py checks that walk)."""
    from ssd.backward import chunk_scan_backward_cutile

    config = dataclasses.replace(config or ScanBackwardConfig(), dprev_in_walk=False)
    with poisoned_memory():
        got = chunk_scan_backward_cutile(**args, config=config)
    torch.cuda.synchronize()
    return got


def check(spec, dtype, record, label, seed, config=None, state_dtype=None, want=None):
    """One backward into poisoned memory; every gradient checked against ``want`` (default the
    float64 PyTorch backward) and recorded."""
    args = stage_inputs(spec, seed, dtype, state_dtype)
    got = run(args, config)
    want = torch_reference(args) if want is None else want(args)
    assert list(got) == list(want), f"keys {list(got)}, the reference's {list(want)}"
    failures = []
    for key, ref in want.items():
        assert got[key].dtype == torch.float32, f"{key}: {got[key].dtype}, expected float32"
        result = check_gradient(key, got[key], ref, dtype)
        record.append(dict(test=label, record="backward", kind="stage/chunk_scan",
                           shape=spec.name or str(spec), dims=list(spec.dims),
                           chunk_size=spec.chunk_size, dtype=dtype, **result.fields(), seed=seed))
        if not result.ok:
            failures.append(result.failure())
    assert not failures, f"{spec} [{dtype}, seed {seed}]: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name, dtype, gpu_record):
    """Every named shape (seq_idx resets, groups, l % q != 0, l < q, l = 1, D per head and per
    channel, z, tiles walked within a chunk), every dtype, the default tiles."""
    check(SHAPES[name], dtype, gpu_record, f"chunk_scan/{name}", seed_for(name + dtype))


FOLD_CASES = ([(name, "bfloat16", None) for name in ("all-features", "seq-idx-mid-chunk",
                                                      "l-not-multiple", "ngroups-8", "q128-tiles",
                                                      "q256-tiles")]
              + [(name, dtype, None) for name in ("all-features", "q256-tiles")
                 for dtype in ("float32", "float16")]
              + [(name, "bfloat16", SMALL_TILES) for name in ("all-features", "q128-tiles")])


@pytest.mark.parametrize("name, dtype, config", FOLD_CASES)
def test_chunk_state_folds_into_the_kernels(name, dtype, config, gpu_record):
    """Given state_passing's backward as ``walk``, the kernels add chunk_state's backward
    (``fold_state``): dx (in x's dtype), dB, ddt_out and ddA_cumsum hold both stages' parts.
    Against the float64 functions on the same values: chunk_scan's, and chunk_state's from the
    dstates the walk returned (its own check is tests/test_gpu_stage_backward.py's)."""
    from ssd.backward import chunk_scan_backward_cutile, chunk_state_backward_torch
    from ssd.kernels.state_passing_backward import state_passing_backward_cutile

    spec, seed = SHAPES[name], seed_for("fold" + name + dtype)
    args = stage_inputs(spec, seed, dtype)
    x_dtype = args["x"].dtype
    # a gradient on the final states: without one the last chunk's state gradient is 0, and
    # so would be its part of ddA_cumsum's last column (a ragged chunk's lies past the end)
    b, _, h, p, n = args["prev_states"].shape
    dfinal = torch.randn(b, h, p, n, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(seed))

    def walk(dprev_states):
        return state_passing_backward_cutile(dprev_states, args["prev_states"], args["dA_cumsum"],
                                             None, args["seq_idx"], dfinal_states=dfinal,
                                             dstates_dtype=x_dtype)

    with poisoned_memory():
        got = chunk_scan_backward_cutile(**args, config=config or ScanBackwardConfig(),
                                         walk=walk, dx_dtype=x_dtype)
    torch.cuda.synchronize()
    want = torch_reference(args)
    want.pop("dprev_states")
    cpu = {k: None if args[k] is None else args[k].cpu() for k in ("B", "x", "seq_idx")}
    state = chunk_state_backward_torch(
        got["passing"]["dstates"].cpu().double(), cpu["B"].double(), cpu["x"].double(),
        args["dt_out"].cpu().double(), args["dA_cumsum"].cpu().double(), cpu["seq_idx"])
    for key in ("dx", "dB", "ddt_out", "ddA_cumsum"):
        want[key] = want[key] + state[key].numpy()
    assert got["dx"].dtype == x_dtype and sorted(got) == sorted([*want, "passing"])
    failures = []
    for key, ref in want.items():
        result = check_gradient(key, got[key], ref, dtype)
        gpu_record.append(dict(test=f"chunk_scan/fold/{name}", record="backward",
                               kind="stage/chunk_scan", shape=spec.name, dims=list(spec.dims),
                               chunk_size=spec.chunk_size, dtype=dtype, **result.fields(),
                               seed=seed))
        if not result.ok:
            failures.append(result.failure())
    assert not failures, f"{spec} [{dtype}, seed {seed}]: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "l-not-multiple",
                                  "ngroups-gt-1", "headdim-not-pow2"])
def test_small_tiles(name, dtype, gpu_record):
    """16-row tiles on chunks of 16 and 32: the row and column walks over several blocks, the
    K loop of the entering states' gradient, state slices, on the edge shapes."""
    check(SHAPES[name], dtype, gpu_record, f"chunk_scan/small-tiles/{name}",
          seed_for("small" + name + dtype), config=SMALL_TILES)


@pytest.mark.parametrize("index", range(12))
def test_random_shapes(index, gpu_record):
    """Random shapes and feature sets (ssd.problem.random_spec), the dtype drawn per case."""
    spec = random_spec(np.random.default_rng(seed_for(f"scan-bwd-random{index}")))
    check(spec, DTYPE_NAMES[index % 3], gpu_record, f"chunk_scan/random/{index}",
          seed_for(f"scan-bwd-r{index}"))


@pytest.mark.parametrize("name", ["all-features", "q128-tiles"])
def test_entering_states_in_fp32(name, gpu_record):
    """The split stage 2 stores the entering states in fp32: bf16 inputs, fp32 states."""
    check(SHAPES[name], "bfloat16", gpu_record, f"chunk_scan/fp32-states/{name}",
          seed_for("fp32-states" + name), state_dtype="float32")


@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "ngroups-8"])
def test_matches_numpy_reference(name, gpu_record):
    """Against the NumPy rung (ssd.reference_backward.chunk_scan_backward) as well, fp32."""
    from ssd import reference_backward as RB

    def numpy_reference(args):
        host = {k: None if v is None else as_float64(v) if v.is_floating_point()
                else v.cpu().numpy() for k, v in args.items()}
        return RB.chunk_scan_backward(host.pop("dy"), **host)

    check(SHAPES[name], "float32", gpu_record, f"chunk_scan/numpy/{name}",
          seed_for("numpy" + name), want=numpy_reference)


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_model_like_chunk_sizes(chunk_size, gpu_record):
    """The production chunk sizes and head dims, two groups of four heads, with the gate, D and
    packed sequences, bf16."""
    spec = ProblemSpec(2, 1000, 8, 64, 128, 2, chunk_size=chunk_size, D="h", z=True,
                       seq_boundaries=(300, 512), name=f"model-like-q{chunk_size}")
    check(spec, "bfloat16", gpu_record, f"chunk_scan/model-like/q{chunk_size}", seed_for(spec.name))


def test_bitwise_identical_reruns():
    """No atomics and a fixed order of every sum: two runs give the same bits."""
    spec = SHAPES["q128-tiles"]
    args = stage_inputs(spec, seed_for("scan-bwd-rerun"), "bfloat16")
    first, second = run(args), run(args)
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between two runs"


def test_strided_x_and_int64_seq_idx(gpu_record):
    """x a strided view into a wider buffer (as after an in_proj split), seq_idx int64."""
    spec = SHAPES["all-features"]
    seed = seed_for("scan-bwd-strided")
    args = stage_inputs(spec, seed, "bfloat16")
    want = torch_reference(args)
    wide = torch.zeros(*args["x"].shape[:-1], 2 * args["x"].shape[-1], device="cuda",
                       dtype=torch.bfloat16)
    wide[..., ::2] = args["x"]
    got = run({**args, "x": wide[..., ::2], "seq_idx": args["seq_idx"].long()})
    failures = []
    for key, ref in want.items():
        result = check_gradient(key, got[key], ref, "bfloat16")
        gpu_record.append(dict(test="chunk_scan/strided-x", record="backward",
                               kind="stage/chunk_scan", shape=spec.name, dtype="bfloat16",
                               **result.fields(), seed=seed))
        if not result.ok:
            failures.append(result.failure())
    assert not failures, "; ".join(failures)
