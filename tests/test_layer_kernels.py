"""The layer's conv and norm on the CPU: the float64 references of ssd.layer_reference equal the
layer's PyTorch path (and independent constructions for seq_idx and the initial conv state), the
mixer hands ssd.layer_ops tensors that meet its contract, and every bad argument is a clear error.
Their backward (ssd.layer_autograd): equal in float64 to torch.autograd of the layer's PyTorch
path, gradcheck on tiny shapes, and the real ssd.layer_ops routing a call that requires grad
through it (its kernel launch replaced by the PyTorch forward), so that the mixer with
kernels="cutile" has the gradients of kernels="torch".

The GPU kernels themselves are checked in tests/test_gpu_layer_kernels.py; their AOT compile in
tests/test_aot.py. Error metric: the largest absolute difference, in float64, where every
construction should agree to round-off (~1e-16 of values of order 1): 1e-12.
"""
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ssd.layer  # noqa: E402
from ssd import layer_reference as ref  # noqa: E402
from ssd.layer import (BackendUnavailable, GatedRMSNorm, Mamba2Config,  # noqa: E402
                       Mamba2Mixer, Mamba2Stack, causal_conv1d_torch, kernel_ops)

F64_ATOL = 1e-12


def torch_conv(c, w, seed):
    """A depthwise causal nn.Conv1d as the mixer builds it, float64, random weights and bias."""
    conv = torch.nn.Conv1d(c, c, w, groups=c, padding=w - 1, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(c, 1, w, generator=gen, dtype=torch.float64))
        conv.bias.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
    return conv


def np64(t):
    return t.detach().numpy()


def close(a, b, label):
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    print(f"{label}: max abs diff {err:.1e}")
    assert err <= F64_ATOL, f"{label}: max abs diff {err:.3e} > {F64_ATOL}"


# (b, l, c, w): seqlen 1, seqlen shorter than the width, odd channel counts, every width <= 4.
CONV_SHAPES = [(2, 37, 24, 4), (1, 1, 5, 4), (3, 2, 7, 4), (2, 19, 33, 3), (1, 8, 3, 2),
               (2, 5, 6, 1)]


@pytest.mark.parametrize("b, l, c, w", CONV_SHAPES)
def test_conv_reference_is_the_layer_path(b, l, c, w):
    """The reference equals causal_conv1d_torch (nn.Conv1d over transposed xBC, then SiLU), the
    mixer's kernels="torch" path, on a column slice of a wider tensor as in_proj writes it; and
    without the activation, the convolution itself."""
    conv = torch_conv(c, w, seed=l)
    zxbcdt = torch.randn(b, l, c + 9, dtype=torch.float64)
    xBC = zxbcdt[..., 4:4 + c]  # rows c + 9 apart, as in the mixer
    with torch.no_grad():
        want = causal_conv1d_torch(xBC, conv)
        plain = conv(xBC.transpose(1, 2))[..., :l].transpose(1, 2)
    weight, bias = np64(conv.weight[:, 0]), np64(conv.bias)
    close(ref.causal_conv1d(np64(xBC), weight, bias), want, "silu(conv)")
    close(ref.causal_conv1d(np64(xBC), weight, bias, activation=None), plain, "conv")


def segments(row):
    """[(start, stop)] of the runs of equal ids in a 1-D seq_idx row."""
    cuts = [0, *(np.flatnonzero(np.diff(row)) + 1), len(row)]
    return list(zip(cuts[:-1], cuts[1:]))


def test_conv_reference_with_seq_idx_is_per_sequence():
    """Packed sequences: the reference equals the layer's conv run on every sequence alone (the
    history restarts at each change of seq_idx, including one a tap's width before another)."""
    b, l, c, w = 2, 23, 6, 4
    conv = torch_conv(c, w, seed=1)
    x = torch.randn(b, l, c, dtype=torch.float64)
    seq_idx = np.array([[0] * 5 + [1] * 2 + [2] * 9 + [3] * 7, [2] * 1 + [3] * 22])
    got = ref.causal_conv1d(np64(x), np64(conv.weight[:, 0]), np64(conv.bias), seq_idx=seq_idx)
    with torch.no_grad():
        for i in range(b):
            for start, stop in segments(seq_idx[i]):
                want = causal_conv1d_torch(x[i:i + 1, start:stop], conv)[0]
                close(got[i, start:stop], want, f"row {i} sequence [{start}, {stop})")


