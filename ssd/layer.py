"""A Mamba-2 mixer (and a stack of them) in PyTorch, with the SSD step behind a backend switch.

The layer of Dao & Gu 2024 ("Transformers are SSMs", section 7, the Mamba-2 block), forward
only, with random weights initialised as Mamba-2 initialises them (no downloads)::

    u (b, l, d_model)
      -> in_proj                      -> z (d_inner) | xBC (d_inner + 2 g n) | dt (h)
      -> xBC: depthwise causal conv1d (kernel d_conv) + SiLU
      -> split xBC                    -> x (b, l, h, p), B (b, l, g, n), C (b, l, g, n)
      -> SSD(x, dt, A = -exp(A_log), B, C, D, dt_bias, dt_softplus=True)  -> y (b, l, h, p)
      -> gated RMSNorm, per group     -> norm(y * silu(z)) * weight
      -> out_proj                     -> (b, l, d_model)

The SSD step is the one operation the rest of the book is about; :class:`SSDStep` runs it with
one of four backends:

=============  ===================================================  ===========================
backend        what                                                  where
=============  ===================================================  ===========================
``cutile``     ``ssd.api.mamba_chunk_scan_combined`` (our kernels)   CUDA + cuda-tile
``mamba_ssm``  mamba_ssm's Triton forward (``ssd.tools.peers``)            CUDA + mamba_ssm + triton
``torch``      :func:`ssd_torch`, the chunked algorithm in plain      any device; fp32 compute
               PyTorch (fp64 for fp64 inputs)                        (fp64 for fp64 inputs)
``reference``  ``ssd.reference.ssd_chunked`` in NumPy float64        CPU copy, slow (tests)
=============  ===================================================  ===========================

The conv and the norm around it run either in plain PyTorch (``kernels="torch"``, the
default: ``nn.Conv1d`` over transposed xBC, the norm in fp32 eager ops) or as the cuTile kernels
of :mod:`ssd.layer_ops` (``kernels="cutile"``: xBC and z read where in_proj wrote them, no
transposes and no copies; CUDA only). :data:`KERNELS` names the two.

Dimension legend as everywhere in ``ssd`` (see ``ssd.reference``): b batch, l seqlen, h
nheads, p headdim, n dstate (the paper's N), g ngroups (B and C shared by h/g heads), q
chunk_size. Mamba-2's own names: d_inner = expand * d_model = h * p; conv_dim = d_inner + 2 g n.

Numerics follow mamba_ssm's ``Mamba2`` module: A_log, dt_bias and D stay in fp32 whatever the
model dtype (fp64 for an fp64 model), the gated RMSNorm and the stack's residual stream are
computed in fp32, the SSD output has x's dtype.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .reference import check_shapes

INF = float("inf")
BACKENDS = ("cutile", "mamba_ssm", "torch", "reference")
KERNELS = ("torch", "cutile")  # the conv and norm around the SSD
DTYPES = ("float32", "float64", "bfloat16", "float16")

# Mamba-2's initialisation ranges (mamba_ssm ``Mamba2.__init__`` defaults).
A_INIT_RANGE = (1.0, 16.0)  # A = -U(1, 16): per-step decays exp(dt A) in [e^-1.6, e^-0.001]
DT_MIN, DT_MAX, DT_INIT_FLOOR = 1e-3, 1e-1, 1e-4  # dt' = softplus(dt_bias) log-uniform in here
NORM_EPS = 1e-5


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Mamba2Config:
    """The sizes of one Mamba-2 mixer.

    Args:
        d_model: width of the residual stream.
        d_state: n, the SSM state size per head channel.
        d_conv: kernel size of the depthwise causal convolution over xBC.
        expand: d_inner = expand * d_model.
        headdim: p; nheads h = d_inner / p.
        ngroups: g; B and C (and the gated RMSNorm) are shared by h/g heads per group.
        chunk_size: q of the chunked SSD algorithm (the cuTile kernels take 16..256).
        dtype: name of the model dtype ("bfloat16", "float16", "float32", "float64").
    """

    d_model: int
    d_state: int
    d_conv: int = 4
    expand: int = 2
    headdim: int = 64
    ngroups: int = 1
    chunk_size: int = 256
    dtype: str = "bfloat16"

    def __post_init__(self):
        if isinstance(self.dtype, torch.dtype):  # accept torch.bfloat16 as well as "bfloat16"
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {DTYPES}, got {self.dtype!r}")
        for name in ("d_model", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.d_inner % self.headdim:
            raise ValueError(f"headdim: d_inner = expand * d_model = {self.d_inner} is not a "
                             f"multiple of headdim {self.headdim}")
        if self.nheads % self.ngroups:
            raise ValueError(f"ngroups: nheads {self.nheads} is not a multiple of ngroups "
                             f"{self.ngroups}")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def nheads(self) -> int:
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:
        """Channels of xBC, the convolved part: x (d_inner), B and C (g n each)."""
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:
        """Output width of in_proj: z, xBC and dt."""
        return self.d_inner + self.conv_dim + self.nheads

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def ssd_dims(self, batch: int, seqlen: int) -> tuple:
        """(b, l, h, p, n, g): the SSD problem this mixer solves on a (batch, seqlen) input,
        in the order of ``ssd.tools.bench.Shape.dims``."""
        return (batch, seqlen, self.nheads, self.headdim, self.d_state, self.ngroups)

    def params_per_layer(self) -> int:
        """Number of weights of one mixer (in_proj, conv, A_log, dt_bias, D, norm, out_proj)."""
        return (self.d_model * self.d_in_proj + self.conv_dim * (self.d_conv + 1)
                + 3 * self.nheads + self.d_inner + self.d_inner * self.d_model)


#: The three model sizes of the benchmark suite ``ssd.tools.bench.SUITES["models"]``: same h, p, n, g.
PRESETS = {
    "130m": Mamba2Config(d_model=768, d_state=128),            # 24 heads
    "2.7b": Mamba2Config(d_model=2560, d_state=128),           # 80 heads
    "codestral-7b": Mamba2Config(d_model=4096, d_state=128, ngroups=8),  # 128 heads
}
#: Number of layers of the published models of those sizes (mamba2-130m, mamba2-2.7b,
#: Mamba-Codestral-7B), for a stack of realistic depth.
PRESET_LAYERS = {"130m": 24, "2.7b": 64, "codestral-7b": 64}


def preset(name: str, **overrides) -> Mamba2Config:
    """A preset configuration, with fields replaced: ``preset("2.7b", dtype="float32")``."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown name {name!r}; expected one of {list(PRESETS)}")
    return replace(PRESETS[name], **overrides)


