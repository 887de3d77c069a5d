"""Generation in the Mamba-2 layer and stack on the CPU: a prefill hands each sequence's conv and
SSM state to the decode loop, and prefill-then-steps equals the whole sequence's forward, token
for token, for a batch and for packed prompts of different lengths; the pieces (the packed
SSD and conv in PyTorch, the conv step, the SSM step) equal their float64 references; bad caches
are clear errors.

Error metric: relative Frobenius error ||out - ref|| / ||ref|| (the largest absolute difference
for the pieces). float64: 1e-10, room for the chunked and the recurrent paths' different
summation orders (~1e-15) and far below what a wrong term gives (a state not handed over, a
conv tap off by one: 1e-3 .. 1, see test_handover_check_can_fail). float32: both paths compute
in fp32 (u = 6e-8) and differ by summation order over at most l terms a state element, carried
through the norm and out_proj: ~2e-7 seen; 2e-6 allowed.

The GPU backends' decode steps are checked in tests/test_gpu_generation.py.
"""
import math
import types
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ssd.layer  # noqa: E402
from ssd import layer_reference as ref  # noqa: E402
from ssd.layer import (BackendUnavailable, InferenceCache, Mamba2Config,  # noqa: E402
                       Mamba2Mixer, Mamba2Stack, causal_conv1d_torch, conv_state_of,
                       conv_step_torch, selective_state_update_reference_torch,
                       selective_state_update_torch, ssd_torch, step_function)
from ssd.problem import EDGE_SHAPES  # noqa: E402
from ssd.reference import selective_state_update, ssd_chunked  # noqa: E402

TOL = {"float64": 1e-10, "float32": 2e-6}
F64_ATOL = 1e-12

# chunk 16, d_conv 4: prompts shorter than the conv's history, ending on and crossing chunk
# borders; ngroups 1 and 2.
CONFIG = Mamba2Config(d_model=32, d_state=8, headdim=16, ngroups=2, chunk_size=16,
                      dtype="float64")
CONFIG_G1 = Mamba2Config(d_model=24, d_state=6, d_conv=3, headdim=8, chunk_size=16,
                         dtype="float64")


@pytest.fixture(autouse=True)
def one_thread():
    """Decoding runs thousands of ops on tensors of a few hundred elements: on a shared CPU,
    waking a thread pool for each costs more than the work (15 ms against 5 us a matmul)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def rel_err(out, want) -> float:
    out, want = (t.detach().double() for t in (out, want))
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.norm(out - want) / torch.linalg.norm(want))


def check(label, out, want, tol):
    err = rel_err(out, want)
    print(f"{label}: rel err {err:.2e} (tol {tol:.0e})")
    assert err <= tol, f"{label}: rel err {err:.3e} > {tol:.0e}"


def close(a, b, label, atol=F64_ATOL):
    a, b = (np.asarray(t.detach() if torch.is_tensor(t) else t, dtype=np.float64) for t in (a, b))
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    print(f"{label}: max abs diff {err:.1e}")
    assert a.shape == b.shape and err <= atol, f"{label}: max abs diff {err:.3e} > {atol}"


def tokens(config, b, l, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, l, config.d_model, generator=gen).to(config.torch_dtype)


def decode(model, u, cache):
    """Step ``model`` through u (b, m, d_model) one token at a time -> (b, m, d_model)."""
    return torch.cat([model.step(u[:, t:t + 1], cache) for t in range(u.shape[1])], dim=1)


# ----------------------------------------------------------------------------- the pieces


@pytest.mark.parametrize("name", ["seq-idx-mid-chunk", "all-features"])
def test_ssd_torch_packed_matches_reference(name):
    """seq_idx in the plain-PyTorch SSD: y and the final state equal ssd.reference's."""
    spec = EDGE_SHAPES[name]
    arrays = spec.make_inputs(seed=3)
    want = spec.reference(arrays)
    y, final = ssd_torch(**{k: torch.from_numpy(v) for k, v in arrays.items()}, **spec.options,
                         return_final_states=True)
    close(y, want["y"], f"{name} y")
    close(final, want["final_states"], f"{name} final_states")


