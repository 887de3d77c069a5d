"""GPU tests of the backward (``pytest -m gpu``; skipped without a GPU).

``ssd.mamba_chunk_scan_combined`` with inputs that require grad -- the cuTile forward inside
``ssd.autograd.ChunkScanCombined``, the backward of ``ssd.backward`` (its default table on a GPU:
every stage's cuTile kernels, chunk_state's folded into chunk_scan's; some tests take
chunk_state's kernels of its own, ``cutile_backwards(fold=False)``; one forces PyTorch
throughout) -- against the float64 reference gradients (``ProblemSpec.reference_backward``)
computed from exactly the rounded device inputs and the rounded upstream gradients, on fresh
random inputs (a new seed per run, printed on failure; ``SSD_TEST_SEED`` replays one).

Every gradient is checked by both criteria of ``ssd.validate.check_gradient``: the norm within
``GRAD_TOL`` of the input dtype (the derivation is there) and the worst element within
``GRAD_ELEMENT_FACTOR`` tolerances of the reference's RMS (the sums over positions, dA, ddt_bias
and dD, of their terms' norm: ``ssd.validate.sum_scales``); it must come back in its input's
dtype. Memory is poisoned: every ``torch.empty`` in the forward and the backward (the kernels'
output buffers, the backward's) returns NaN-filled memory (PyTorch's deterministic mode with
``fill_uninitialized_memory``), so an element nothing writes fails the check. Rows go to
``results/<gpu>/gpu_backward_tests.json`` (``record="backward"``, tests/conftest.py).

The forward paths differ in what the backward gets (``ssd.autograd``): the entering states as
stored by the fused stage 2 (input dtype) and the split one (fp32), completed from a grouped walk,
or recomputed after the one-kernel forward; each is tested.
"""
import os
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd.config import FusedScanConfig, ScanConfig, SSDConfig, StateConfig  # noqa: E402
from ssd.problem import EDGE_SHAPES, ProblemSpec, random_spec  # noqa: E402
from ssd.validate import (DTYPE_NAMES, GRAD_TOL, as_float64, check_gradient,  # noqa: E402
                          device_inputs, host_inputs, poisoned_memory, sum_scales)

pytestmark = pytest.mark.gpu

RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))