def config_for_shape(shape, *, expand=2, d_conv=4, chunk_size=256,
                     dtype="bfloat16") -> Mamba2Config:
    """The mixer whose SSD step has the heads, headdim, state and groups of an
    ``ssd.tools.bench.Shape`` (d_model = h p / expand)."""
    b, l, h, p, n, g = shape.dims
    if (h * p) % expand:
        raise ValueError(f"expand: h * p = {h * p} is not a multiple of expand {expand}")
    return Mamba2Config(d_model=h * p // expand, d_state=n, d_conv=d_conv, expand=expand,
                        headdim=p, ngroups=g, chunk_size=chunk_size, dtype=dtype)


# ----------------------------------------------------------------------------- SSD in PyTorch


def ssd_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
              dt_softplus=False, dt_limit=(0.0, INF), return_final_states=False):
    """The chunked SSD forward in plain PyTorch: ``ssd.reference.ssd_chunked``'s four stages,
    vectorised over chunks and heads (only state_passing loops, over chunks).

    Same arguments and semantics as ``mamba_chunk_scan_combined`` (no seq_idx). Works on any
    device; computes in fp32, or fp64 when x is fp64. l need not be a multiple of chunk_size.

    Args:
        x: (b, l, h, p); dt: (b, l, h); A: (h,) <= 0; B, C: (b, l, g, n) with h % g == 0.
        D: optional (h,) or (h, p); z: optional (b, l, h, p); dt_bias: optional (h,);
        initial_states: optional (b, h, p, n).
    Returns:
        y (b, l, h, p) in x's dtype, or (y, final_states (b, h, p, n) in the compute dtype).
    """
    dims = check_shapes(chunk_size=chunk_size, **{
        k: None if t is None else tuple(t.shape)
        for k, t in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                         initial_states=initial_states).items()})
    b, l, h, p, n, g, c, q = (dims[k] for k in "blhpngcq")
    r = h // g  # heads per group: head i = (group i // r, member i % r)
    lo, hi = (float(v) for v in dt_limit)
    f = torch.float64 if x.dtype == torch.float64 else torch.float32

    def chunked(t):  # (b, l, ...) -> (b, c, q, ...), the tail chunk zero-padded
        t = t.to(f)
        return F.pad(t, [0, 0] * (t.dim() - 2) + [0, c * q - l]).view(b, c, q, *t.shape[2:])

    # 1. chunk_cumsum: dt' = clamp(softplus(dt + bias)); log-decay summed inside each chunk.
    #    The padded tail has dt' = 0, so dA_cumsum stays flat there.
    dtp = dt.to(f) + (0 if dt_bias is None else dt_bias.to(f))
    if dt_softplus:
        dtp = torch.where(dtp <= 20.0, F.softplus(dtp), dtp)  # identity above 20, as mamba_ssm
    dtp = dtp.clamp(min=lo, max=hi)
    dt_c = chunked(dtp).view(b, c, q, g, r)  # (b, c, q, g, r)
    x_c = chunked(x).view(b, c, q, g, r, p)  # (b, c, q, g, r, p)
    B_c, C_c = chunked(B), chunked(C)  # (b, c, q, g, n): read per group, never per head
    dA_cs = torch.cumsum(dt_c * A.to(f).view(g, r), dim=2)  # (b, c, q, g, r)

    # 2. chunk_state: what each chunk writes into the state on its own. The exponent
    #    dA_cs[last] - dA_cs[s] is <= 0 (A <= 0, dt' >= 0), so exp cannot overflow.
    weight = torch.exp(dA_cs[:, :, -1:] - dA_cs) * dt_c  # (b, c, q, g, r)
    states = torch.einsum("bcsgr,bcsgrp,bcsgn->bcgrpn", weight, x_c, B_c)  # (b, c, g, r, p, n)

    # 3. state_passing: the state entering each chunk (the only sequential step).
    chunk_decay = torch.exp(dA_cs[:, :, -1])  # (b, c, g, r)
    running = (torch.zeros(b, g, r, p, n, dtype=f, device=x.device) if initial_states is None
               else initial_states.to(f).reshape(b, g, r, p, n))
    prev = []
    for ci in range(c):
        prev.append(running)
        running = chunk_decay[:, ci, :, :, None, None] * running + states[:, ci]
    prev_states = torch.stack(prev, dim=1)  # (b, c, g, r, p, n)

    # 4. chunk_scan. Diagonal blocks: causal attention inside the chunk with the decay mask;
    #    the exponent dA_cs[t] - dA_cs[s] is >= 0 above the diagonal, so mask it to -inf
    #    BEFORE exp (masking after exp could meet inf * 0 = NaN).
    seg = dA_cs.permute(0, 1, 3, 4, 2)  # (b, c, g, r, q)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()  # (t, s): s <= t
    L = torch.exp((seg[..., :, None] - seg[..., None, :]).masked_fill(~causal, -INF))
    CB = torch.einsum("bctgn,bcsgn->bcgts", C_c, B_c)  # (b, c, g, t, s), once per group
    W = CB[:, :, :, None] * L * dt_c.permute(0, 1, 3, 4, 2)[..., None, :]  # (b, c, g, r, t, s)
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", W, x_c)  # (b, c, q, g, r, p)
    # Off-diagonal term: the entering state decayed to t and read by C_t.
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", C_c, prev_states) * torch.exp(dA_cs)[..., None]
    y = y.reshape(b, c * q, h, p)[:, :l]  # un-chunk, drop the padded tail
    if D is not None:
        y = y + (D.to(f)[:, None] if D.dim() == 1 else D.to(f)) * x.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    y = y.to(x.dtype)
    return (y, running.reshape(b, h, p, n)) if return_final_states else y