# one row: sequences of one token, ending on a chunk border (32), starting on one, the last
# of one token; chunk 32, l 96.
@pytest.mark.parametrize("boundaries", [(5, 32, 70), (1, 2, 3, 31, 32, 33, 64, 95)])
def test_ssd_torch_varlen_states_match_reference(boundaries):
    spec = EDGE_SHAPES["seq-idx-mid-chunk"].replace(batch=1, seq_boundaries=boundaries)
    arrays = spec.make_inputs(seed=4)
    cu = spec.cu_seqlens()
    kw = dict(spec.options, cu_seqlens=cu, return_final_states=True, return_varlen_states=True)
    want = ssd_chunked(**arrays, **kw)
    got = ssd_torch(**{k: torch.from_numpy(v) for k, v in arrays.items()},
                    **dict(kw, cu_seqlens=torch.from_numpy(np.asarray(cu))))
    for label, g, w in zip(("y", "final_states", "varlen_states"), got, want):
        close(g, w, f"{boundaries} {label}")
    with pytest.raises(ValueError, match="return_varlen_states: needs cu_seqlens"):
        ssd_torch(**{k: torch.from_numpy(v) for k, v in arrays.items()}, **spec.options,
                  return_varlen_states=True)


def test_packed_conv_matches_reference():
    """causal_conv1d_torch with seq_idx (the taps one by one) equals the float64 reference,
    including sequences shorter than the kernel and a boundary at position 0."""
    b, l, c, w = 2, 23, 6, 4
    conv = torch.nn.Conv1d(c, c, w, groups=c, padding=w - 1, dtype=torch.float64)
    x = torch.randn(b, l, c + 3, dtype=torch.float64)[..., 2:2 + c]  # a column slice
    seq_idx = torch.tensor([[0] * 5 + [1] * 2 + [2] * 9 + [3] * 7, [2] * 1 + [3] * 22])
    with torch.no_grad():
        got = causal_conv1d_torch(x, conv, seq_idx)
    want = ref.causal_conv1d(x.numpy(), conv.weight[:, 0].detach().numpy(),
                             conv.bias.detach().numpy(), seq_idx=seq_idx.numpy())
    close(got, want, "packed conv")


@pytest.mark.parametrize("w", [4, 3, 2, 1])
def test_conv_step_rolls_the_state_and_equals_the_conv(w):
    """Stepping through a sequence from a zero state gives the causal conv's outputs (the
    reference's); each step equals ssd.layer_reference.conv_step, and leaves the state holding
    the last w-1 inputs, oldest first."""
    b, l, c = 2, 7, 5
    gen = torch.Generator().manual_seed(w)
    x = torch.randn(b, l, c, generator=gen, dtype=torch.float64)
    weight = torch.randn(c, w, generator=gen, dtype=torch.float64)
    bias = torch.randn(c, generator=gen, dtype=torch.float64)
    state = torch.zeros(b, c, w - 1, dtype=torch.float64)
    outs = []
    for t in range(l):
        want, want_state = ref.conv_step(state.numpy(), x[:, t].numpy(), weight.numpy(),
                                         bias.numpy())
        outs.append(conv_step_torch(state, x[:, t], weight, bias))
        close(outs[-1], want, f"w={w} step {t}")
        close(state, want_state, f"w={w} state after step {t}")
    close(torch.stack(outs, 1), ref.causal_conv1d(x.numpy(), weight.numpy(), bias.numpy()),
          f"w={w} steps vs conv")
    close(state, x[:, l - (w - 1):].transpose(1, 2) if w > 1 else state, "last inputs")
    plain = conv_step_torch(state.clone(), x[:, 0], weight, None, activation=None)
    close(plain, ref.conv_step(state.numpy(), x[:, 0].numpy(), weight.numpy(), None,
                               activation=None)[0], "no bias, no activation")