# What the backward reads, by forward path: the default (fused stage 2, entering states in the
# input dtype; at chunk 64 the default may take the one kernel instead); the split stage 2 with
# fp32 entering states; a grouped walk (entering states completed from each group's); stages 2
# and 3 as one kernel (no entering states stored: the backward recomputes them; with seq_idx the
# forward takes the three stages).
CONFIGS = {
    "DEFAULT": None,
    "SPLIT": SSDConfig(state=StateConfig(fused=False, block_n=128, state_dtype="float32",
                                         occupancy=None),
                       scan=ScanConfig(block_h=1, occupancy=None, persistent=False)),
    "GROUPS": SSDConfig(state=StateConfig(groups=3)),
    "ONEKERNEL": SSDConfig(fused_scan=FusedScanConfig(enabled=True)),
}


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """The backward's fp32 einsums in full fp32 (PyTorch's default): TF32 would round their
    operands to 10 bits, far outside the fp32 tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def upstream(spec, seed, dtype, final=True, device="cuda"):
    """The upstream gradients: dy in y's dtype (x's), dfinal_states fp32 (or None)."""
    g = spec.make_output_grads(seed)
    dy = torch.from_numpy(g["dy"]).to(device, getattr(torch, dtype))
    return dy, (torch.from_numpy(g["dfinal_states"]).to(device, torch.float32) if final else None)


def leaves_of(inputs):
    """Fresh leaves that require grad for every float input (seq_idx left as it is)."""
    return {k: v.detach().clone().requires_grad_() for k, v in inputs.items() if k != "seq_idx"}


def api_gradients(spec, inputs, dy, dfinal, config=None, **kw):
    """One forward + backward through ``ssd.mamba_chunk_scan_combined``: {"d" + name:
    gradient} for every float input, after a synchronize."""
    import ssd

    leaves = leaves_of(inputs)
    y, final = ssd.mamba_chunk_scan_combined(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], spec.chunk_size,
        D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
        initial_states=leaves.get("initial_states"), seq_idx=inputs.get("seq_idx"),
        dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit, return_final_states=True,
        config=config, **kw)
    used = [(out, up) for out, up in ((y, dy), (final, dfinal)) if up is not None]
    grads = torch.autograd.grad([o for o, _ in used], list(leaves.values()), [u for _, u in used])
    torch.cuda.synchronize()
    for (name, leaf), g in zip(leaves.items(), grads):
        assert g.dtype == leaf.dtype, f"d{name}: {g.dtype}, the input is {leaf.dtype}"
    return {"d" + k: g for k, g in zip(leaves, grads)}


def reference_gradients(spec, inputs, dy, dfinal):
    """The float64 reference from exactly the values the GPU read (inputs and upstream)."""
    grads = {"dy": as_float64(dy) if dy is not None else np.zeros(spec.dims[:4])}
    if dfinal is not None:
        grads["dfinal_states"] = as_float64(dfinal)
    return spec.reference_backward(host_inputs(inputs), grads)


def check_backward(spec, dtype, record, label, seed, config=None, final=True, only_final=False,
                   backwards=None):
    """Forward + backward into poisoned memory, every gradient checked and recorded; the
    backward's stages from ``backwards`` (None: the default table)."""
    inputs = device_inputs(spec, seed, dtype)
    dy, dfinal = upstream(spec, seed, dtype, final)
    if only_final:
        dy = None
    with poisoned_memory():
        got = api_gradients(spec, inputs, dy, dfinal, config, backwards=backwards)
    want = reference_gradients(spec, inputs, dy, dfinal)
    scales = sum_scales(spec, inputs, dy, want)
    failures = []
    for key, out in got.items():
        check = check_gradient(key, out, want[key], dtype, scales.get(key))
        record.append(dict(test=label, record="backward", shape=spec.name or str(spec),
                           dims=list(spec.dims), chunk_size=spec.chunk_size, dtype=dtype,
                           **check.fields(), seed=seed))
        if not check.ok:
            failures.append(check.failure())
    assert not failures, f"{spec} [{dtype}, seed {seed}]: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("name", list(EDGE_SHAPES))
def test_edge_shapes_every_gradient(name, dtype, gpu_record):
    """Every named edge shape (seq_idx resets, several groups, l % q != 0, l < q, z, D per head
    and per channel, dt_bias, softplus and the clamp, initial states), every gradient, the
    default forward, with a gradient on final_states."""
    check_backward(EDGE_SHAPES[name], dtype, gpu_record, f"edge/{name}", seed_for(name + dtype))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["all-features", "initial-states", "l-not-multiple"])
def test_every_forward_path(name, config, gpu_record):
    """The entering states as each forward path leaves them (saved in the input dtype or fp32,
    completed from a grouped walk, recomputed after the one kernel), bf16."""
    spec = EDGE_SHAPES[name]
    if config == "ONEKERNEL":  # the one kernel has no seq_idx: the shape without it, q >= 32
        spec = spec.replace(seq_boundaries=(), chunk_size=max(32, spec.chunk_size))
    check_backward(spec, "bfloat16", gpu_record, f"path/{config}/{name}",
                   seed_for(name + config), config=CONFIGS[config])


@pytest.mark.parametrize("index", range(24))
def test_random_shapes(index, gpu_record):
    """Random shapes and feature sets (ssd.problem.random_spec), the dtype drawn per case."""
    rng = np.random.default_rng(seed_for(f"bwd-random{index}"))
    spec = random_spec(rng)
    dtype = DTYPE_NAMES[index % 3]
    check_backward(spec, dtype, gpu_record, f"random/{index}", seed_for(f"bwd-r{index}"))