def ssd_reference_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                        initial_states=None, dt_softplus=False, dt_limit=(0.0, INF),
                        return_final_states=False):
    """``ssd.reference.ssd_chunked`` (NumPy, float64) behind torch tensors: the inputs are
    copied to the CPU as float64; y comes back in x's dtype on x's device."""
    from .reference import ssd_chunked

    def np64(t):
        return None if t is None else t.detach().to("cpu", torch.float64).numpy()

    out = ssd_chunked(np64(x), np64(dt), np64(A), np64(B), np64(C), chunk_size, D=np64(D),
                      z=np64(z), dt_bias=np64(dt_bias), initial_states=np64(initial_states),
                      dt_softplus=dt_softplus, dt_limit=dt_limit,
                      return_final_states=return_final_states)
    back = lambda a, dtype: torch.from_numpy(a).to(x.device, dtype)  # noqa: E731
    if return_final_states:
        return back(out[0], x.dtype), back(out[1], torch.float64)
    return back(out, x.dtype)


# ----------------------------------------------------------------------------- backends


class BackendUnavailable(RuntimeError):
    """An SSD backend cannot run here; the message names the backend and says why."""


def _cuda_missing() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    return None


def backend_function(name: str):
    """The SSD forward of backend ``name``, with ``mamba_chunk_scan_combined``'s signature.

    Raises:
        ValueError: ``name`` is not one of :data:`BACKENDS`.
        BackendUnavailable: the backend exists but cannot run on this machine (no GPU, a
            package missing); the message says which and how to get it.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend: unknown SSD backend {name!r}; expected one of {BACKENDS}")
    if name == "torch":
        return ssd_torch
    if name == "reference":
        return ssd_reference_torch
    why = _cuda_missing()
    if why:
        raise BackendUnavailable(f"SSD backend {name!r} is unavailable: {why}; it runs on NVIDIA "
                                 "GPUs only. Use backend='torch' (any device) instead.")
    if name == "cutile":
        try:
            found = importlib.util.find_spec("cuda.tile") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise BackendUnavailable("SSD backend 'cutile' is unavailable: cuda-tile is not "
                                     "installed (`pip install -e '.[gpu]'`; then "
                                     "`python -m ssd doctor`)")
        try:
            from .api import mamba_chunk_scan_combined
        except Exception as exc:
            raise BackendUnavailable(f"SSD backend 'cutile' is unavailable: ssd.api failed to "
                                     f"import ({type(exc).__name__}: {exc})") from exc
        return mamba_chunk_scan_combined
    from .tools.peers import PeerUnavailable, mamba_ssm_forward

    try:
        return mamba_ssm_forward()
    except PeerUnavailable as exc:
        raise BackendUnavailable(f"SSD backend 'mamba_ssm' is unavailable: {exc}") from exc


def available_backends() -> dict:
    """backend name -> None if it can run here, else the reason it cannot."""
    out = {}
    for name in BACKENDS:
        try:
            backend_function(name)
            out[name] = None
        except BackendUnavailable as exc:
            out[name] = str(exc)
    return out


def kernel_ops(name: str):
    """The conv and norm of a mixer with ``kernels=name``: None for "torch" (the PyTorch path of
    :func:`causal_conv1d_torch` and :class:`GatedRMSNorm`), the module :mod:`ssd.layer_ops` for
    "cutile" (its ``causal_conv1d`` and ``gated_rmsnorm``).

    Raises:
        ValueError: ``name`` is not one of :data:`KERNELS`.
        BackendUnavailable: "cutile" cannot run here (no GPU, cuda-tile missing).
    """
    if name not in KERNELS:
        raise ValueError(f"kernels: unknown layer kernels {name!r}; expected one of {KERNELS}")
    if name == "torch":
        return None
    why = _cuda_missing()
    if why is None:
        try:
            from . import layer_ops
            return layer_ops
        except Exception as exc:  # cuda-tile missing or broken
            why = f"ssd.layer_ops failed to import ({type(exc).__name__}: {exc})"
    raise BackendUnavailable(f"layer kernels 'cutile' are unavailable: {why}; use "
                             "kernels='torch' (any device) instead")


class SSDStep(nn.Module):
    """The SSD call of the mixer as a module of its own, so that a forward hook sees exactly
    the tensors the mixer passes (``ssd.tools.endtoend`` times the call alone on them).

    ``forward(x, dt, A, B, C, D, dt_bias)`` -> y (b, l, h, p), always with dt_softplus=True
    and the layer's dt_limit, as Mamba-2 calls it.
    """

    def __init__(self, backend: str, chunk_size: int, dt_limit=(0.0, INF)):
        super().__init__()
        self.chunk_size = chunk_size
        self.dt_limit = tuple(dt_limit)
        self.set_backend(backend)

    def set_backend(self, backend: str, chunk_size: int | None = None):
        """Switch the SSD implementation; ``chunk_size`` also changes the chunk size it is
        called with (None keeps it): the output does not depend on it beyond rounding, the
        speed does, and not the same way for every backend."""
        self.fn = backend_function(backend)  # raises before anything changes
        self.backend = backend
        if chunk_size is not None:
            self.chunk_size = int(chunk_size)

    def extra_repr(self):
        return f"backend={self.backend!r}, chunk_size={self.chunk_size}"

    def forward(self, x, dt, A, B, C, D, dt_bias):
        if self.backend in ("cutile", "mamba_ssm") and x.device.type != "cuda":
            raise BackendUnavailable(f"SSD backend {self.backend!r} runs on CUDA tensors only, but "
                                     f"the input is on {x.device}; move the module to a GPU or use "
                                     "backend='torch'")
        return self.fn(x, dt, A, B, C, self.chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True,
                       dt_limit=self.dt_limit)


@contextlib.contextmanager
def ssd_replaced(module: nn.Module, fn):
    """Inside the block every :class:`SSDStep` in ``module`` calls ``fn`` (same signature as
    ``mamba_chunk_scan_combined``) instead of its backend; e.g. a stub that returns
    ``torch.empty_like(x)`` times the layer without its SSD."""
    steps = [m for m in module.modules() if isinstance(m, SSDStep)]
    saved = [s.fn for s in steps]
    try:
        for s in steps:
            s.fn = fn
        yield module
    finally:
        for s, old in zip(steps, saved):
            s.fn = old


def capture_ssd_calls(module: nn.Module, u, limit: int | None = None):
    """Run ``module(u)`` once and return (output, calls): ``calls`` holds, for every
    :class:`SSDStep` call in order (the first ``limit`` only, if given), the positional
    arguments it received, ``(x, dt, A, B, C, D, dt_bias)``, so that ``step(*args)`` repeats
    that SSD call alone on the very tensors the layer produced (same values, shapes and
    strides). Captured tensors stay alive: in a deep stack keep ``limit`` small."""
    calls = []

    def hook(mod, args, out):
        if limit is None or len(calls) < limit:
            calls.append(tuple(args))

    hooks = [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, SSDStep)]
    try:
        out = module(u)
    finally:
        for hook in hooks:
            hook.remove()
    return out, calls


# ----------------------------------------------------------------------------- the mixer


def _uniform(gen, shape, lo, hi, device, dtype):
    """U(lo, hi) drawn in fp32 on ``device`` then cast: the same seed gives the same weights
    (up to rounding) for every dtype on one device type."""
    t = torch.empty(shape, device=device, dtype=torch.float32).uniform_(lo, hi, generator=gen)
    return nn.Parameter(t.to(dtype), requires_grad=False)


def _param_dtype(dtype: torch.dtype) -> torch.dtype:
    """A_log, dt_bias, D, norm weights: fp32 (fp64 in an fp64 model), as mamba_ssm keeps A."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def causal_conv1d_torch(xBC, conv1d: nn.Conv1d):
    """The layer's depthwise causal conv1d + SiLU in plain PyTorch (``kernels="torch"``).

    xBC (b, l, conv_dim), any strides -> (b, l, conv_dim) contiguous. ``conv1d`` is depthwise
    with padding k-1 on both sides: its first l outputs are the causal convolution."""
    l = xBC.shape[1]
    # Channels first for conv1d, keep the first l outputs, back to channels last and
    # contiguous, so that the SSD gets x, B, C with unit stride along p and n (a backend would
    # otherwise copy them inside the timed SSD call).
    out = conv1d(xBC.transpose(1, 2))[..., :l]  # (b, conv_dim, l)
    return F.silu(out.transpose(1, 2).contiguous())  # (b, l, conv_dim)