def test_conv_state_of_takes_each_sequences_last_inputs():
    """A batch: each row's last w-1 inputs (zeros before a row shorter than that); packed: each
    sequence's own, zeros before its start, never its neighbour's."""
    c, w = 3, 4
    x = torch.arange(1.0, 1 + 2 * 5 * c).view(2, 5, c)
    got = conv_state_of(x, w)
    close(got, x[:, 2:].transpose(1, 2), "batch")
    short = conv_state_of(x[:, :2], w)
    close(short[..., 0], torch.zeros(2, c), "batch shorter than w-1: zero first")
    close(short[..., 1:], x[:, :2].transpose(1, 2), "batch shorter than w-1: its inputs")
    row = x[:1].reshape(1, 5, c)
    packed = conv_state_of(row, w, torch.tensor([0, 1, 4, 5]))  # lengths 1, 3, 1
    close(packed[0], torch.cat([torch.zeros(c, 2), row[0, :1].T], 1), "packed length 1")
    close(packed[1], row[0, 1:4].T, "packed length 3")
    close(packed[2], torch.cat([torch.zeros(c, 2), row[0, 4:].T], 1), "packed last, length 1")
    assert conv_state_of(x, 1).shape == (2, c, 0)


STEP_FORMS = {  # (dt per channel, A per channel and state, D and dt_bias per channel, z, limit)
    "per-head": (False, False, False, False, None),
    "full-forms-z-limit": (True, True, True, True, (0.01, 0.5)),
}


@pytest.mark.parametrize("form", list(STEP_FORMS))
def test_selective_state_update_torch_matches_reference(form):
    """The torch decode step (the torch backend's) and the NumPy wrapper (the reference
    backend's) equal ssd.reference.selective_state_update, state updated in place, with every
    argument form; fp32 state: computed in fp32, stored in fp32."""
    per_channel, a_full, dp_full, gate, limit = STEP_FORMS[form]
    b, h, p, n, g = 3, 4, 5, 6, 2
    gen = torch.Generator().manual_seed(len(form))
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    args = dict(x=r(b, h, p), dt=r(b, h, p) if per_channel else r(b, h),
                A=-r(h, p, n).abs() if a_full else -r(h).abs(), B=r(b, g, n), C=r(b, g, n),
                D=r(h, p) if dp_full else r(h), z=r(b, h, p) if gate else None,
                dt_bias=r(h, p) if dp_full else r(h))
    state = r(b, h, p, n)
    host = {k: None if v is None else v.numpy() for k, v in args.items()}
    want_y, want_state = selective_state_update(state.numpy(), **host, dt_softplus=True,
                                                dt_limit=limit)
    for fn in (selective_state_update_torch, selective_state_update_reference_torch):
        s = state.clone()
        y = fn(s, **args, dt_softplus=True, dt_limit=limit)
        close(y, want_y, f"{form} {fn.__name__} y")
        close(s, want_state, f"{form} {fn.__name__} state in place")
    s32 = state.float()
    y32 = selective_state_update_torch(s32, **{k: None if v is None else v.float()
                                               for k, v in args.items()}, dt_softplus=True,
                                       dt_limit=limit)
    assert y32.dtype == s32.dtype == torch.float32
    close(s32, want_state, f"{form} fp32 state", atol=1e-5)