@pytest.mark.parametrize("which", ["y-only", "final-states-only"])
def test_one_output_used(which, gpu_record):
    """Only y feeds the loss (no gradient on final_states), or only final_states does."""
    spec = EDGE_SHAPES["all-features"]
    check_backward(spec, "float32", gpu_record, f"one-output/{which}", seed_for(which),
                   final=which != "y-only", only_final=which == "final-states-only")


@pytest.mark.parametrize("chunk_size", [64, 128, 256])
def test_model_like_chunk_sizes(chunk_size, gpu_record):
    """The production chunk sizes with the layer's features, bf16."""
    spec = ProblemSpec(2, 1000, 8, 64, 128, 1, chunk_size=chunk_size, D="h", dt_bias=True,
                       dt_softplus=True, initial_states=True, z=True, seq_boundaries=(300, 512),
                       name=f"model-like-q{chunk_size}")
    check_backward(spec, "bfloat16", gpu_record, f"model-like/q{chunk_size}", seed_for(spec.name))


def test_default_backward_takes_the_kernels():
    """On a GPU the backward composes every stage's cuTile kernels (these tests exercise them);
    float64 stays with PyTorch."""
    from ssd import backward as TB

    table = TB.default_backwards(torch.empty(1, device="cuda"))
    assert table == TB.cutile_backwards()
    assert all(f.__name__.endswith("_backward_cutile") for f in table if f is not None)
    assert TB.default_backwards(torch.empty(1, device="cuda", dtype=torch.float64)) \
        is TB.TORCH_BACKWARDS


STAGE_CASES = ([(name, "bfloat16") for name in [*EDGE_SHAPES, "model-like-q64", "model-like-q256"]]
              + [(name, dtype) for name in ("all-features", "l-not-multiple")
                 for dtype in ("float32", "float16")])


@pytest.mark.parametrize("name, dtype", STAGE_CASES)
def test_chunk_state_in_its_own_kernels(name, dtype, gpu_record):
    """chunk_state's backward in kernels of its own, after chunk_scan's and the walk
    (``cutile_backwards(fold=False)``), meets the same tolerances: every edge shape and the
    production chunk sizes in bf16, two shapes in fp32 and fp16."""
    from ssd.backward import cutile_backwards

    spec = EDGE_SHAPES.get(name) or ProblemSpec(
        2, 1000, 8, 64, 128, 1, chunk_size=int(name.removeprefix("model-like-q")), D="h",
        dt_bias=True, dt_softplus=True, initial_states=True, z=True, seq_boundaries=(300, 512),
        name=name)
    check_backward(spec, dtype, gpu_record, f"stages/{name}", seed_for("stages" + name + dtype),
                   backwards=cutile_backwards(fold=False))


@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "l-less-than-q"])
def test_torch_backward_path(name, gpu_record):
    """The backward forced to PyTorch throughout (``backwards=TORCH_BACKWARDS``, the path the
    kernels are compared with) meets the same tolerances."""
    from ssd.backward import TORCH_BACKWARDS

    check_backward(EDGE_SHAPES[name], "bfloat16", gpu_record, f"torch-path/{name}",
                   seed_for("torch-path" + name), backwards=TORCH_BACKWARDS)


@pytest.mark.parametrize("fold", [False, True], ids=["stages", "fold"])
def test_bitwise_identical_reruns(fold):
    """The backward is deterministic: the cuTile stage kernels sum in a fixed order (two passes,
    no atomics; folded, each chunk's last-column sum through a buffer of parts) and the PyTorch
    ops are deterministic: two runs give the same bits."""
    from ssd.backward import cutile_backwards

    spec = EDGE_SHAPES["all-features"].replace(seqlen=300, chunk_size=64)
    inputs = device_inputs(spec, seed_for("bwd-rerun"), "bfloat16")
    dy, dfinal = upstream(spec, seed_for("bwd-rerun"), "bfloat16")
    first, second = (api_gradients(spec, inputs, dy, dfinal, backwards=cutile_backwards(fold))
                     for _ in range(2))
    for key in first:
        assert torch.equal(first[key], second[key]), f"{key} differs between two runs"


