"""GPU tests of the layer's conv and norm kernels (``pytest -m gpu``; skipped without a GPU).

Each kernel output is compared with the float64 reference of ``ssd.layer_reference`` computed
from the *rounded* device inputs, on fresh random inputs (a new seed per run, printed on
failure; ``SSD_TEST_SEED`` replays a run), written into an output buffer filled with NaN before
the launch, so that an element the kernel does not write fails. Inputs come in the layouts the
mixer hands over: xBC and z as column slices of a wider (b, l, d_in_proj) tensor, read in place.
The conv's and norm's backward kernels are held to their PyTorch backwards in float64 (normwise,
section "backwards"). Then the mixer with ``kernels="cutile"`` is compared with ``kernels="torch"``: its output, its
gradients (the conv and norm's autograd Functions of ``ssd.layer_autograd``) and its decode
steps (the conv step kernel) against the forward.

Elementwise bounds: twice the worst case derived from the unit roundoff u of the dtype (u32 =
2^-24 of fp32; both kernels compute in fp32 and round once to the dtype; FN =
ssd.validate.FN_UNITS fp32 units for the exp, rsqrt and division approximations). The final
rounding alone can take an element to its worst case, so without the factor a correct kernel
would sit at the bound; with it, an fp32 emulation of the kernels stays under half of it (and
a conversion that truncates instead of rounding would still pass), while a wrong tap, weight,
bias, group or reset moves elements by their own size, hundreds of u in bf16.

* causal_conv1d: the pre-activation s = bias + sum of w products of inputs exact in fp32 (a
  product of two bf16 or fp16 values is exact in fp32; fp32 products round once) carries at most
  (w+1) u32 S, S = |bias| + sum_k |w_k x_k| (the standard bound of a sum; S is the reference's
  conv of absolute values, so cancellation is allowed for); SiLU's slope is at most 1.1, and its
  own evaluation adds FN u32 |out|; the store rounds by u |out|. Allowed:
  2 (u |ref| + (FN |ref| + 1.1 (w+1) S) u32 + a).
* gated_rmsnorm: v = y silu(z) carries (FN+1) u32 relative; the sum of G squares of positive
  terms, in any order, (G + 2 FN + 3) u32; its rsqrt half of that plus FN; the two products 2:
  the output is within (2 FN + G/2 + 8) u32 relative before the store's u. Allowed:
  2 ((u + (2 FN + G/2 + 8) u32) |ref| + a). (G/2 u32 is a worst case: at the 2.7b layer's group of
  5120 channels it is 1.5e-4 relative, far below what a wrong group, weight or gate does.)
* conv_step: the conv's bound with the window [conv_state, x] as its inputs (one position); the
  rolled state holds values of x's dtype moved, so it must equal the reference's exactly, and a
  padding entry of a paged cache must leave every state row as it was and write out = 0.
* a: half the smallest subnormal spacing of the dtype, the rounding of a result below the
  normal range, which the relative terms do not cover (2^-25 in fp16, where the norm's outputs
  reach it; below 1e-40 in bf16 and fp32).

The rows (record="mixer") go to results/<gpu>/gpu_mixer_tests.json with the mixer's checks.
"""
import math
import os
import zlib
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import layer_reference as ref  # noqa: E402
from ssd.layer import PRESETS, Mamba2Config, Mamba2Mixer  # noqa: E402
from ssd.validate import FN_UNITS, UNIT_ROUNDOFF  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "bfloat16", "float16")
U32 = 2.0**-24
#: Half the smallest subnormal spacing: the absolute rounding of a result that small.
TINY = {"float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}
RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


def f64(t) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def host(inputs: dict) -> dict:
    """The inputs on the host, floats as float64 (the values the kernel read), seq_idx as int."""
    return {k: None if v is None else v.cpu().numpy() if k == "seq_idx" else f64(v)
            for k, v in inputs.items()}


def check(label, got, want, bound, record, **fields):
    """Assert every element within its bound (NaN, an unwritten element, fails); record the
    relative Frobenius error and the worst element's error over its bound."""
    got = f64(got)
    err = np.abs(got - want)
    ratio = np.where(np.isfinite(err), err / bound, np.inf)
    worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    rel = (float(np.linalg.norm(got - want) / np.linalg.norm(want)) if np.isfinite(got).all()
           else math.inf)
    record.append(dict(record="mixer", test=label, rel_err=rel, elem_ratio=float(ratio[worst]),
                       elem_index=[int(i) for i in worst], **fields))
    print(f"{label} {fields}: rel err {rel:.2e}, worst element {float(ratio[worst]):.2f} of "
          f"its bound at {worst}")
    assert ratio[worst] <= 1.0, (
        f"{label} {fields} [SSD_TEST_SEED={RUN_SEED} replays the run]: element {worst} is "
        f"{got[worst]!r}, reference {want[worst]!r}, error {err[worst]:.3g} > bound "
        f"{bound[worst]:.3g}")


def columns(gen, b, l, c, row, offset, dtype):
    """A (b, l, c) float tensor that is a column slice [offset, offset + c) of a (b, l, row)
    one, as in_proj's output holds xBC and z (row None: contiguous)."""
    if row is None:
        return torch.randn(b, l, c, generator=gen, device="cuda").to(dtype)
    parent = torch.randn(b, l, row, generator=gen, device="cuda").to(dtype)
    return parent[..., offset:offset + c]


def packed(rng, b, l, first):
    """(b, l) int32 seq_idx: a few sequences a row, some a position or two long (boundaries
    within one kernel width of each other), starting at ``first[i]``."""
    cuts = np.zeros((b, l), dtype=np.int64)
    for i in range(b):
        at = rng.choice(np.arange(1, l), size=min(l - 1, 6), replace=False)
        cuts[i, at] = 1
        cuts[i, min(l - 1, at.min() + 1)] = 1  # a one-position sequence
    return torch.from_numpy(np.cumsum(cuts, axis=1) + np.asarray(first)[:, None]).to(
        "cuda", torch.int32)


# ----------------------------------------------------------------------------- causal_conv1d

# name: (b, l, channels, width, row of the parent tensor (None: contiguous), column offset,
# features). The model sizes read xBC where the 130m and 2.7b layers' in_proj writes it.
CONV_CASES = {
    "seqlen-1": (2, 1, 1792, 4, 3352, 1536, ""),
    "seqlen-below-width": (2, 3, 37, 4, 50, 5, ""),
    "odd-channels": (3, 100, 77, 4, 91, 3, ""),
    "width-3": (2, 70, 40, 3, None, 0, ""),
    "width-2": (1, 65, 129, 2, None, 0, ""),
    "width-1": (2, 9, 33, 1, None, 0, ""),
    "130m": (2, 1000, 1792, 4, 3352, 1536, ""),
    "2.7b": (1, 700, 5376, 4, 10576, 5120, ""),
    "no-bias-no-silu": (2, 50, 24, 4, None, 0, "nobias,linear"),
    "seq_idx": (3, 150, 96, 4, 200, 40, "seq"),
    "initial_states": (2, 5, 72, 4, None, 0, "init"),
    "seq_idx-initial_states": (2, 130, 72, 4, 100, 8, "seq,init"),
}


def conv_inputs(name, dtype, seed):
    b, l, c, w, row, offset, features = CONV_CASES[name]
    t = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = dict(x=columns(gen, b, l, c, row, offset, t),
                  weight=(0.5 * torch.randn(c, w, generator=gen, device="cuda")).to(t),
                  bias=None if "nobias" in features else
                  (0.5 * torch.randn(c, generator=gen, device="cuda")).to(t))
    if "seq" in features:
        inputs["seq_idx"] = packed(np.random.default_rng(seed), b, l, [0, 1, 0][:b])
    if "init" in features:
        inputs["initial_states"] = torch.randn(b, c, w - 1, generator=gen, device="cuda").to(t)
    return inputs, None if "linear" in features else "silu"


def conv_bound(inputs, activation, want, dtype):
    absolute = {k: v if v is None or k == "seq_idx" else np.abs(v)
                for k, v in host(inputs).items()}
    scale = ref.causal_conv1d(**absolute, activation=None)  # S = |bias| + sum_k |w_k x_k|
    w = inputs["weight"].shape[1]
    worst = UNIT_ROUNDOFF[dtype] * np.abs(want) + (FN_UNITS * np.abs(want)
                                                   + 1.1 * (w + 1) * scale) * U32
    return 2 * (worst + TINY[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_causal_conv1d_matches_float64_reference(name, dtype, gpu_record):
    from ssd.layer_ops import causal_conv1d

    seed = seed_for(f"conv/{name}/{dtype}")
    inputs, activation = conv_inputs(name, dtype, seed)
    out = torch.full(inputs["x"].shape, float("nan"), device="cuda", dtype=inputs["x"].dtype)
    got = causal_conv1d(**inputs, activation=activation, out=out)
    assert got is out and got.is_contiguous()
    want = ref.causal_conv1d(**host(inputs), activation=activation)
    check("layer-causal_conv1d", got, want, conv_bound(inputs, activation, want, dtype),
          gpu_record, shape=name, dims=list(CONV_CASES[name][:4]), dtype=dtype, seed=seed)


def test_causal_conv1d_int64_indexing(gpu_record):
    """xBC a column slice of a tensor of 2^31 elements or more: offsets need int64 indexing
    though the slice itself is small (ssd.launch.index_dtype_for)."""
    from ssd.layer_ops import causal_conv1d

    seed = seed_for("conv/int64")
    b, l, c, row = 1, 2**17, 24, 2**14 + 64  # 2^31 + 2^23 elements, 6.4 MB of them used
    gen = torch.Generator(device="cuda").manual_seed(seed)
    parent = torch.empty(b, l, row, device="cuda", dtype=torch.bfloat16)
    x = parent[..., row - c:]
    x.copy_(torch.randn(b, l, c, generator=gen, device="cuda"))
    weight = torch.randn(c, 4, generator=gen, device="cuda").to(torch.bfloat16)
    bias = torch.randn(c, generator=gen, device="cuda").to(torch.bfloat16)
    got = causal_conv1d(x, weight, bias, out=torch.full((b, l, c), float("nan"), device="cuda",
                                                         dtype=torch.bfloat16))
    inputs = dict(x=x, weight=weight, bias=bias)
    want = ref.causal_conv1d(f64(x), f64(weight), f64(bias))
    check("layer-causal_conv1d", got, want, conv_bound(inputs, "silu", want, "bfloat16"),
          gpu_record, shape="int64", dims=[b, l, c, 4], dtype="bfloat16", seed=seed)


# ----------------------------------------------------------------------------- gated_rmsnorm

# name: (b, l, d, groups, row of z's parent tensor (None: contiguous)); z is its first d
# columns, as in the layer. The model sizes: 130m and 2.7b (one group of 1536 and 5120
# channels), codestral-7b (8 groups of 1024).
NORM_CASES = {
    "seqlen-1": (1, 1, 1536, 1, 3352),
    "odd-groups": (2, 37, 150, 5, 171),
    "partial-row-block": (3, 7, 96, 2, None),
    "130m": (2, 1000, 1536, 1, 3352),
    "2.7b": (1, 700, 5120, 1, 10576),
    "codestral-7b": (1, 300, 8192, 8, 18560),
    "widest-group": (1, 5, 8192, 1, None),
}


def norm_inputs(name, dtype, seed):
    """y (b, l, d), z the first d columns of a wider tensor (as in the layer), the fp32 weight
    (as the layer's), and the generator that drew them."""
    b, l, d, groups, row = NORM_CASES[name]
    t = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    y = torch.randn(b, l, d, generator=gen, device="cuda").to(t)
    z = columns(gen, b, l, d, row, 0, t)
    return y, z, 1.0 + 0.1 * torch.randn(d, generator=gen, device="cuda"), gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(NORM_CASES))
def test_gated_rmsnorm_matches_float64_reference(name, dtype, gpu_record):
    from ssd.layer_ops import gated_rmsnorm

    b, l, d, groups, _ = NORM_CASES[name]
    seed = seed_for(f"norm/{name}/{dtype}")
    t = getattr(torch, dtype)
    y, z, weight, _ = norm_inputs(name, dtype, seed)
    out = torch.full((b, l, d), float("nan"), device="cuda", dtype=t)
    got = gated_rmsnorm(y, z, weight, d // groups, 1e-5, out=out)
    assert got is out
    want = ref.gated_rmsnorm(f64(y), f64(z), f64(weight), d // groups, 1e-5)
    G = d // groups
    bound = 2 * ((UNIT_ROUNDOFF[dtype] + (2 * FN_UNITS + G / 2 + 8) * U32) * np.abs(want)
                 + TINY[dtype])
    check("layer-gated_rmsnorm", got, want, bound, gpu_record, shape=name,
          dims=[b, l, d, groups], dtype=dtype, seed=seed)


# ----------------------------------------------------------------------------- backwards

# The conv's and the norm's backward kernels against their PyTorch backwards
# (ssd.layer_autograd, checked against torch.autograd of the float64 layer on the CPU) in
# float64 on the values the kernels read, NaN-poisoned outputs. Normwise relative error per
# gradient: both compute in fp32 from the same inputs, so what differs is the kernels' fp32
# rounding of sums of n terms (n u32: the w^2 products of dx, the b l positions of dweight and
# dbias, the group's G channels of the norm's row sums and its rows of dweight) and dx, dy and
# dz's one rounding to their dtype (u). Allowed twice that plus 2^-20: a wrong tap, reset, slope
# or group moves the affected elements by their own size.
BACKWARD_CONV = ("seqlen-below-width", "odd-channels", "width-3", "no-bias-no-silu", "130m",
                 "seq_idx-initial_states")
BACKWARD_NORM = ("odd-groups", "partial-row-block", "2.7b", "codestral-7b")


def backward_check(label, got, want, terms, dtype, record, **fields):
    for key, g64 in want.items():
        if g64 is None:
            assert got[key] is None, key
            continue
        rounding = UNIT_ROUNDOFF[dtype] if got[key].dtype == getattr(torch, dtype) else 0.0
        allowed = 2 * (rounding + terms[key] * U32) + 2.0**-20
        err = rel_err(got[key], g64)
        record.append(dict(record="mixer", test=label, grad=key, dtype=dtype, rel_err=err,
                           tol=allowed, **fields))
        assert err <= allowed, f"{label} {fields} d{key}: {err:.3e} > {allowed:.3e}"


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("name", BACKWARD_CONV)
def test_causal_conv1d_backward_matches_float64(name, dtype, gpu_record):
    from ssd.kernels.causal_conv1d import causal_conv1d_backward
    from ssd.layer_autograd import causal_conv1d_backward as torch_backward
    from ssd.validate import poisoned_memory

    seed = seed_for(f"conv-backward/{name}/{dtype}")
    inputs, activation = conv_inputs(name, dtype, seed)
    b, l, c, w = CONV_CASES[name][:4]
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    dout = torch.randn(b, l, c, generator=gen, device="cuda").to(inputs["x"].dtype)
    with poisoned_memory():
        got = causal_conv1d_backward(dout, **inputs, silu=activation is not None)
    as64 = {k: v if v is None or k == "seq_idx" else v.double() for k, v in inputs.items()}
    want = torch_backward(dout.double(), **as64, activation=activation)
    assert list(got) == list(want)
    terms = dict(dx=w * w + 8, dweight=b * l, dbias=b * l, dinitial_states=w * w + 8)
    backward_check("layer-conv-backward-vs-float64", got, want, terms, dtype, gpu_record,
                   shape=name, seed=seed)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("name", BACKWARD_NORM)
def test_gated_rmsnorm_backward_matches_float64(name, dtype, gpu_record):
    from ssd.kernels.gated_rmsnorm import gated_rmsnorm_backward
    from ssd.layer_autograd import gated_rmsnorm_backward as torch_backward
    from ssd.validate import poisoned_memory

    b, l, d, groups, _ = NORM_CASES[name]
    seed = seed_for(f"norm-backward/{name}/{dtype}")
    y, z, weight, gen = norm_inputs(name, dtype, seed)
    dout = torch.randn(b, l, d, generator=gen, device="cuda").to(y.dtype)
    with poisoned_memory():
        got = gated_rmsnorm_backward(dout, y, z, weight, d // groups, 1e-5)
    want = torch_backward(dout.double(), y.double(), z.double(), weight.double(), d // groups,
                          1e-5)
    assert list(got) == list(want)
    G = d // groups
    terms = dict(dy=G + 16, dz=G + 16, dweight=b * l)
    backward_check("layer-norm-backward-vs-float64", got, want, terms, dtype, gpu_record,
                   shape=name, seed=seed)


# ----------------------------------------------------------------------------- the mixer

# Relative Frobenius error of the mixer output, kernels="cutile" against kernels="torch" (the
# same weights, input and SSD backend). The torch path rounds the conv to the dtype before its
# SiLU and again after, the kernel once; the norms round once each: the outputs differ by a few
# independent roundings per element (each of RMS u/sqrt(3)), carried through the SSD and
# out_proj: about u in norm. 4u in bf16 and fp16. fp32 (TF32 off for cuDNN's conv): 1e-5, far
# below a wrong wiring's 1e-2 .. 1.
MIXER_TOL = {"float32": 1e-5, "bfloat16": 4 * 2.0**-8, "float16": 4 * 2.0**-11}
MIXER_CASES = {
    "130m-l777": (PRESETS["130m"], 2, 777),
    "2.7b-l512": (PRESETS["2.7b"], 1, 512),
    "g4-l1000": (Mamba2Config(d_model=512, d_state=128, ngroups=4), 2, 1000),
}


@pytest.fixture
def no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def rel_err(out, want) -> float:
    out, want = (t.detach().double() for t in (out, want))
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.norm(out - want) / torch.linalg.norm(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MIXER_CASES))
def test_mixer_cutile_kernels_match_torch_kernels(case, dtype, no_tf32, gpu_record):
    """The mixer with the cuTile conv and norm against the same mixer with the PyTorch ones
    (the SSD the torch backend on both sides, so that only the kernels differ); and against the
    float64 layer: no further from it than the torch kernels' layer is, plus u."""
    config, b, l = MIXER_CASES[case]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"mixer/{case}/{dtype}")
    mixer = Mamba2Mixer(config, "torch", kernels="cutile", device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.randn(b, l, config.d_model, generator=gen, device="cuda").to(config.torch_dtype)
    got = mixer(u)
    want = mixer.set_kernels("torch")(u)
    assert got.dtype == want.dtype and got.shape == want.shape == (b, l, config.d_model)
    m64 = Mamba2Mixer(replace(config, dtype="float64"), "torch", device="cuda", seed=seed)
    m64.load_state_dict({k: v.double() for k, v in mixer.state_dict().items()})
    out64 = m64(u.double())
    err, base = rel_err(got, want), rel_err(want, out64)
    err64, allowed = rel_err(got, out64), 1.5 * base + UNIT_ROUNDOFF[dtype]
    common = dict(record="mixer", shape=case, dims=list(config.ssd_dims(b, l)),
                  chunk_size=config.chunk_size, dtype=dtype, seed=seed, stage="mixer")
    gpu_record.append(dict(test="mixer-kernels-cutile-vs-torch", rel_err=err,
                           tol=MIXER_TOL[dtype], **common))
    gpu_record.append(dict(test="mixer-kernels-cutile-vs-float64", rel_err=err64, tol=allowed,
                           torch_rel_err=base, **common))
    print(f"{case} {dtype}: cutile vs torch kernels {err:.2e} (tol {MIXER_TOL[dtype]:.1e}); vs "
          f"float64 {err64:.2e} (torch kernels {base:.2e}, allowed {allowed:.2e})")
    replay = f"[seed {seed}; SSD_TEST_SEED={RUN_SEED} replays the run]"
    assert err <= MIXER_TOL[dtype], f"{case} {dtype} {replay}: vs torch kernels {err:.3e}"
    assert err64 <= allowed, f"{case} {dtype} {replay}: vs float64 {err64:.3e} > {allowed:.3e}"


# ----------------------------------------------------------------------------- conv_step

# name: (b, channels, width, row of x's parent tensor (None: contiguous), column offset,
# features). The model sizes read xBC where the 130m and 2.7b layers' in_proj writes one token.
STEP_CASES = {
    "130m-b1": (1, 1792, 4, 3352, 1536, ""),
    "2.7b-b8": (8, 5376, 4, 10576, 5120, ""),
    "odd-channels": (3, 77, 4, 91, 3, ""),
    "width-3": (2, 40, 3, None, 0, ""),
    "width-2": (2, 129, 2, None, 0, ""),
    "width-1": (2, 33, 1, None, 0, ""),
    "no-bias-no-silu": (2, 24, 4, None, 0, "nobias,linear"),
    "paged": (5, 96, 4, 200, 40, "paged"),
    "paged-int64": (4, 300, 4, None, 0, "paged,int64"),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(STEP_CASES))
def test_conv_step_matches_float64_reference(name, dtype, gpu_record):
    from ssd.layer_ops import conv_step

    b, c, w, row, offset, features = STEP_CASES[name]
    seed = seed_for(f"conv_step/{name}/{dtype}")
    t = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = columns(gen, b, 1, c, row, offset, t)[:, 0]  # (b, c), one token of in_proj's output
    weight = (0.5 * torch.randn(c, w, generator=gen, device="cuda")).to(t)
    bias = None if "nobias" in features else (
        0.5 * torch.randn(c, generator=gen, device="cuda")).to(t)
    activation = None if "linear" in features else "silu"
    slots, indices = np.arange(b), None
    if "paged" in features:  # rows of a larger cache, in any order, one entry padding
        slots = np.random.default_rng(seed).permutation(2 * b + 1)[:b]
        slots[1] = -1
        indices = torch.from_numpy(slots).to(
            "cuda", torch.int64 if "int64" in features else torch.int32)
    state = torch.randn(2 * b + 1 if indices is not None else b, c, w - 1, generator=gen,
                        device="cuda").to(t)
    before = f64(state)
    out = torch.full((b, c), float("nan"), device="cuda", dtype=t)
    got = conv_step(state, x, weight, bias, activation, state_batch_indices=indices, out=out)
    assert got is out
    live = slots >= 0
    w64, b64 = f64(weight), None if bias is None else f64(bias)
    want, want_state = np.zeros((b, c)), before.copy()
    want[live], want_state[slots[live]] = ref.conv_step(before[slots[live]], f64(x)[live], w64,
                                                        b64, activation)
    scale = np.zeros((b, c))  # S = |bias| + sum_k |w_k window_k|; 0 for a padding entry
    scale[live] = ref.conv_step(np.abs(before[slots[live]]), np.abs(f64(x)[live]), np.abs(w64),
                                None if b64 is None else np.abs(b64), None)[0]
    bound = 2 * (UNIT_ROUNDOFF[dtype] * np.abs(want)
                 + (FN_UNITS * np.abs(want) + 1.1 * (w + 1) * scale) * U32 + TINY[dtype])
    check("layer-conv_step", got, want, bound, gpu_record, shape=name, dims=[b, c, w],
          dtype=dtype, seed=seed)
    rolled = f64(state)
    assert np.array_equal(rolled, want_state), (
        f"{name} {dtype} [SSD_TEST_SEED={RUN_SEED}]: the rolled conv state differs at "
        f"{np.argwhere(rolled != want_state)[:5].tolist()}")


# ----------------------------------------------------------------------------- training

# The gradients of the mixer with kernels="cutile" (the kernels' forwards inside the autograd
# Functions of ssd.layer_autograd, the conv's PyTorch backward, the norm's backward kernel)
# against the float64 layer's, beside
# the same errors of kernels="torch" (autograd through nn.Conv1d and the eager norm), the SSD the
# torch backend on every side. Each gradient's relative error in norm is allowed twice the torch
# kernels' own (the dtype's roundings in in_proj, the SSD and out_proj, which both paths make)
# plus 4u (the kernels round the conv and norm once each where PyTorch rounds differently, and a
# backward computed from the rounded forward's inputs): a missing SiLU slope, tap, gate or group
# moves a gradient by its own size.
GRAD_CASES = {
    "130m-l300": (PRESETS["130m"], 2, 300),
    "g4-l257": (Mamba2Config(d_model=256, d_state=64, ngroups=4, chunk_size=64), 2, 257),
}


def mixer_grads(mixer, u, dout) -> dict:
    mixer.zero_grad()
    leaf = u.clone().requires_grad_()
    mixer(leaf).backward(dout)
    return {"u": leaf.grad.double(), **{n: p.grad.double() for n, p in mixer.named_parameters()}}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_mixer_cutile_kernels_gradients_match_float64(case, dtype, no_tf32, gpu_record):
    config, b, l = GRAD_CASES[case]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"mixer-grad/{case}/{dtype}")
    mixer = Mamba2Mixer(config, "torch", kernels="cutile", device="cuda", seed=seed)
    mixer.requires_grad_()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.randn(b, l, config.d_model, generator=gen, device="cuda").to(config.torch_dtype)
    dout = torch.randn(b, l, config.d_model, generator=gen, device="cuda").to(config.torch_dtype)
    got = mixer_grads(mixer, u, dout)
    torch_kernels = mixer_grads(mixer.set_kernels("torch"), u, dout)
    m64 = Mamba2Mixer(replace(config, dtype="float64"), "torch", device="cuda", seed=seed)
    m64.load_state_dict({k: v.double() for k, v in mixer.state_dict().items()})
    want = mixer_grads(m64.requires_grad_(), u.double(), dout.double())
    replay = f"[seed {seed}; SSD_TEST_SEED={RUN_SEED} replays the run]"
    for name, g64 in want.items():
        err, base = rel_err(got[name], g64), rel_err(torch_kernels[name], g64)
        allowed = 2 * base + 4 * UNIT_ROUNDOFF[dtype]
        gpu_record.append(dict(record="mixer", test="mixer-kernels-cutile-grad-vs-float64",
                               shape=case, dims=list(config.ssd_dims(b, l)), dtype=dtype,
                               seed=seed, grad=name, rel_err=err, tol=allowed,
                               torch_rel_err=base))
        print(f"{case} {dtype} d{name}: {err:.2e} (torch kernels {base:.2e}, allowed "
              f"{allowed:.2e})")
        assert err <= allowed, f"{case} {dtype} d{name} {replay}: {err:.3e} > {allowed:.3e}"


# ----------------------------------------------------------------------------- decode

# A prefill then decode steps with kernels="cutile" (the conv step kernel, the norm kernel on one
# row a sequence), token for token against the float64 layer's forward over the whole sequence,
# the SSD the torch backend: allowed twice the same generation's error with kernels="torch"
# plus u (the kernels' one rounding each), as tests/test_gpu_generation.py holds the cuTile SSD.
STEP_MIXER_CASES = {"130m": (PRESETS["130m"], 2, 37, 5), "g4": (GRAD_CASES["g4-l257"][0], 3, 2, 6)}


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("case", list(STEP_MIXER_CASES))
def test_mixer_cutile_kernels_steps_match_the_forward(case, dtype, no_tf32, gpu_record):
    config, b, prompt, steps = STEP_MIXER_CASES[case]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"mixer-step/{case}/{dtype}")
    mixer = Mamba2Mixer(config, "torch", kernels="cutile", device="cuda", seed=seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    u = torch.randn(b, prompt + steps, config.d_model, generator=gen, device="cuda").to(
        config.torch_dtype)

    def generate(m):
        out, cache = m.prefill(u[:, :prompt])
        outs = [out] + [m.step(u[:, t:t + 1], cache) for t in range(prompt, prompt + steps)]
        return torch.cat(outs, dim=1), cache

    got, cache = generate(mixer)
    base_out, base_cache = generate(mixer.set_kernels("torch"))
    m64 = Mamba2Mixer(replace(config, dtype="float64"), "torch", device="cuda", seed=seed)
    m64.load_state_dict({k: v.double() for k, v in mixer.state_dict().items()})
    with torch.no_grad():
        want = m64(u.double())
    assert torch.equal(cache.conv_state, base_cache.conv_state)  # in_proj's outputs, both paths
    tail = slice(prompt, None)
    err, base = rel_err(got[:, tail], want[:, tail]), rel_err(base_out[:, tail], want[:, tail])
    allowed = 2 * base + UNIT_ROUNDOFF[dtype]
    gpu_record.append(dict(record="mixer", test="mixer-kernels-cutile-steps-vs-float64",
                           shape=case, dims=list(config.ssd_dims(b, prompt + steps)),
                           dtype=dtype, seed=seed, rel_err=err, tol=allowed, torch_rel_err=base))
    print(f"{case} {dtype}: steps {err:.2e} (torch kernels {base:.2e}, allowed {allowed:.2e})")
    assert err <= allowed, (f"{case} {dtype} [seed {seed}; SSD_TEST_SEED={RUN_SEED}]: steps "
                            f"{err:.3e} > {allowed:.3e}")