def test_mamba_ssm_step_passes_full_forms_as_broadcast_views():
    """mamba_ssm's step takes only full forms: the adapter hands per-head dt, A, D, dt_bias as
    stride-0 views of the per-head values (its kernel's fast path) and refuses dt_limit."""
    seen = {}

    def fake(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        seen.update(dt=dt, A=A, D=D, dt_bias=dt_bias)
        return selective_state_update_torch(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                            dt_softplus=dt_softplus)

    step = ssd.layer._mamba_ssm_step(fake)
    b, h, p, n = 2, 4, 3, 5
    args = dict(x=torch.randn(b, h, p), dt=torch.randn(b, h), A=-torch.rand(h),
                B=torch.randn(b, 1, n), C=torch.randn(b, 1, n), D=torch.randn(h),
                dt_bias=torch.randn(h))
    state = torch.randn(b, h, p, n)
    s = state.clone()
    y = step(s, **args, dt_softplus=True)
    assert seen["dt"].shape == (b, h, p) and seen["dt"].stride(-1) == 0
    assert seen["A"].shape == (h, p, n) and seen["A"].stride()[1:] == (0, 0)
    assert seen["D"].shape == seen["dt_bias"].shape == (h, p) and seen["D"].stride(-1) == 0
    s2 = state.clone()
    close(y, selective_state_update_torch(s2, **args, dt_softplus=True), "adapter y", 1e-6)
    close(s, s2, "adapter state", 1e-6)
    with pytest.raises(ValueError, match="dt_limit: mamba_ssm's selective_state_update clamps"):
        step(s, **args, dt_limit=(0.0, 1.0))


# ----------------------------------------------------------------------------- the mixer


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 16, 21, 44])
def test_mixer_prefill_then_steps_equals_forward(k, dtype):
    """A batch: prefill of the first k tokens (0: a zero cache; 1..3 shorter than the conv's
    history of d_conv-1 = 3; 16 a chunk; 21 and 44 not multiples of it) then l-k steps give the
    forward's outputs token for token, and leave the cache a prefill of all l would hand over."""
    config = replace(CONFIG, dtype=dtype)
    mixer = Mamba2Mixer(config, "torch", seed=1)
    b, l = 2, 45
    u = tokens(config, b, l, seed=k)
    full = mixer(u)
    if k:
        head, cache = mixer.prefill(u[:, :k])
        check(f"k={k} {dtype} prefill", head, full[:, :k], TOL[dtype])
    else:
        cache = mixer.new_cache(b)
    assert cache.ssm_state.dtype == (torch.float64 if dtype == "float64" else torch.float32)
    tail = decode(mixer, u[:, k:], cache)
    assert tail.dtype == config.torch_dtype and tail.shape == (b, l - k, config.d_model)
    check(f"k={k} {dtype} steps", tail, full[:, k:], TOL[dtype])
    _, after_all = mixer.prefill(u)
    # in_proj of one token and of l tokens may round differently (another matmul kernel)
    check(f"k={k} {dtype} conv_state", cache.conv_state, after_all.conv_state, TOL[dtype])
    check(f"k={k} {dtype} ssm_state", cache.ssm_state, after_all.ssm_state, TOL[dtype])


def packed_prompts(config, lengths, steps, seed):
    """Sequences of lengths[i] + steps tokens: (the prompts packed along one row (1, L,
    d_model), cu_seqlens, the continuations (S, steps, d_model), each whole sequence)."""
    seqs = [tokens(config, 1, n + steps, seed + i)[0] for i, n in enumerate(lengths)]
    packed = torch.cat([s[:n] for s, n in zip(seqs, lengths)])[None]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    rest = torch.stack([s[n:] for s, n in zip(seqs, lengths)])
    return packed, cu, rest, seqs


# lengths: 1 and 2 (below d_conv-1), 16 (a chunk), 5 (ending on a chunk border: 1+2+16+5=24
# is not, 40 below is), 37 (crossing two borders).
LENGTHS = [1, 2, 16, 21, 37]


@pytest.mark.parametrize("config", [CONFIG, CONFIG_G1, replace(CONFIG, dtype="float32")],
                         ids=["g2", "g1-d_conv3", "g2-float32"])