def test_non_contiguous_x_and_int64_seq_idx(gpu_record):
    """x as a strided view into a wider buffer (as after an in_proj split), seq_idx int64: the
    gradient of the view is the reference's."""
    import ssd

    spec = EDGE_SHAPES["all-features"]
    seed = seed_for("bwd-strided")
    inputs = device_inputs(spec, seed, "bfloat16")
    dy, dfinal = upstream(spec, seed, "bfloat16")
    wide = torch.zeros(*inputs["x"].shape[:-1], 2 * inputs["x"].shape[-1], device="cuda",
                       dtype=torch.bfloat16)
    wide[..., ::2] = inputs["x"]
    x = wide.requires_grad_()[..., ::2]
    leaves = leaves_of({k: v for k, v in inputs.items() if k != "x"})
    y, final = ssd.mamba_chunk_scan_combined(
        x, leaves["dt"], leaves["A"], leaves["B"], leaves["C"], spec.chunk_size, D=leaves["D"],
        z=leaves["z"], dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"],
        seq_idx=inputs["seq_idx"].long(), dt_softplus=True, dt_limit=spec.dt_limit,
        return_final_states=True)
    (dwide,) = torch.autograd.grad([y, final], [wide], [dy, dfinal])
    want = reference_gradients(spec, inputs, dy, dfinal)
    assert not dwide[..., 1::2].any()  # the columns x does not read
    check = check_gradient("dx", dwide[..., ::2], want["dx"], "bfloat16")
    gpu_record.append(dict(test="strided-x", record="backward", shape=spec.name,
                           dtype="bfloat16", **check.fields()))
    assert check.ok, check.failure()


def test_varlen_states_refuse_a_gradient():
    """With return_varlen_states the forward returns them; y's gradient flows, theirs raises."""
    import ssd

    spec = ProblemSpec(1, 300, 4, 32, 64, 1, chunk_size=64, D="h", dt_bias=True, dt_softplus=True,
                       initial_states=True, seq_boundaries=(70, 128, 200), name="packed")
    inputs = device_inputs(spec, seed_for("bwd-varlen"), "bfloat16")
    leaves = leaves_of(inputs)
    cu = torch.from_numpy(spec.cu_seqlens()).cuda()
    y, varlen = ssd.mamba_chunk_scan_combined(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], spec.chunk_size,
        D=leaves["D"], dt_bias=leaves["dt_bias"], initial_states=leaves["initial_states"],
        seq_idx=inputs["seq_idx"], cu_seqlens=cu, dt_softplus=True, return_varlen_states=True)
    assert varlen.shape == (4, 4, 32, 64)
    (dx,) = torch.autograd.grad(y.float().sum(), [leaves["x"]], retain_graph=True)
    assert torch.isfinite(dx).all()
    with pytest.raises(NotImplementedError, match="^varlen_states"):
        torch.autograd.grad(varlen.sum(), [leaves["x"]])


def test_a_recorded_call_saves_the_entering_states(gpu_record):
    """Where inference runs stages 2 and 3 as one kernel, which stores no entering state (b x h
    fills the GPU: 8 x 24 heads here), a call autograd records takes the three stages
    (``default_config(stores_states=True)``) and saves every chunk's entering state, so the
    backward rebuilds none in PyTorch; its gradients still meet the tolerance."""
    from ssd import api

    spec = ProblemSpec(8, 256, 24, 64, 128, 1, chunk_size=64, D="h", dt_bias=True,
                       dt_softplus=True, name="one-kernel-inference")
    inputs = device_inputs(spec, seed_for("bwd-stores"), "bfloat16")
    if not api.resolve_config(None, 64, inputs["x"], inputs["B"]).fused_scan.enabled:
        pytest.skip("this GPU's inference default runs three stages at this shape")
    x = inputs["x"].clone().requires_grad_()
    y = api.mamba_chunk_scan_combined(x, inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 64,
                                      D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True)
    prev_states = y.grad_fn.saved_tensors[-1]  # ChunkScanCombined saves them last
    assert prev_states is not None and prev_states.shape == (8, 4, 24, 64, 128)
    check_backward(spec, "bfloat16", gpu_record, "stores-states", seed_for("bwd-stores"))