class GatedRMSNorm(nn.Module):
    """Mamba-2's gated RMSNorm, gate before the norm and per group of ``group_size`` channels:
    ``out = rmsnorm_g(y * silu(z)) * weight``, computed in fp32 (fp64), returned in y's dtype."""

    def __init__(self, d: int, group_size: int, eps=NORM_EPS, device=None, dtype=torch.float32):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype), requires_grad=False)

    def forward(self, y, z):
        f = _param_dtype(y.dtype)
        v = y.to(f) * F.silu(z.to(f))  # (..., d)
        v = v.unflatten(-1, (-1, self.group_size))  # (..., groups, group_size)
        v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return (v.flatten(-2) * self.weight.to(f)).to(y.dtype)


class RMSNorm(nn.Module):
    """Plain RMSNorm (the stack's pre-norm), computed in fp32 (fp64); output in ``out_dtype``."""

    def __init__(self, d: int, eps=NORM_EPS, device=None, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype), requires_grad=False)

    def forward(self, h, out_dtype=None):
        f = _param_dtype(h.dtype if out_dtype is None else out_dtype)
        v = h.to(f)
        v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + self.eps)
        return (v * self.weight.to(f)).to(out_dtype or h.dtype)


def _check_input(u, cfg: Mamba2Config, device):
    if not isinstance(u, torch.Tensor) or u.dim() != 3 or u.shape[-1] != cfg.d_model:
        raise ValueError(f"u: expected a (batch, seqlen, d_model={cfg.d_model}) tensor, got "
                         f"{tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
    if u.dtype != cfg.torch_dtype:
        raise TypeError(f"u: dtype {u.dtype}, but the layer's weights are {cfg.dtype}")
    if u.device != device:
        raise ValueError(f"u: on {u.device}, but the layer's weights are on {device}")


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer with random weights, forward only.

    Args:
        config: the sizes (:class:`Mamba2Config`); the weights take ``config.dtype``.
        backend: the SSD step, one of :data:`BACKENDS`; change it later with
            :meth:`set_backend` (the weights stay).
        kernels: the conv and norm around the SSD, one of :data:`KERNELS` ("torch": plain
            PyTorch; "cutile": :mod:`ssd.layer_ops`, CUDA only); change it with
            :meth:`set_kernels`.
        device: where the weights live (default: the CPU).
        seed: seeds the initialisation when ``generator`` is not given.
        generator: a torch.Generator on ``device`` (a stack passes one through its layers).
        out_scale: multiplies the out_proj weights (a stack uses 1/sqrt(n_layers), as
            mamba_ssm's ``rescale_prenorm_residual``).

    Initialisation (mamba_ssm's Mamba2 and nn.Linear / nn.Conv1d defaults):
    in_proj, out_proj ~ U(+-1/sqrt(fan_in)), no bias; conv weight and bias ~ U(+-1/sqrt(d_conv));
    A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] (floor
    1e-4); D = 1; norm weight = 1.

    ``forward(u)``: u (b, l, d_model) -> (b, l, d_model), both in config.dtype.
    """

    def __init__(self, config: Mamba2Config, backend: str = "torch", *, kernels: str = "torch",
                 device=None, seed: int = 0, generator: torch.Generator | None = None,
                 out_scale: float = 1.0):
        super().__init__()
        self.config = cfg = config
        self.set_kernels(kernels)
        device = torch.device(device or "cpu")
        dtype, pdtype = cfg.torch_dtype, _param_dtype(cfg.torch_dtype)
        gen = generator or torch.Generator(device=device).manual_seed(seed)
        h, k = cfg.nheads, cfg.d_conv

        def linear(fan_in, fan_out, scale=1.0):
            lin = nn.Linear(fan_in, fan_out, bias=False, device="meta")
            bound = 1.0 / math.sqrt(fan_in)
            lin.weight = _uniform(gen, (fan_out, fan_in), -bound, bound, device, dtype)
            if scale != 1.0:
                lin.weight.data.mul_(scale)
            return lin

        self.in_proj = linear(cfg.d_model, cfg.d_in_proj)  # -> [z | xBC | dt]
        # Depthwise (one filter per channel), causal: pad k-1 on the left, i.e. pad both sides
        # and keep the first l outputs.
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, k, groups=cfg.conv_dim, padding=k - 1,
                                device="meta")
        bound = k ** -0.5  # fan_in of a depthwise filter is k
        self.conv1d.weight = _uniform(gen, (cfg.conv_dim, 1, k), -bound, bound, device, dtype)
        self.conv1d.bias = _uniform(gen, (cfg.conv_dim,), -bound, bound, device, dtype)
        # dt' = softplus(dt + dt_bias): with dt = 0 the step is the sampled target, hence the
        # bias is its inverse softplus, log(expm1(dt)) = dt + log(1 - exp(-dt)) (stable form).
        u = torch.empty(h, device=device).uniform_(generator=gen)
        dt0 = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
        dt0 = dt0.clamp(min=DT_INIT_FLOOR).to(pdtype)
        self.dt_bias = nn.Parameter(dt0 + torch.log(-torch.expm1(-dt0)), requires_grad=False)
        A = torch.empty(h, device=device).uniform_(*A_INIT_RANGE, generator=gen)
        self.A_log = nn.Parameter(torch.log(A).to(pdtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(h, device=device, dtype=pdtype), requires_grad=False)
        self.ssd = SSDStep(backend, cfg.chunk_size)
        self.norm = GatedRMSNorm(cfg.d_inner, cfg.d_inner // cfg.ngroups, device=device,
                                 dtype=pdtype)
        self.out_proj = linear(cfg.d_inner, cfg.d_model, scale=out_scale)

    @property
    def backend(self) -> str:
        return self.ssd.backend

    def set_backend(self, backend: str, chunk_size: int | None = None) -> "Mamba2Mixer":
        self.ssd.set_backend(backend, chunk_size)
        return self

    def set_kernels(self, kernels: str) -> "Mamba2Mixer":
        """Switch the conv and norm between plain PyTorch and cuTile (:data:`KERNELS`)."""
        ops = kernel_ops(kernels)  # raises before anything changes
        if ops is not None and self.config.d_conv > ops.MAX_WIDTH:
            raise ValueError(f"kernels: the cuTile conv takes d_conv <= {ops.MAX_WIDTH}, this "
                             f"layer's is {self.config.d_conv}")
        self.kernels, self._ops = kernels, ops
        return self

    @torch.no_grad()
    def forward(self, u):
        cfg = self.config
        _check_input(u, cfg, self.in_proj.weight.device)
        b, l, _ = u.shape
        h, p, g, n = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
        zxbcdt = self.in_proj(u)  # (b, l, d_in_proj)
        z, xBC, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, h], dim=-1)  # views
        # Depthwise causal conv over time + SiLU -> one contiguous (b, l, conv_dim) buffer.
        if self._ops is None:
            xBC = causal_conv1d_torch(xBC, self.conv1d)
        else:  # reads the xBC columns of zxbcdt in place
            xBC = self._ops.causal_conv1d(xBC, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = torch.split(xBC, [cfg.d_inner, g * n, g * n], dim=-1)
        A = -torch.exp(self.A_log)  # (h,), < 0
        y = self.ssd(x.unflatten(-1, (h, p)),  # (b, l, h, p)
                     dt,  # (b, l, h), raw: the SSD adds dt_bias and applies softplus
                     A, B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),  # (b, l, g, n)
                     self.D, self.dt_bias)  # y: (b, l, h, p)
        if self._ops is None:
            y = self.norm(y.flatten(-2), z)  # (b, l, d_inner)
        else:  # z: the z columns of zxbcdt, read in place
            y = self._ops.gated_rmsnorm(y.flatten(-2), z, self.norm.weight, self.norm.group_size,
                                        self.norm.eps)
        return self.out_proj(y)  # (b, l, d_model)


class Mamba2Stack(nn.Module):
    """``n_layers`` mixers with pre-norm RMSNorm and residuals, and a final norm: the Mamba-2
    backbone for prefill (no embedding, no LM head, no MLP, as the published Mamba-2 models).

    Per layer ``residual = residual + mixer(norm(residual))``, with the residual stream in fp32
    (mamba_ssm's ``residual_in_fp32``) and the mixer's input cast to config.dtype; the result
    is ``norm_f(residual)`` in config.dtype. Layer i's weights come from one generator seeded
    with ``seed`` and used in layer order; out_proj is scaled by 1/sqrt(n_layers). ``backend``
    and ``kernels`` as :class:`Mamba2Mixer`'s, for every layer.

    ``forward(u)``: u (b, l, d_model) -> hidden states (b, l, d_model).
    """

    def __init__(self, config: Mamba2Config, n_layers: int, backend: str = "torch", *,
                 kernels: str = "torch", device=None, seed: int = 0):
        super().__init__()
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers: expected a positive int, got {n_layers!r}")
        self.config = config
        device = torch.device(device or "cpu")
        gen = torch.Generator(device=device).manual_seed(seed)
        pdtype = _param_dtype(config.torch_dtype)
        self.norms = nn.ModuleList(RMSNorm(config.d_model, device=device, dtype=pdtype)
                                   for _ in range(n_layers))
        self.mixers = nn.ModuleList(
            Mamba2Mixer(config, backend, kernels=kernels, device=device, generator=gen,
                        out_scale=1.0 / math.sqrt(n_layers)) for _ in range(n_layers))
        self.norm_f = RMSNorm(config.d_model, device=device, dtype=pdtype)

    @property
    def backend(self) -> str:
        return self.mixers[0].backend

    def set_backend(self, backend: str, chunk_size: int | None = None) -> "Mamba2Stack":
        backend_function(backend)  # fail before changing any layer
        for m in self.mixers:
            m.set_backend(backend, chunk_size)
        return self

    def set_kernels(self, kernels: str) -> "Mamba2Stack":
        self.mixers[0].set_kernels(kernels)  # fail before changing the others
        for m in self.mixers[1:]:
            m.set_kernels(kernels)
        return self

    @torch.no_grad()
    def forward(self, u):
        _check_input(u, self.config, self.norm_f.weight.device)
        dtype = self.config.torch_dtype
        residual = u.to(_param_dtype(dtype))  # (b, l, d_model), fp32 (fp64)
        for norm, mixer in zip(self.norms, self.mixers):
            residual = residual + mixer(norm(residual, out_dtype=dtype)).to(residual.dtype)
        return self.norm_f(residual, out_dtype=dtype)


__all__ = ["Mamba2Config", "PRESETS", "PRESET_LAYERS", "preset", "config_for_shape", "ssd_torch",
           "ssd_reference_torch", "BACKENDS", "KERNELS", "BackendUnavailable", "backend_function",
           "available_backends", "kernel_ops", "SSDStep", "ssd_replaced", "capture_ssd_calls",
           "causal_conv1d_torch", "GatedRMSNorm", "RMSNorm", "Mamba2Mixer", "Mamba2Stack"]