def test_mixer_packed_prefill_then_steps_equals_forward(config):
    """Packed prompts of different lengths: the packed prefill equals each prompt's forward
    alone, and decoding all of them from their own states equals each whole sequence's
    forward."""
    mixer = Mamba2Mixer(config, "torch", seed=2)
    steps = 4
    packed, cu, rest, seqs = packed_prompts(config, LENGTHS, steps, seed=10)
    out, cache = mixer.prefill(packed, cu, check_values=True)
    assert cache.batch == len(LENGTHS) and out.shape == packed.shape
    tail = decode(mixer, rest, cache)
    tol = TOL[config.dtype]
    for i, s in enumerate(seqs):
        full = mixer(s[None])[0]
        n = LENGTHS[i]
        check(f"sequence {i} ({n} tokens) prefill", out[0, cu[i]:cu[i + 1]], full[:n], tol)
        check(f"sequence {i} steps", tail[i], full[n:], tol)


def test_reference_backend_generates_as_the_torch_backend():
    """The reference backend's prefill (NumPy, varlen states) and decode step (NumPy) agree
    with the torch backend's."""
    mixer = Mamba2Mixer(CONFIG, "torch", seed=3)
    packed, cu, rest, _ = packed_prompts(CONFIG, [3, 20], 3, seed=20)
    out, cache = mixer.prefill(packed, cu)
    tail = decode(mixer, rest, cache)
    mixer.set_backend("reference")
    out_r, cache_r = mixer.prefill(packed, cu)
    check("reference prefill", out_r, out, TOL["float64"])
    check("reference steps", decode(mixer, rest, cache_r), tail, TOL["float64"])


def test_handover_check_can_fail():
    """The comparison sees a state not handed over (a zero SSM or conv state after the prefill)
    and a conv state one position off."""
    mixer = Mamba2Mixer(CONFIG, "torch", seed=4)
    u = tokens(CONFIG, 2, 30, seed=4)
    full = mixer(u)[:, 20:]
    for broken in ("ssm_state", "conv_state", "conv-shifted"):
        _, cache = mixer.prefill(u[:, :20])
        if broken == "conv-shifted":
            xBC = mixer.in_proj(u[:, :19])[..., CONFIG.d_inner:CONFIG.d_inner + CONFIG.conv_dim]
            cache.conv_state.copy_(conv_state_of(xBC, CONFIG.d_conv))  # ends a token early
        else:
            getattr(cache, broken).zero_()
        err = rel_err(decode(mixer, u[:, 20:], cache), full)
        print(f"{broken}: rel err {err:.2e}")
        assert err > 1e-3


# ----------------------------------------------------------------------------- the stack


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_stack_prefill_then_steps_equals_forward(dtype):
    """Three layers, a batch and packed prompts: prefill then steps equal the forward."""
    config = replace(CONFIG, dtype=dtype)
    stack = Mamba2Stack(config, 3, seed=5)
    u = tokens(config, 2, 27, seed=5)
    full = stack(u)
    head, caches = stack.prefill(u[:, :19])
    assert len(caches) == 3 and all(isinstance(c, InferenceCache) for c in caches)
    check(f"stack {dtype} prefill", head, full[:, :19], TOL[dtype])
    check(f"stack {dtype} steps", decode(stack, u[:, 19:], caches), full[:, 19:], TOL[dtype])
    check(f"stack {dtype} from a zero cache", decode(stack, u, stack.new_cache(2)), full,
          TOL[dtype])
    packed, cu, rest, seqs = packed_prompts(config, [2, 17], 3, seed=30)
    out, caches = stack.prefill(packed, cu)
    tail = decode(stack, rest, caches)
    for i, s in enumerate(seqs):
        whole = stack(s[None])[0]
        n = int(cu[i + 1] - cu[i])
        check(f"stack {dtype} packed {i} prefill", out[0, cu[i]:cu[i + 1]], whole[:n], TOL[dtype])
        check(f"stack {dtype} packed {i} steps", tail[i], whole[n:], TOL[dtype])