def test_no_gradient_required_saves_nothing():
    """Without a gradient required the forward runs alone: no graph, and the same bits as the
    differentiable call's forward."""
    import ssd

    spec = EDGE_SHAPES["all-features"]
    inputs = device_inputs(spec, seed_for("bwd-plain"), "bfloat16")
    args = (inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], spec.chunk_size)
    kw = dict(D=inputs["D"], z=inputs["z"], dt_bias=inputs["dt_bias"],
              initial_states=inputs["initial_states"], seq_idx=inputs["seq_idx"],
              dt_softplus=True, dt_limit=spec.dt_limit, return_final_states=True)
    plain = ssd.mamba_chunk_scan_combined(*args, **kw)
    assert all(t.grad_fn is None for t in plain)
    x = inputs["x"].clone().requires_grad_()
    recorded = ssd.mamba_chunk_scan_combined(x, *args[1:], **kw)
    assert type(recorded[0].grad_fn).__name__ == "ChunkScanCombinedBackward"
    assert all(torch.equal(a, b) for a, b in zip(plain, recorded))


@pytest.mark.parametrize("name", ["all-features", "seq-idx-mid-chunk", "ngroups-gt-1",
                                  "l-not-multiple", "D-per-channel", "dt-bias-softplus-limit"])
def test_matches_mamba_ssm_backward_where_it_is_correct(name, gpu_record):
    """The same inputs and upstream gradients through mamba_ssm's Triton forward + backward:
    where a gradient of mamba_ssm's meets the tolerance against the reference, ours must agree
    with it to twice the tolerance. Where mamba_ssm misses it, or fails, the row records it (data
    about the peer) and checks ours against the reference only."""
    from ssd.tools.peers import PeerUnavailable, mamba_ssm_forward

    try:
        theirs = mamba_ssm_forward()
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    spec, dtype = EDGE_SHAPES[name], "bfloat16"
    seed = seed_for("bwd-peer" + name)
    inputs = device_inputs(spec, seed, dtype)
    dy, dfinal = upstream(spec, seed, dtype)
    ours = api_gradients(spec, inputs, dy, dfinal)
    want = reference_gradients(spec, inputs, dy, dfinal)
    scales = sum_scales(spec, inputs, dy, want)
    leaves = leaves_of(inputs)
    try:
        y, final = theirs(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"],
                          spec.chunk_size, D=leaves.get("D"), z=leaves.get("z"),
                          dt_bias=leaves.get("dt_bias"),
                          initial_states=leaves.get("initial_states"),
                          seq_idx=inputs.get("seq_idx"), dt_softplus=spec.dt_softplus,
                          dt_limit=spec.dt_limit, return_final_states=True)
        peer = dict(zip(("d" + k for k in leaves),
                        torch.autograd.grad([y, final], list(leaves.values()), [dy, dfinal])))
    except Exception as exc:  # a peer failure is data, not our failure
        gpu_record.append(dict(test="peer/mamba_ssm-backward", record="backward", shape=name,
                               dtype=dtype, kind="peer",
                               error=f"{type(exc).__name__}: {exc}"[:300]))
        peer = {}
    failures = []
    for key, out in ours.items():
        check = check_gradient(key, out, want[key], dtype, scales.get(key))
        row = dict(test="peer/mamba_ssm-backward", record="backward", shape=name, dtype=dtype,
                   kind="peer", **check.fields())
        if not check.ok:
            failures.append(check.failure())
        if key in peer:  # both measured as check_gradient measures ours (a sum: its terms' norm)
            peer_err = check_gradient(key, peer[key], want[key], dtype, scales.get(key)).rel_err
            size = np.abs(want[key]) if key not in scales else np.maximum(np.abs(want[key]),
                                                                           scales[key])
            diff = float(np.linalg.norm(as_float64(out) - as_float64(peer[key]))
                         / max(np.linalg.norm(size), 1e-300))
            row.update(mamba_ssm_rel_err=peer_err, ours_vs_mamba_ssm=diff)
            if peer_err <= GRAD_TOL[dtype] and diff > 2 * GRAD_TOL[dtype]:
                failures.append(f"{key}: ours vs mamba_ssm {diff:.3e}")
        gpu_record.append(row)
    assert not failures, f"{spec} [seed {seed}]: " + "; ".join(failures)