def test_conv_reference_with_initial_states_continues_the_sequence():
    """An initial conv state is the w-1 inputs before position 0 (oldest first): the reference
    equals the layer's conv over [state, x] with the first w-1 outputs dropped; with seq_idx it
    feeds only a row whose first sequence is 0 (the SSD's virtual seq_idx before the start)."""
    b, l, c, w = 2, 11, 5, 4
    conv = torch_conv(c, w, seed=2)
    x = torch.randn(b, l, c, dtype=torch.float64)
    state = torch.randn(b, c, w - 1, dtype=torch.float64)
    weight, bias = np64(conv.weight[:, 0]), np64(conv.bias)
    with torch.no_grad():
        want = causal_conv1d_torch(torch.cat([state.transpose(1, 2), x], dim=1), conv)[:, w - 1:]
    close(ref.causal_conv1d(np64(x), weight, bias, initial_states=np64(state)), want, "state")
    seq_idx = np.array([[0] * 4 + [1] * 7, [1] * 11])
    got = ref.causal_conv1d(np64(x), weight, bias, seq_idx=seq_idx, initial_states=np64(state))
    close(got[0, :4], want[0, :4], "state feeds sequence 0")
    close(got[1], ref.causal_conv1d(np64(x[1:]), weight, bias)[0], "not sequence 1")


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_norm_reference_is_the_layer_path(groups):
    """The reference equals the layer's GatedRMSNorm module (fp64 in an fp64 layer), per group,
    with a weight that is not all ones."""
    d = 48
    norm = GatedRMSNorm(d, d // groups, dtype=torch.float64)
    gen = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d, generator=gen, dtype=torch.float64))
    y, z = (torch.randn(2, 7, d, generator=gen, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        want = norm(y, z)
    close(ref.gated_rmsnorm(np64(y), np64(z), np64(norm.weight), d // groups, norm.eps), want,
          f"{groups} groups")


def test_norm_reference_groups_are_independent():
    """Scaling one group's y changes no other group's output and leaves its own unchanged (the
    norm divides the scale out): a norm over the full width would fail both."""
    y, z = np.random.default_rng(0).standard_normal((2, 3, 2, 16))
    w = np.ones(16)
    out = ref.gated_rmsnorm(y, z, w, 8, eps=0.0)
    y2 = y.copy()
    y2[..., :8] *= 10.0
    close(ref.gated_rmsnorm(y2, z, w, 8, eps=0.0), out, "group scaled")


# ----------------------------------------------------------------------------- the mixer


def as_fp32(t):
    """An fp32 tensor of ``t``'s sizes and strides (the kernels take no float64)."""
    return torch.empty_strided(t.size(), t.stride(), dtype=torch.float32)


def reference_ops(calls):
    """Stand-ins for ssd.layer_ops that first show the mixer's tensors meet its contract (the
    real functions, given fp32 tensors of the same sizes and strides, get as far as the device
    check, which a CPU tensor fails last), then compute with the float64 references. ``calls``
    collects (name, the strides of xBC or z)."""
    pytest.importorskip("cuda.tile")
    from ssd import layer_ops

    def causal_conv1d(x, weight, bias):
        with pytest.raises(ValueError, match="x: must be a CUDA tensor"):
            layer_ops.causal_conv1d(*map(as_fp32, (x, weight, bias)))
        calls.append(("causal_conv1d", x.stride()))
        out = ref.causal_conv1d(np64(x), np64(weight), np64(bias))
        return torch.from_numpy(out).to(x.dtype)

    def gated_rmsnorm(y, z, weight, group_size, eps):
        with pytest.raises(ValueError, match="y: must be a CUDA tensor"):
            layer_ops.gated_rmsnorm(*map(as_fp32, (y, z, weight)), group_size, eps)
        calls.append(("gated_rmsnorm", z.stride()))
        out = ref.gated_rmsnorm(np64(y), np64(z), np64(weight), group_size, eps)
        return torch.from_numpy(out).to(y.dtype)

    return types.SimpleNamespace(causal_conv1d=causal_conv1d, gated_rmsnorm=gated_rmsnorm,
                                 MAX_WIDTH=layer_ops.MAX_WIDTH)


@pytest.mark.parametrize("d_conv, ngroups", [(4, 1), (4, 2), (3, 4)])
def test_mixer_hands_the_cutile_path_in_place_views(monkeypatch, d_conv, ngroups):
    """kernels="cutile" wired to the references equals kernels="torch" in float64: the conv gets
    xBC and the norm z as column slices of in_proj's output (rows d_in_proj apart, no copy),
    with the layer's weights, group size and eps."""
    calls = []
    ops = reference_ops(calls)
    monkeypatch.setattr(ssd.layer, "kernel_ops", lambda name: ops if name == "cutile" else None)
    config = Mamba2Config(d_model=32, d_state=8, d_conv=d_conv, headdim=8, ngroups=ngroups,
                          chunk_size=16, dtype="float64")
    mixer = Mamba2Mixer(config, "torch", seed=3)
    u = torch.randn(2, 29, config.d_model, dtype=torch.float64)
    want = mixer(u)
    got = mixer.set_kernels("cutile")(u)
    assert mixer.kernels == "cutile"
    close(got, want, f"mixer d_conv {d_conv} ngroups {ngroups}")
    row = config.d_in_proj
    assert calls == [("causal_conv1d", (29 * row, row, 1)), ("gated_rmsnorm", (29 * row, row, 1))]
    close(mixer.set_kernels("torch")(u), want, "back to torch")


def test_stack_sets_the_kernels_of_every_layer(monkeypatch):
    ops = reference_ops([])
    monkeypatch.setattr(ssd.layer, "kernel_ops", lambda name: ops if name == "cutile" else None)
    config = Mamba2Config(d_model=16, d_state=4, headdim=8, chunk_size=16, dtype="float64")
    stack = Mamba2Stack(config, 2, kernels="cutile")
    assert [m.kernels for m in stack.mixers] == ["cutile", "cutile"]
    u = torch.randn(1, 9, 16, dtype=torch.float64)
    close(stack(u), stack.set_kernels("torch")(u), "stack")


def test_kernels_name_and_availability_are_clear_errors(monkeypatch):
    config = Mamba2Config(d_model=16, d_state=4, headdim=8, chunk_size=16, dtype="float64")
    with pytest.raises(ValueError, match=r"kernels: unknown layer kernels 'triton'"):
        Mamba2Mixer(config, kernels="triton")
    assert kernel_ops("torch") is None
    monkeypatch.setattr(ssd.layer, "_cuda_missing", lambda: "no CUDA GPU (stand-in)")
    with pytest.raises(BackendUnavailable, match=r"'cutile' are unavailable: no CUDA GPU "
                                                 r"\(stand-in\); use kernels='torch'"):
        Mamba2Mixer(config, kernels="cutile")
    mixer = Mamba2Mixer(config)
    with pytest.raises(BackendUnavailable):
        mixer.set_kernels("cutile")
    assert mixer.kernels == "torch"  # unchanged
    monkeypatch.setattr(ssd.layer, "_cuda_missing", lambda: None)
    pytest.importorskip("cuda.tile")
    with pytest.raises(ValueError, match="kernels: the cuTile conv takes d_conv <= 4"):
        Mamba2Mixer(Mamba2Config(d_model=16, d_state=4, d_conv=5, headdim=8), kernels="cutile")


# ----------------------------------------------------------------------------- argument errors


def conv_args(**change):
    b, l, c, w = 2, 10, 6, 4
    args = dict(x=torch.randn(b, l, c), weight=torch.randn(c, w), bias=torch.randn(c),
                seq_idx=torch.zeros(b, l, dtype=torch.int32),
                initial_states=torch.randn(b, c, w - 1))
    args.update(change)
    return args


CONV_ERRORS = {
    "x 2-D": (dict(x=torch.randn(10, 6)), ValueError, r"x: expected \(batch, seqlen, channels\)"),
    "x empty": (dict(x=torch.randn(2, 0, 6)), ValueError, "x: expected a non-empty"),
    "x float64": (dict(x=torch.randn(2, 10, 6, dtype=torch.float64)), TypeError,
                  "x: dtype torch.float64 is not supported"),
    "x not a tensor": (dict(x=np.zeros((2, 10, 6))), TypeError, "x: expected a torch.Tensor"),
    "weight channels": (dict(weight=torch.randn(5, 4)), ValueError,
                        r"weight: expected \(channels=6, width >= 1\)"),
    "weight too wide": (dict(weight=torch.randn(6, 5), initial_states=None), ValueError,
                        "weight: width 5 is wider than the 4"),
    "weight 3-D": (dict(weight=torch.randn(6, 1, 4)), ValueError, r"weight: expected \(channels"),
    "bias": (dict(bias=torch.randn(5)), ValueError, r"bias: expected \(6,\)"),
    "seq_idx shape": (dict(seq_idx=torch.zeros(2, 9, dtype=torch.int32)), ValueError,
                      r"seq_idx: expected \(batch=2, seqlen=10\)"),
    "seq_idx float": (dict(seq_idx=torch.zeros(2, 10)), TypeError, "seq_idx: dtype torch.float32"),
    "initial_states": (dict(initial_states=torch.randn(2, 6, 4)), ValueError,
                       r"initial_states: expected \(batch=2, channels=6, width-1=3\)"),
    "device": (dict(bias=torch.randn(6, device="meta")), ValueError,
               "bias: on meta, but the first input is on cpu"),
    "out with grad": (dict(weight=torch.randn(6, 4, requires_grad=True),
                           out=torch.empty(2, 10, 6)), ValueError,
                      "out: not accepted where a gradient is required"),
    "activation": (dict(activation="relu"), ValueError, "activation: expected one of"),
    "out": (dict(out=torch.empty(2, 10, 7)), ValueError, r"out: expected a contiguous \(2, 10, 6\)"),
    "out dtype": (dict(out=torch.empty(2, 10, 6, dtype=torch.float16)), TypeError, "out: dtype"),
    "cpu": ({}, ValueError, "x: must be a CUDA tensor"),
}


@pytest.mark.parametrize("case", list(CONV_ERRORS))
def test_conv_argument_errors(case):
    """Every check of ssd.layer_ops.causal_conv1d names the argument; the device check comes
    last, so each reads the same on a GPU machine."""
    pytest.importorskip("cuda.tile")
    from ssd.layer_ops import causal_conv1d

    change, error, message = CONV_ERRORS[case]
    with pytest.raises(error, match=message):
        causal_conv1d(**conv_args(**change))


def norm_args(**change):
    args = dict(y=torch.randn(2, 5, 12), z=torch.randn(2, 5, 12), weight=torch.randn(12),
                group_size=4, eps=1e-5)
    args.update(change)
    return args


NORM_ERRORS = {
    "y 0-D": (dict(y=torch.tensor(1.0)), ValueError, r"y: expected \(\.\.\., channels\)"),
    "y no rows": (dict(y=torch.randn(0, 12), z=torch.randn(0, 12)), ValueError,
                  "y: expected at least one row"),
    "z shape": (dict(z=torch.randn(2, 5, 11)), ValueError, r"z: expected y's shape \(2, 5, 12\)"),
    "weight shape": (dict(weight=torch.randn(11)), ValueError, r"weight: expected \(12,\)"),
    "group_size": (dict(group_size=5), ValueError, "group_size: expected a positive divisor"),
    "group_size bool": (dict(group_size=True), ValueError, "group_size: expected a positive"),
    "group too wide": (dict(y=torch.randn(1, 16384), z=torch.randn(1, 16384),
                            weight=torch.randn(16384), group_size=None), ValueError,
                       "group_size: 16384 channels a group is more than the 8192"),
    "eps": (dict(eps=0.0), ValueError, "eps: expected a positive number"),
    "z dtype": (dict(z=torch.zeros(2, 5, 12, dtype=torch.int32)), TypeError, "z: dtype torch.int32"),
    "z strided": (dict(z=torch.randn(2, 5, 24)[..., ::2]), ValueError,
                  "z: expected a unit stride along the channels"),
    "y not flat": (dict(y=torch.randn(5, 2, 12).transpose(0, 1)), ValueError,
                   "y: its leading axes do not flatten without a copy"),
    "out": (dict(out=torch.empty(2, 5, 13)), ValueError, r"out: expected a contiguous tensor"),
    "out with grad": (dict(z=torch.randn(2, 5, 12, requires_grad=True),
                           out=torch.empty(2, 5, 12)), ValueError,
                      r"out: not accepted where a gradient is required \(z requires grad\)"),
    "cpu": ({}, ValueError, "y: must be a CUDA tensor"),
}


@pytest.mark.parametrize("case", list(NORM_ERRORS))
def test_norm_argument_errors(case):
    pytest.importorskip("cuda.tile")
    from ssd.layer_ops import gated_rmsnorm

    change, error, message = NORM_ERRORS[case]
    with pytest.raises(error, match=message):
        gated_rmsnorm(**norm_args(**change))


def test_reference_argument_errors():
    """The references share the contract, and reject what they cannot define."""
    x, w = np.zeros((1, 4, 3)), np.zeros((3, 2))
    with pytest.raises(ValueError, match=r"initial_states: expected \(batch=1, channels=3"):
        ref.causal_conv1d(x, w, initial_states=np.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match="seq_idx: must be non-decreasing"):
        ref.causal_conv1d(x, w, seq_idx=np.array([[0, 1, 0, 1]]))
    with pytest.raises(ValueError, match="activation: expected None, 'silu' or 'swish'"):
        ref.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="group_size: expected a positive divisor of the 3"):
        ref.gated_rmsnorm(x, x, np.ones(3), group_size=2)


# ----------------------------------------------------------------------------- the backward

from ssd import layer_autograd as LA  # noqa: E402


def conv_by_autograd(x, weight, bias, seq_idx, initial_states, activation):
    """The conv by PyTorch ops autograd differentiates, independent of ssd.layer_autograd: the
    layer's packed conv (seq_idx, SiLU) or F.conv1d over [initial_states, x] (channels first)."""
    if seq_idx is not None:
        assert initial_states is None and activation == "silu"
        return ssd.layer._packed_conv1d(x, weight, bias, seq_idx)
    b, l, c = x.shape
    w = weight.shape[1]
    history = (x.new_zeros(b, c, w - 1) if initial_states is None else initial_states)
    xe = torch.cat([history, x.transpose(1, 2)], dim=2)  # (b, c, w-1+l)
    s = torch.nn.functional.conv1d(xe, weight[:, None], bias, groups=c).transpose(1, 2)
    return torch.nn.functional.silu(s) if activation else s


def f64_leaf(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()


# (b, l, c, w, features): every width, a sequence shorter than the width, no bias, no SiLU,
# packed sequences, an initial state.
CONV_GRAD_CASES = [(2, 13, 6, 4, ""), (1, 2, 5, 4, "init"), (2, 9, 3, 3, "nobias,linear"),
                   (3, 7, 4, 2, "init,linear"), (2, 5, 3, 1, ""), (2, 17, 5, 4, "seq")]


@pytest.mark.parametrize("b, l, c, w, features", CONV_GRAD_CASES)
def test_conv_backward_is_autograd_of_the_pytorch_conv(b, l, c, w, features):
    gen = torch.Generator().manual_seed(b * 1000 + l * 10 + w)
    x, weight = f64_leaf(b, l, c, gen=gen), f64_leaf(c, w, gen=gen)
    bias = None if "nobias" in features else f64_leaf(c, gen=gen)
    init = f64_leaf(b, c, w - 1, gen=gen) if "init" in features else None
    seq_idx = (torch.tensor([[0] * 5 + [1] * 1 + [2] * 11, [3] * 9 + [4] * 8])
               if "seq" in features else None)
    activation = None if "linear" in features else "silu"
    leaves = [t for t in (x, weight, bias, init) if t is not None]
    dout = torch.randn(b, l, c, generator=gen, dtype=torch.float64)
    want = conv_by_autograd(x, weight, bias, seq_idx, init, activation)
    got = LA.causal_conv1d(x, weight, bias, seq_idx, init, activation)
    assert got.grad_fn is not None and type(got.grad_fn).__name__ == "CausalConv1dBackward"
    close(got.detach(), want.detach(), "conv forward")
    for name, g, r in zip("x weight bias initial_states".split(),
                          torch.autograd.grad(got, leaves, dout),
                          torch.autograd.grad(want, leaves, dout)):
        close(g, r, f"d{name} {features or 'plain'}")


def test_conv_gradcheck_with_seq_idx_and_initial_states():
    """Finite differences where no PyTorch construction covers both: packed sequences, the
    initial state feeding sequence 0 only (row 1 starts at sequence 1)."""
    gen = torch.Generator().manual_seed(5)
    b, l, c, w = 2, 6, 3, 4
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [1, 1, 1, 2, 2, 2]])
    args = (f64_leaf(b, l, c, gen=gen), f64_leaf(c, w, gen=gen), f64_leaf(c, gen=gen))
    init = f64_leaf(b, c, w - 1, gen=gen)
    assert torch.autograd.gradcheck(
        lambda x, weight, bias, init: LA.causal_conv1d(x, weight, bias, seq_idx, init),
        (*args, init))


@pytest.mark.parametrize("groups", [1, 3])
def test_norm_backward_is_autograd_of_the_pytorch_norm(groups):
    gen = torch.Generator().manual_seed(groups)
    d = 12
    y, z = f64_leaf(2, 5, d, gen=gen), f64_leaf(2, 5, d, gen=gen)
    norm = GatedRMSNorm(d, d // groups, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64))
    norm.weight.requires_grad_()
    dout = torch.randn(2, 5, d, generator=gen, dtype=torch.float64)
    want = norm(y, z)
    got = LA.gated_rmsnorm(y, z, norm.weight, d // groups, norm.eps)
    assert type(got.grad_fn).__name__ == "GatedRMSNormBackward"
    close(got.detach(), want.detach(), "norm forward")
    leaves = (y, z, norm.weight)
    for name, g, r in zip(("y", "z", "weight"), torch.autograd.grad(got, leaves, dout),
                          torch.autograd.grad(want, leaves, dout)):
        close(g, r, f"d{name} groups {groups}")
    assert torch.autograd.gradcheck(
        lambda y, z, w: LA.gated_rmsnorm(y, z, w, 4, 1e-5),
        (f64_leaf(3, 8, gen=gen), f64_leaf(3, 8, gen=gen), f64_leaf(8, gen=gen)))


def kernels_on_the_cpu(monkeypatch):
    """ssd.layer_ops with its kernel launches replaced by the PyTorch forwards and its device
    check passed: what it routes and what it saves can be tested on the CPU. The stand-ins
    refuse a tensor that requires grad, as a launch (DLPack) does."""
    pytest.importorskip("cuda.tile")
    from ssd import layer_ops

    launched = []

    def bare(*tensors):
        assert not any(t is not None and t.requires_grad for t in tensors), "not detached"

    def conv(x, weight, bias=None, seq_idx=None, initial_states=None, silu=True, config=None,
             out=None):
        bare(x, weight, bias, initial_states)
        launched.append("causal_conv1d")
        got = LA.causal_conv1d_torch(x, weight, bias, seq_idx, initial_states,
                                     "silu" if silu else None)
        return got if out is None else out.copy_(got)

    def norm(y, z, weight, group_size, eps, config=None, out=None):
        bare(y, z, weight)
        launched.append("gated_rmsnorm")
        got = LA.gated_rmsnorm_torch(y, z, weight, group_size, eps)
        return got if out is None else out.copy_(got)

    def conv_backward(dout, x, weight, bias=None, seq_idx=None, initial_states=None, silu=True,
                      config=None):
        bare(dout, x, weight, bias, initial_states)
        launched.append("causal_conv1d_backward")
        return LA.causal_conv1d_backward(dout, x, weight, bias, seq_idx, initial_states,
                                         "silu" if silu else None)

    def norm_backward(dout, y, z, weight, group_size, eps):
        bare(dout, y, z, weight)
        launched.append("gated_rmsnorm_backward")
        return LA.gated_rmsnorm_backward(dout, y, z, weight, group_size, eps)

    monkeypatch.setattr(layer_ops._conv, "causal_conv1d", conv)
    monkeypatch.setattr(layer_ops._norm, "gated_rmsnorm", norm)
    monkeypatch.setattr(layer_ops._norm, "gated_rmsnorm_backward", norm_backward)
    monkeypatch.setattr(layer_ops._conv, "causal_conv1d_backward", conv_backward)
    monkeypatch.setattr(layer_ops, "_check_cuda", lambda name, t: None)
    return layer_ops, launched


def test_layer_ops_route_a_gradient_through_the_functions(monkeypatch):
    """Without a gradient the kernel runs alone (no graph); with one, inside the Function,
    whose gradient is the PyTorch conv's; conv_step refuses one rather than detach."""
    ops, launched = kernels_on_the_cpu(monkeypatch)
    gen = torch.Generator().manual_seed(9)
    x, weight, bias = (torch.randn(*s, generator=gen) for s in ((2, 7, 6), (6, 4), (6,)))
    plain = ops.causal_conv1d(x, weight, bias)
    assert plain.grad_fn is None and launched == ["causal_conv1d"]
    weight.requires_grad_()
    with torch.no_grad():
        assert ops.causal_conv1d(x, weight, bias).grad_fn is None
    out = ops.causal_conv1d(x, weight, bias)
    assert type(out.grad_fn).__name__ == "CausalConv1dBackward"
    (dw,) = torch.autograd.grad(out.square().sum(), weight)
    (want,) = torch.autograd.grad(conv_by_autograd(x, weight, bias, None, None, "silu")
                                  .square().sum(), weight)
    assert torch.allclose(dw, want, rtol=1e-5, atol=1e-6)
    y, z = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen).requires_grad_()
    normed = ops.gated_rmsnorm(y, z, torch.ones(8), 4)
    assert type(normed.grad_fn).__name__ == "GatedRMSNormBackward"
    assert launched[-1] == "gated_rmsnorm"
    with pytest.raises(NotImplementedError, match="x: requires grad, but conv_step has no "
                                                  "backward"):
        ops.conv_step(torch.zeros(2, 6, 3), torch.randn(2, 6, requires_grad=True), weight.detach())


@pytest.mark.parametrize("ngroups", [1, 2])
def test_mixer_with_cutile_kernels_has_the_torch_kernels_gradients(monkeypatch, ngroups):
    """Mamba2Mixer(kernels="cutile") through the real ssd.layer_ops (launches replaced by the
    PyTorch forwards), fp32 (the kernels take no float64): every weight's and the input's
    gradient equals the PyTorch conv and norm's to fp32 round-off (relative 1e-5: the two sum
    the taps and the group in different orders, a few fp32 ulps carried through the SSD)."""
    ops, launched = kernels_on_the_cpu(monkeypatch)
    monkeypatch.setattr(ssd.layer, "kernel_ops", lambda name: ops if name == "cutile" else None)
    config = Mamba2Config(d_model=32, d_state=8, headdim=8, ngroups=ngroups, chunk_size=16,
                          dtype="float32")
    mixer = Mamba2Mixer(config, "torch", seed=4).requires_grad_()
    gen = torch.Generator().manual_seed(11)
    u = torch.randn(2, 21, 32, generator=gen)
    dout = torch.randn(2, 21, 32, generator=gen)
    grads = {}
    for kernels in ("torch", "cutile"):
        mixer.set_kernels(kernels).zero_grad()
        leaf = u.clone().requires_grad_()
        mixer(leaf).backward(dout)
        grads[kernels] = {"u": leaf.grad, **{n: p.grad.clone()
                                             for n, p in mixer.named_parameters()}}
    assert launched == ["causal_conv1d", "gated_rmsnorm", "gated_rmsnorm_backward",
                        "causal_conv1d_backward"]
    for name, want in grads["torch"].items():
        got = grads["cutile"][name]
        err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        assert err <= 1e-5, f"d{name}: rel err {err:.2e}"