# ----------------------------------------------------------------------------- the cuTile path


def reference_ops(calls):
    """Stand-ins for ssd.layer_ops: the real functions first get as far as their device check
    on fp32 tensors of the same sizes and strides (the mixer's tensors meet their contract),
    then the float64 references compute. ``calls`` collects the names and xBC / z strides."""
    pytest.importorskip("cuda.tile")
    from ssd import layer_ops

    def as_fp32(t):
        return None if t is None else torch.empty_strided(t.size(), t.stride(),
                                                          dtype=torch.float32)

    def causal_conv1d(x, weight, bias, seq_idx=None):
        with pytest.raises(ValueError, match="x: must be a CUDA tensor"):
            layer_ops.causal_conv1d(as_fp32(x), as_fp32(weight), as_fp32(bias), seq_idx=seq_idx)
        calls.append(("causal_conv1d", x.stride(), seq_idx is not None))
        return torch.from_numpy(ref.causal_conv1d(
            x.numpy(), weight.numpy(), bias.numpy(),
            seq_idx=None if seq_idx is None else seq_idx.numpy()))

    def conv_step(conv_state, x, weight, bias):
        with pytest.raises(ValueError, match="x: must be a CUDA tensor"):
            layer_ops.conv_step(*map(as_fp32, (conv_state, x, weight, bias)))
        calls.append(("conv_step", x.stride()))
        out, new_state = ref.conv_step(conv_state.numpy(), x.numpy(), weight.numpy(),
                                       bias.numpy())
        conv_state.copy_(torch.from_numpy(new_state))
        return torch.from_numpy(out)

    def gated_rmsnorm(y, z, weight, group_size, eps):
        with pytest.raises(ValueError, match="y: must be a CUDA tensor"):
            layer_ops.gated_rmsnorm(*map(as_fp32, (y, z, weight)), group_size, eps)
        calls.append(("gated_rmsnorm", z.stride()))
        return torch.from_numpy(ref.gated_rmsnorm(y.numpy(), z.numpy(), weight.numpy(),
                                                  group_size, eps))

    return types.SimpleNamespace(causal_conv1d=causal_conv1d, conv_step=conv_step,
                                 gated_rmsnorm=gated_rmsnorm, MAX_WIDTH=layer_ops.MAX_WIDTH)


def test_cutile_kernels_path_generates_as_the_torch_path(monkeypatch):
    """kernels="cutile" wired to the references: the packed prefill hands seq_idx to the conv,
    each step hands conv_step xBC and the norm z as column slices of in_proj's output, and the
    result equals kernels="torch"."""
    calls = []
    ops = reference_ops(calls)
    monkeypatch.setattr(ssd.layer, "kernel_ops", lambda name: ops if name == "cutile" else None)
    mixer = Mamba2Mixer(CONFIG, "torch", seed=6)
    packed, cu, rest, _ = packed_prompts(CONFIG, [2, 9], 2, seed=40)
    out, cache = mixer.prefill(packed, cu)
    tail = decode(mixer, rest, cache)
    mixer.set_kernels("cutile")
    out_c, cache_c = mixer.prefill(packed, cu)
    close(out_c, out, "cutile path prefill")
    close(decode(mixer, rest, cache_c), tail, "cutile path steps")
    row = CONFIG.d_in_proj
    assert calls == [("causal_conv1d", (11 * row, row, 1), True),
                     ("gated_rmsnorm", (11 * row, row, 1))] + \
        [("conv_step", (row, 1)), ("gated_rmsnorm", (row, 1))] * 2