# one worker runs the large tests one after another (--dist loadgroup): side by side they
# would not fit in an 80 GB card
@pytest.mark.xdist_group("large")
@pytest.mark.skipif(os.environ.get("SSD_SKIP_LARGE") == "1", reason="SSD_SKIP_LARGE=1")
@pytest.mark.parametrize("fold", [False, True], ids=["stages", "fold"])
def test_backward_past_2_31_elements(fold, gpu_record):
    """b8 x 65,536 tokens x 80 heads x headdim 64 x dstate 128 in bf16 at chunk 256: x, dx and
    dy have 2.7 G elements and the (b, c, h, p, n) state gradients as many, so every backward
    kernel indexes with int64. Checked on the last batch row's last four heads (the highest
    offsets), whose dx and ddt depend on their own inputs and the shared B and C alone, against
    the float64 reference of that slice (dA and dD sum over every batch row, and dB and dC over
    every head: no slice holds them); with chunk_state's backward as its own stage and folded
    into chunk_scan's kernels."""
    import math

    import ssd
    from ssd.backward import cutile_backwards

    b, l, h, p, n, q = 8, 65536, 80, 64, 128, 256
    gen = torch.Generator(device="cuda").manual_seed(seed_for("bwd-large"))
    bf16 = torch.bfloat16
    x = torch.randn(b, l, h, p, device="cuda", dtype=bf16, generator=gen)
    assert x.numel() > 2**31
    B, C = (torch.randn(b, l, 1, n, device="cuda", dtype=bf16, generator=gen) for _ in range(2))
    dt = torch.exp(torch.empty(b, l, h, device="cuda").uniform_(
        math.log(1e-3), math.log(1e-1), generator=gen)).to(bf16)
    A = -torch.exp(torch.empty(h, device="cuda").uniform_(0, math.log(16), generator=gen))
    D = torch.randn(h, device="cuda")
    dy = torch.randn(b, l, h, p, device="cuda", dtype=bf16, generator=gen)
    leaves = {k: v.requires_grad_() for k, v in dict(x=x, dt=dt).items()}
    y = ssd.mamba_chunk_scan_combined(leaves["x"], leaves["dt"], A, B, C, q, D=D,
                                      backwards=cutile_backwards(fold=fold))
    dx, ddt = torch.autograd.grad(y, [leaves["x"], leaves["dt"]], dy)
    del y
    torch.cuda.synchronize()
    heads = slice(h - 4, h)
    spec = ProblemSpec(1, l, 4, p, n, 1, chunk_size=q, D="h", name="large-slice")
    inputs = {"x": x[-1:, :, heads].detach(), "dt": dt[-1:, :, heads].detach(),
              "A": A[heads].detach(), "B": B[-1:], "C": C[-1:], "D": D[heads].detach()}
    dy_slice = dy[-1:, :, heads]
    want = spec.reference_backward(host_inputs(inputs), {"dy": as_float64(dy_slice)})
    got = {"dx": dx[-1:, :, heads], "ddt": ddt[-1:, :, heads]}
    failures = []
    for key, out in got.items():
        check = check_gradient(key, out, want[key], "bfloat16")
        gpu_record.append(dict(test=f"large/2.7G/{'fold' if fold else 'stages'}",
                               record="backward", shape="b8-l65536-h80-p64-n128",
                               dtype="bfloat16", **check.fields(), x_numel=x.numel()))
        if not check.ok:
            failures.append(check.failure())
    assert not failures, "; ".join(failures)