CONV_STEP_ERRORS = {
    "x 3-D": (dict(x=torch.randn(2, 1, 6)), ValueError, r"x: expected \(batch, channels\)"),
    "weight channels": (dict(weight=torch.randn(5, 4)), ValueError,
                        r"weight: expected \(channels=6, width >= 1\)"),
    "weight too wide": (dict(weight=torch.randn(6, 5), conv_state=torch.randn(2, 6, 4)),
                        ValueError, "weight: width 5 is wider than the 4"),
    "bias": (dict(bias=torch.randn(5)), ValueError, r"bias: expected \(6,\)"),
    "conv_state width": (dict(conv_state=torch.randn(2, 6, 4)), ValueError,
                         r"conv_state: expected \(batch=2, channels=6, width-1=3\)"),
    "conv_state dtype": (dict(conv_state=torch.randn(2, 6, 3, dtype=torch.float16)), TypeError,
                         "conv_state: dtype torch.float16"),
    "activation": (dict(activation="relu"), ValueError, "activation: expected one of"),
    "indices shape": (dict(state_batch_indices=torch.zeros(3, dtype=torch.int32)), ValueError,
                      r"state_batch_indices: expected \(batch=2,\)"),
    "indices dtype": (dict(state_batch_indices=torch.zeros(2)), TypeError,
                      "state_batch_indices: dtype torch.float32"),
    "paged conv_state": (dict(state_batch_indices=torch.zeros(2, dtype=torch.int64),
                              conv_state=torch.randn(5, 6, 2)), ValueError,
                         r"conv_state: expected \(rows >= 1, channels=6, width-1=3\) with "
                         "state_batch_indices"),
    "conv_state stride 0": (dict(conv_state=torch.randn(1, 6, 3).expand(2, 6, 3)), ValueError,
                            "conv_state: a stride of 0"),
    "out shape": (dict(out=torch.empty(2, 7)), ValueError, r"out: expected shape \(2, 6\)"),
    "out dtype": (dict(out=torch.empty(2, 6, dtype=torch.float16)), TypeError, "out: dtype"),
    "grad": (dict(weight=torch.randn(6, 4, requires_grad=True)), NotImplementedError,
             "weight: requires grad, but conv_step has no backward"),
    "cpu": ({}, ValueError, "x: must be a CUDA tensor"),
    "cpu paged": (dict(state_batch_indices=torch.tensor([4, -1]), conv_state=torch.randn(5, 6, 3)),
                  ValueError, "x: must be a CUDA tensor"),
}


@pytest.mark.parametrize("case", list(CONV_STEP_ERRORS))
def test_conv_step_argument_errors(case):
    """ssd.layer_ops.conv_step names the argument; the device check comes last."""
    pytest.importorskip("cuda.tile")
    from ssd.layer_ops import conv_step

    change, error, message = CONV_STEP_ERRORS[case]
    args = dict(conv_state=torch.randn(2, 6, 3), x=torch.randn(2, 6), weight=torch.randn(6, 4),
                bias=torch.randn(6))
    args.update(change)
    with pytest.raises(error, match=message):
        conv_step(**args)


# ----------------------------------------------------------------------------- errors


def bad_cache(field, **how):
    cache = Mamba2Mixer(CONFIG, seed=0).new_cache(2)
    t = getattr(cache, field)
    return replace(cache, **{field: how["make"](t)})


CACHE_ERRORS = {
    "conv_state width": ("conv_state", lambda t: t[..., :2], ValueError,
                         r"cache.conv_state: expected shape \(batch=2, conv_dim=96, d_conv-1=3\)"),
    "conv_state batch": ("conv_state", lambda t: t[:1], ValueError,
                         r"cache.conv_state: expected shape \(batch=2"),
    "conv_state dtype": ("conv_state", lambda t: t.float(), TypeError,
                         "cache.conv_state: dtype torch.float32, expected the model's float64"),
    "ssm_state heads": ("ssm_state", lambda t: t[:, :3], ValueError,
                        r"cache.ssm_state: expected shape \(batch=2, nheads=4, headdim=16, "
                        r"d_state=8\)"),
    "ssm_state int": ("ssm_state", lambda t: t.long(), TypeError,
                      "cache.ssm_state: dtype torch.int64, expected a float"),
    "ssm_state not a tensor": ("ssm_state", lambda t: t.numpy(), TypeError,
                               "cache.ssm_state: expected a torch.Tensor"),
    "ssm_state device": ("ssm_state", lambda t: t.to("meta"), ValueError,
                         "cache.ssm_state: on meta, but the layer is on cpu"),
}


@pytest.mark.parametrize("case", list(CACHE_ERRORS))
def test_bad_cache_is_a_clear_error(case):
    field, make, error, message = CACHE_ERRORS[case]
    mixer = Mamba2Mixer(CONFIG, seed=0)
    with pytest.raises(error, match=message):
        mixer.step(tokens(CONFIG, 2, 1, 0), bad_cache(field, make=make))


def test_bad_step_and_prefill_arguments_are_clear_errors():
    mixer = Mamba2Mixer(CONFIG, seed=0)
    cache = mixer.new_cache(2)
    with pytest.raises(ValueError, match=r"u_t: expected a \(batch, 1, d_model=32\) tensor, "
                                         r"got \(2, 2, 32\)"):
        mixer.step(tokens(CONFIG, 2, 2, 0), cache)
    with pytest.raises(ValueError, match=r"cache.conv_state: expected shape \(batch=3"):
        mixer.step(tokens(CONFIG, 3, 1, 0), cache)
    with pytest.raises(TypeError, match="u_t: dtype torch.float32"):
        mixer.step(tokens(CONFIG, 2, 1, 0).float(), cache)
    u = tokens(CONFIG, 1, 10, 0)
    cases = [
        (dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens: dtype torch.float32"),
        (dict(cu_seqlens=torch.tensor([[0, 10]])), ValueError, r"cu_seqlens: expected shape "
                                                                r"\(num_sequences \+ 1,\)"),
        (dict(cu_seqlens=torch.tensor([10])), ValueError, "cu_seqlens: expected shape"),
        (dict(cu_seqlens=[0, 10]), TypeError, "cu_seqlens: expected a torch.Tensor"),
        (dict(cu_seqlens=torch.tensor([0, 4, 9]), check_values=True), ValueError,
         "cu_seqlens: the last offset must be the sequence length l = 10"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            mixer.prefill(u, **kwargs)
    with pytest.raises(ValueError, match="cu_seqlens: packs the prompts along one row, so u's "
                                         "batch must be 1, got 2"):
        mixer.prefill(tokens(CONFIG, 2, 10, 0), torch.tensor([0, 4, 10]))


def test_stack_checks_every_cache_before_changing_any():
    stack = Mamba2Stack(CONFIG, 2, seed=0)
    u_t = tokens(CONFIG, 2, 1, 0)
    caches = stack.new_cache(2)
    with pytest.raises(ValueError, match="caches: expected a list of 2 InferenceCache"):
        stack.step(u_t, caches[:1])
    with pytest.raises(TypeError, match="caches\\[1\\]: expected an InferenceCache"):
        stack.step(u_t, [caches[0], None])
    good = stack.new_cache(2)
    broken = [good[0], replace(good[1], ssm_state=good[1].ssm_state[:, :1])]
    with pytest.raises(ValueError, match=r"caches\[1\].ssm_state: expected shape"):
        stack.step(u_t, broken)
    assert not good[0].conv_state.any() and not good[0].ssm_state.any()  # layer 0 untouched


def test_step_function_names_and_availability(monkeypatch):
    assert step_function("torch") is selective_state_update_torch
    assert step_function("reference") is selective_state_update_reference_torch
    with pytest.raises(ValueError, match="backend: unknown SSD backend 'triton'"):
        step_function("triton")
    monkeypatch.setattr(ssd.layer, "_cuda_missing", lambda: "no CUDA GPU (stand-in)")
    with pytest.raises(BackendUnavailable, match="'cutile' is unavailable: no CUDA GPU"):
        step_function("cutile")
