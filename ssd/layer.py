"""A Mamba-2 mixer (and a stack of them) in PyTorch, with the SSD step behind a backend switch.

The layer of Dao & Gu 2024 ("Transformers are SSMs", section 7, the Mamba-2 block), with random
weights initialised as Mamba-2 initialises them (no downloads)::

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
``mamba_ssm``  mamba_ssm's Triton SSD, ``ssd.mamba_ssm_loader``     CUDA + mamba_ssm + triton
``torch``      :func:`ssd_torch`, the chunked algorithm in plain      any device; fp32 compute
               PyTorch (fp64 for fp64 inputs)                        (fp64 for fp64 inputs)
``reference``  ``ssd.reference.ssd_chunked`` in NumPy float64        CPU copy, slow (tests)
=============  ===================================================  ===========================

The conv and the norm around it run either in plain PyTorch (``kernels="torch"``, the
default: ``nn.Conv1d`` over transposed xBC, the norm in fp32 eager ops) or as the cuTile kernels
of :mod:`ssd.layer_ops` (``kernels="cutile"``: xBC and z read where in_proj wrote them, no
transposes and no copies; CUDA only). :data:`KERNELS` names the two.

Generation: :meth:`Mamba2Mixer.prefill` runs the forward over a batch of prompts, or prompts of
different lengths packed along one row (mamba_ssm's ``cu_seqlens``; the conv and the SSD restart
at each prompt), and hands each prompt's state to an :class:`InferenceCache`: its last d_conv - 1
conv inputs and its final SSM state (the SSD's ``return_final_states``, or
``return_varlen_states`` when packed). :meth:`Mamba2Mixer.step` then takes one token per
sequence, (b, 1, d_model), and advances the cache in place::

    u_t -> in_proj -> z | xBC | dt
        -> conv step: roll the conv state, depthwise dot + bias + SiLU     (conv_step)
        -> SSM step: h <- exp(dt' A) h + dt' x Bᵀ, y = h C + D x            (the backend's)
        -> gated RMSNorm -> out_proj

The SSM step is the backend's decode function (:func:`step_function`):
``ssd.selective_state_update`` (cutile), mamba_ssm's ``selective_state_update`` (mamba_ssm),
:func:`selective_state_update_torch` (torch), the float64 NumPy step (reference). The conv step
is :func:`conv_step_torch`, or ``ssd.layer_ops.conv_step`` (one cuTile kernel) with
``kernels="cutile"``; the gated RMSNorm's kernel takes the step's (b, d_inner) rows as it takes
the forward's.
:class:`Mamba2Stack` has the same ``prefill`` / ``step`` / ``new_cache`` with one cache a layer.

Dimension legend as everywhere in ``ssd`` (see ``ssd.reference``): b batch, l seqlen, h
nheads, p headdim, n dstate (the paper's N), g ngroups (B and C shared by h/g heads), q
chunk_size. Mamba-2's own names: d_inner = expand * d_model = h * p; conv_dim = d_inner + 2 g n.

Training: the weights are made frozen (``requires_grad=False``), so an inference forward builds
no autograd graph; ``module.requires_grad_()`` makes them trainable, and ``forward`` is then
differentiable wherever the SSD backend is (``torch``; ``mamba_ssm``, whose Triton SSD is an
autograd Function; ``cutile`` where ``ssd.mamba_chunk_scan_combined`` is), with either
``kernels``: the cuTile conv and norm run inside autograd Functions whose backward is PyTorch
(:mod:`ssd.layer_autograd`). ``reference`` (a NumPy copy) has no backward and raises
NotImplementedError when a gradient is required. ``prefill`` and ``step`` never record one
(generation). ``ssd.tools.train`` trains a language model on this stack.

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

from .layer_reference import conv_step_torch
from .reference import check_cu_seqlens, check_shapes, check_step_shapes, check_varlen_shapes

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
              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, INF),
              return_final_states=False, return_varlen_states=False):
    """The chunked SSD forward in plain PyTorch: ``ssd.reference.ssd_chunked``'s four stages,
    vectorised over chunks and heads (only state_passing loops, over chunks).

    Same arguments, semantics and return convention as ``mamba_chunk_scan_combined``, packed
    sequences included. Works on any device; computes in fp32, or fp64 when x is fp64. l need
    not be a multiple of chunk_size. seq_idx's values are not checked (>= 0, non-decreasing);
    cu_seqlens' are, on the host (a device synchronisation on a GPU).

    Args:
        x: (b, l, h, p); dt: (b, l, h); A: (h,) <= 0; B, C: (b, l, g, n) with h % g == 0.
        D: optional (h,) or (h, p); z: optional (b, l, h, p); dt_bias: optional (h,);
        initial_states: optional (b, h, p, n).
        seq_idx: optional (b, l) int: packed sequences, the state reset where it changes.
        cu_seqlens: (S + 1,) int offsets of S sequences packed along a batch of one (with
            seq_idx); read only with return_varlen_states.
    Returns:
        y (b, l, h, p) in x's dtype; with return_final_states also final_states (b, h, p, n),
        with return_varlen_states also varlen_states (S, h, p, n), both in the compute dtype.
    """
    dims = check_shapes(chunk_size=chunk_size, **{
        k: None if t is None else tuple(t.shape)
        for k, t in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                         initial_states=initial_states, seq_idx=seq_idx).items()})
    b, l, h, p, n, g, c, q = (dims[k] for k in "blhpngcq")
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states: needs cu_seqlens, the offsets of the "
                             "packed sequences")
        check_varlen_shapes(tuple(cu_seqlens.shape), dims, seq_idx is not None)
        cu = torch.as_tensor(check_cu_seqlens(cu_seqlens.cpu().numpy(), l,
                                              seq_idx.cpu().numpy()), device=x.device)
    r = h // g  # heads per group: head i = (group i // r, member i % r)
    lo, hi = (float(v) for v in dt_limit)
    f = torch.float64 if x.dtype == torch.float64 else torch.float32

    def chunked(t):  # (b, l, ...) -> (b, c, q, ...), the tail chunk zero-padded
        t = t.to(f)
        return F.pad(t, [0, 0] * (t.dim() - 2) + [0, c * q - l]).view(b, c, q, *t.shape[2:])

    # Packed sequences: each position's id, the padded tail joining the last sequence (x and
    # dt' are 0 there, so it changes nothing), and the id running into each chunk (a virtual
    # 0 before chunk 0, so the initial state feeds only a first sequence of id 0).
    if seq_idx is not None:
        seq = seq_idx.to(torch.long)
        seq = torch.cat([seq, seq[:, -1:].expand(b, c * q - l)], dim=1).view(b, c, q)
        seq_last = seq[:, :, -1]  # (b, c)
        seq_before = torch.cat([torch.zeros_like(seq_last[:, :1]), seq_last[:, :-1]], dim=1)

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
    #    dA_cs[last] - dA_cs[s] is <= 0 (A <= 0, dt' >= 0), so exp cannot overflow. Only the
    #    sequence running at the chunk's end writes into its state.
    weight = torch.exp(dA_cs[:, :, -1:] - dA_cs) * dt_c  # (b, c, q, g, r)
    if seq_idx is not None:
        weight = weight * (seq == seq_last[..., None])[..., None, None]
    states = torch.einsum("bcsgr,bcsgrp,bcsgn->bcgrpn", weight, x_c, B_c)  # (b, c, g, r, p, n)

    # 3. state_passing: the state entering each chunk (the only sequential step); the
    #    carried state is dropped where a new sequence runs at the chunk's end.
    chunk_decay = torch.exp(dA_cs[:, :, -1])[..., None, None]  # (b, c, g, r, 1, 1)
    if seq_idx is not None:
        chunk_decay = chunk_decay * (seq_last == seq_before).to(f)[..., None, None, None, None]
    running = (torch.zeros(b, g, r, p, n, dtype=f, device=x.device) if initial_states is None
               else initial_states.to(f).reshape(b, g, r, p, n))
    prev = []
    for ci in range(c):
        prev.append(running)
        running = chunk_decay[:, ci] * running + states[:, ci]
    prev_states = torch.stack(prev, dim=1)  # (b, c, g, r, p, n)

    # 4. chunk_scan. Diagonal blocks: causal attention inside the chunk with the decay mask;
    #    the exponent dA_cs[t] - dA_cs[s] is >= 0 above the diagonal, so mask it to -inf
    #    BEFORE exp (masking after exp could meet inf * 0 = NaN). Packed: s and t of one sequence.
    seg = dA_cs.permute(0, 1, 3, 4, 2)  # (b, c, g, r, q)
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()  # (t, s): s <= t
    if seq_idx is not None:
        causal = (causal & (seq[..., :, None] == seq[..., None, :]))[:, :, None, None]
    L = torch.exp((seg[..., :, None] - seg[..., None, :]).masked_fill(~causal, -INF))
    CB = torch.einsum("bctgn,bcsgn->bcgts", C_c, B_c)  # (b, c, g, t, s), once per group
    W = CB[:, :, :, None] * L * dt_c.permute(0, 1, 3, 4, 2)[..., None, :]  # (b, c, g, r, t, s)
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", W, x_c)  # (b, c, q, g, r, p)
    # Off-diagonal term: the entering state decayed to t and read by C_t, where t belongs to
    # the sequence that ran into the chunk.
    enter = torch.exp(dA_cs)[..., None]  # (b, c, q, g, r, 1)
    if seq_idx is not None:
        enter = enter * (seq == seq_before[..., None]).to(f)[..., None, None, None]
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", C_c, prev_states) * enter
    y = y.reshape(b, c * q, h, p)[:, :l]  # un-chunk, drop the padded tail
    if D is not None:
        y = y + (D.to(f)[:, None] if D.dim() == 1 else D.to(f)) * x.to(f)
    if z is not None:
        y = y * F.silu(z.to(f))
    out = (y.to(x.dtype),)
    if return_final_states:
        out += (running.reshape(b, h, p, n),)
    if return_varlen_states:
        # 5. each packed sequence's final state, from the chunk where it ends: the entering
        #    state decayed to its last token (if it ran into the chunk) plus the chunk's writes
        #    of its own tokens up to that one (ssd.reference.chunk_state_varlen).
        last = cu[1:] - 1  # (S,) the last position of each sequence
        ci, k = last // q, last % q  # its chunk and place in it
        own_id = seq.view(-1)[last]  # (S,)
        dA = dA_cs[0, ci]  # (S, q, g, r)
        dA_end = dA[torch.arange(len(last), device=x.device), k]  # (S, g, r)
        mine = (torch.arange(q, device=x.device) <= k[:, None]) & (seq[0, ci] == own_id[:, None])
        w = torch.exp((dA_end[:, None] - dA).masked_fill(~mine[..., None, None], -INF))
        writes = torch.einsum("sqgr,sqgrp,sqgn->sgrpn", w * dt_c[0, ci], x_c[0, ci], B_c[0, ci])
        runs_in = (own_id == seq_before[0, ci]).to(f)[:, None, None]  # (S, 1, 1)
        carried = (torch.exp(dA_end) * runs_in)[..., None, None] * prev_states[0, ci]
        out += ((carried + writes).reshape(len(last), h, p, n),)
    return out if len(out) > 1 else out[0]


def ssd_reference_torch(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                        initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                        dt_limit=(0.0, INF), return_final_states=False,
                        return_varlen_states=False):
    """``ssd.reference.ssd_chunked`` (NumPy, float64) behind torch tensors: the inputs are
    copied to the CPU as float64; y comes back in x's dtype on x's device, the states in
    float64. No backward: raises NotImplementedError where a gradient is required."""
    from .reference import ssd_chunked

    grads = [name for name, t in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                      initial_states=initial_states).items()
             if t is not None and t.requires_grad]
    if grads and torch.is_grad_enabled():
        raise NotImplementedError(f"{grads[0]}: requires grad, but the reference backend is a "
                                  "NumPy copy with no backward; train with backend='torch'")

    def host(t, dtype=torch.float64):
        return None if t is None else t.detach().to("cpu", dtype).numpy()

    out = ssd_chunked(host(x), host(dt), host(A), host(B), host(C), chunk_size, D=host(D),
                      z=host(z), dt_bias=host(dt_bias), initial_states=host(initial_states),
                      seq_idx=host(seq_idx, torch.int64), cu_seqlens=host(cu_seqlens, torch.int64),
                      dt_softplus=dt_softplus, dt_limit=dt_limit,
                      return_final_states=return_final_states,
                      return_varlen_states=return_varlen_states)
    back = lambda a, dtype: torch.from_numpy(a).to(x.device, dtype)  # noqa: E731
    if not (return_final_states or return_varlen_states):
        return back(out, x.dtype)
    return (back(out[0], x.dtype),) + tuple(back(s, torch.float64) for s in out[1:])


def selective_state_update_torch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                                 dt_softplus=False, dt_limit=None):
    """The decode step in plain PyTorch: ``ssd.selective_state_update``'s semantics (mamba_ssm's),
    without a paged cache. Works on any device; computes in fp32 (fp64 when the state or x is
    fp64), stores the state in its own dtype and computes y from the state before that rounding.

        dt' = dt + dt_bias; softplus(dt') where dt' <= 20 if dt_softplus; clamp if dt_limit
        state <- exp(dt' A) state + dt' x Bᵀ    (in place)
        y = state C + D x;  y *= silu(z) if z is given

    Args:
        state: (b, h, p, n), updated in place.
        x: (b, h, p). dt: (b, h, p) or (b, h). A: (h, p, n) or (h,). B, C: (b, g, n).
        D: optional (h, p) or (h,). z: optional (b, h, p). dt_bias: optional (h, p) or (h,).
        dt_limit: optional (lo, hi), 0 <= lo <= hi.
    Returns:
        y (b, h, p) in x's dtype.
    """
    dims = check_step_shapes(**{name: None if t is None else tuple(t.shape) for name, t in dict(
        x=x, state=state, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias).items()})
    r = dims["h"] // dims["g"]  # heads per group
    f = torch.float64 if torch.float64 in (x.dtype, state.dtype) else torch.float32
    dtp = dt.to(f) if dt.dim() == 3 else dt.to(f)[..., None]  # (b, h, p or 1)
    if dt_bias is not None:
        dtp = dtp + (dt_bias.to(f) if dt_bias.dim() == 2 else dt_bias.to(f)[:, None])
    if dt_softplus:
        dtp = torch.where(dtp <= 20.0, F.softplus(dtp), dtp)  # identity above 20, as mamba_ssm
    if dt_limit is not None:
        dtp = dtp.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))
    A_f = A.to(f) if A.dim() == 3 else A.to(f)[:, None, None]  # (h, p or 1, n or 1)
    Bh, Ch = (t.to(f).repeat_interleave(r, dim=1) for t in (B, C))  # (b, h, n): each head's group
    x_f = x.to(f)
    new = (torch.exp(dtp[..., None] * A_f) * state.to(f)
           + (dtp * x_f)[..., None] * Bh[:, :, None, :])  # (b, h, p, n)
    state.copy_(new)
    y = torch.einsum("bhpn,bhn->bhp", new, Ch)
    if D is not None:
        y = y + (D.to(f) if D.dim() == 2 else D.to(f)[:, None]) * x_f
    if z is not None:
        y = y * F.silu(z.to(f))
    return y.to(x.dtype)


def selective_state_update_reference_torch(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                                           dt_softplus=False, dt_limit=None):
    """``ssd.reference.selective_state_update`` (NumPy, float64) behind torch tensors, with the
    state updated in place as the kernels do: the arguments of
    :func:`selective_state_update_torch`; y comes back in x's dtype on x's device."""
    from .reference import selective_state_update

    def host(t):
        return None if t is None else t.detach().to("cpu", torch.float64).numpy()

    y, new_state = selective_state_update(
        host(state), host(x), host(dt), host(A), host(B), host(C), D=host(D), z=host(z),
        dt_bias=host(dt_bias), dt_softplus=dt_softplus, dt_limit=dt_limit)
    state.copy_(torch.from_numpy(new_state))
    return torch.from_numpy(y).to(x.device, x.dtype)


def _mamba_ssm_step(fn):
    """mamba_ssm's ``selective_state_update`` behind :func:`selective_state_update_torch`'s
    arguments: it takes only the full forms, so per-head dt, A, D and dt_bias are passed as
    broadcast views (stride 0, as its Mamba-2 layer passes them: its kernel then reads one value
    per head)."""

    def step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
             dt_limit=None):
        if dt_limit is not None:
            raise ValueError(f"dt_limit: mamba_ssm's selective_state_update clamps nothing, got "
                             f"{dt_limit}")
        b, h, p = x.shape
        n = state.shape[-1]
        per_channel = lambda t: t if t is None or t.dim() == 2 else t[:, None].expand(h, p)  # noqa: E731
        return fn(state, x, dt if dt.dim() == 3 else dt[..., None].expand(b, h, p),
                  A if A.dim() == 3 else A[:, None, None].expand(h, p, n), B, C,
                  D=per_channel(D), z=z, dt_bias=per_channel(dt_bias), dt_softplus=dt_softplus)

    return step


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
    from .mamba_ssm_loader import PeerUnavailable, mamba_ssm_forward

    try:
        return mamba_ssm_forward()
    except PeerUnavailable as exc:
        raise BackendUnavailable(f"SSD backend 'mamba_ssm' is unavailable: {exc}") from exc


def step_function(name: str):
    """The decode step of backend ``name``, with :func:`selective_state_update_torch`'s arguments
    (the state updated in place, y returned): ``ssd.selective_state_update`` for ``cutile``,
    mamba_ssm's ``selective_state_update`` for ``mamba_ssm`` (:func:`_mamba_ssm_step`),
    :func:`selective_state_update_torch` for ``torch``, the float64 NumPy step
    (:func:`selective_state_update_reference_torch`) for ``reference``.

    Raises:
        ValueError, BackendUnavailable: as :func:`backend_function`.
    """
    backend_function(name)  # the same name and availability checks as the forward's
    if name == "torch":
        return selective_state_update_torch
    if name == "reference":
        return selective_state_update_reference_torch
    if name == "cutile":
        try:
            from .decode import selective_state_update
        except Exception as exc:
            raise BackendUnavailable(f"SSD backend 'cutile' is unavailable: ssd.decode failed to "
                                     f"import ({type(exc).__name__}: {exc})") from exc
        return selective_state_update
    from .mamba_ssm_loader import PeerUnavailable, mamba_ssm_state_update

    try:
        return _mamba_ssm_step(mamba_ssm_state_update())
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
    and the layer's dt_limit, as Mamba-2 calls it; a prefill adds seq_idx, cu_seqlens and the
    states to return as keywords. ``step(state, x, dt, A, B, C, D, dt_bias)`` -> y (b, h, p):
    the same SSD one token further, through the backend's decode step (:func:`step_function`).
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
        fn, step_fn = backend_function(backend), step_function(backend)  # raise first
        self.fn, self.step_fn, self.backend = fn, step_fn, backend
        if chunk_size is not None:
            self.chunk_size = int(chunk_size)

    def extra_repr(self):
        return f"backend={self.backend!r}, chunk_size={self.chunk_size}"

    def _check_device(self, x):
        if self.backend in ("cutile", "mamba_ssm") and x.device.type != "cuda":
            raise BackendUnavailable(f"SSD backend {self.backend!r} runs on CUDA tensors only, but "
                                     f"the input is on {x.device}; move the module to a GPU or use "
                                     "backend='torch'")

    def forward(self, x, dt, A, B, C, D, dt_bias, **packed_and_states):
        """``packed_and_states``: any of seq_idx, cu_seqlens, return_final_states,
        return_varlen_states, passed on only when given (a stand-in of
        :func:`ssd_replaced` for the plain forward need not take them). Under
        ``torch.autocast`` the SSD gets the dtypes autocast gave its inputs but computes with
        autocast off: each backend keeps its own precision (autocast would run the torch
        backend's fp32 einsums in bf16)."""
        self._check_device(x)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.fn(x, dt, A, B, C, self.chunk_size, D=D, dt_bias=dt_bias,
                           dt_softplus=True, dt_limit=self.dt_limit, **packed_and_states)

    def step(self, state, x, dt, A, B, C, D, dt_bias):
        """One decode step: state (b, h, p, n) advanced in place; x (b, h, p), dt (b, h) raw,
        A (h,), B and C (b, g, n), D and dt_bias (h,) -> y (b, h, p) in x's dtype."""
        self._check_device(x)
        # Softplus makes dt' > 0, so the forward's default limit (0, inf) clamps nothing: the
        # step then takes none (mamba_ssm's has no clamp).
        limit = None if self.dt_limit == (0.0, INF) else self.dt_limit
        return self.step_fn(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                            dt_limit=limit)


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


def causal_conv1d_torch(xBC, conv1d: nn.Conv1d, seq_idx=None):
    """The layer's depthwise causal conv1d + SiLU in plain PyTorch (``kernels="torch"``).

    xBC (b, l, conv_dim), any strides -> (b, l, conv_dim) contiguous. ``conv1d`` is depthwise
    with padding k-1 on both sides: its first l outputs are the causal convolution. With
    ``seq_idx`` (b, l) int (packed sequences), a tap that reaches back across a change of
    seq_idx reads 0 (:func:`ssd.layer_reference.causal_conv1d`)."""
    l = xBC.shape[1]
    if seq_idx is not None:
        return _packed_conv1d(xBC, conv1d.weight[:, 0], conv1d.bias, seq_idx)
    # Channels first for conv1d, keep the first l outputs, back to channels last and
    # contiguous, so that the SSD gets x, B, C with unit stride along p and n (a backend would
    # otherwise copy them inside the timed SSD call).
    out = conv1d(xBC.transpose(1, 2))[..., :l]  # (b, conv_dim, l)
    return F.silu(out.transpose(1, 2).contiguous())  # (b, l, conv_dim)


def _packed_conv1d(xBC, weight, bias, seq_idx):
    """causal_conv1d_torch with seq_idx: nn.Conv1d cannot zero a tap per position, so the w taps
    are summed one by one, in fp32 (fp64), and rounded once. xBC (b, l, c), weight (c, w),
    bias (c,) or None, seq_idx (b, l) -> (b, l, c) in xBC's dtype."""
    b, l, c = xBC.shape
    w = weight.shape[1]
    f = _param_dtype(xBC.dtype)
    xe = F.pad(xBC.to(f), (0, 0, w - 1, 0))  # (b, w-1+l, c): xe[:, w-1+t] = xBC[:, t]
    # A virtual id 0 before the start, as the SSD's (the padded inputs are 0 anyway).
    se = torch.cat([seq_idx.new_zeros(b, w - 1), seq_idx], dim=1)  # (b, w-1+l)
    out = torch.zeros(b, l, c, dtype=f, device=xBC.device) if bias is None else \
        bias.to(f).expand(b, l, c)
    for k in range(w):  # tap k reads position t - (w-1) + k, i.e. xe[:, t + k]
        same = (se[:, k:k + l] == seq_idx)[..., None]  # (b, l, 1): no boundary crossed
        out = out + weight[:, k].to(f) * xe[:, k:k + l].masked_fill(~same, 0.0)
    return F.silu(out).to(xBC.dtype)


def conv_state_of(xBC, width: int, cu_seqlens=None):
    """The conv state a prefill hands to the decode loop: each sequence's last width-1 inputs
    of the conv (xBC before it), oldest first, 0 before the sequence's start.

    Args:
        xBC: (b, l, c): b sequences of l tokens; or, with cu_seqlens, (1, l, c) packed.
        width: the conv's kernel size (d_conv).
        cu_seqlens: optional (S + 1,) int offsets of the packed sequences.
    Returns:
        (b or S, c, width-1) contiguous, in xBC's dtype.
    """
    b, l, c = xBC.shape
    kw = dict(device=xBC.device, dtype=torch.long)
    if cu_seqlens is None:  # each row one sequence, from 0 to l - 1
        rows, first, last = torch.arange(b, **kw), torch.zeros(b, **kw), torch.full((b,), l - 1, **kw)
    else:  # all in row 0, from cu_seqlens[i] to cu_seqlens[i + 1] - 1
        first, last = cu_seqlens[:-1].to(torch.long), cu_seqlens[1:].to(torch.long) - 1
        rows = torch.zeros_like(first)
    pos = last[:, None] - (width - 2) + torch.arange(width - 1, **kw)  # (S, w-1)
    window = xBC[rows[:, None], pos.clamp(min=0)]  # (S, w-1, c)
    window = window.masked_fill((pos < first[:, None])[..., None], 0.0)  # before the start
    return window.transpose(1, 2).contiguous()


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


def _check_input(u, cfg: Mamba2Config, device, name="u", one_token=False):
    what = "(batch, 1, d_model" if one_token else "(batch, seqlen, d_model"
    if (not isinstance(u, torch.Tensor) or u.dim() != 3 or u.shape[-1] != cfg.d_model
            or (one_token and u.shape[1] != 1)):
        raise ValueError(f"{name}: expected a {what}={cfg.d_model}) tensor, got "
                         f"{tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
    if u.dtype != cfg.torch_dtype:
        raise TypeError(f"{name}: dtype {u.dtype}, but the layer's weights are {cfg.dtype}")
    if u.device != device:
        raise ValueError(f"{name}: on {u.device}, but the layer's weights are on {device}")


def _packed_seq_idx(u, cu_seqlens, check_values: bool):
    """seq_idx (1, l) int32 of the prompts packed along u's one row by cu_seqlens (S + 1,),
    computed on the device without a synchronisation (unless ``check_values``)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: dtype {cu_seqlens.dtype}, expected torch.int32 or "
                        "torch.int64")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape (num_sequences + 1,) with at least one "
                         f"sequence, got {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != u.device:
        raise ValueError(f"cu_seqlens: on {cu_seqlens.device}, but u is on {u.device}")
    b, l, _ = u.shape
    if b != 1:
        raise ValueError(f"cu_seqlens: packs the prompts along one row, so u's batch must be 1, "
                         f"got {b}")
    if check_values:
        check_cu_seqlens(cu_seqlens.cpu().numpy(), l)
    positions = torch.arange(l, device=u.device, dtype=cu_seqlens.dtype)
    # seq_idx[t] = the number of sequence starts after 0 at or before t
    return torch.searchsorted(cu_seqlens[1:-1].contiguous(), positions, right=True,
                              out_int32=True)[None]


@dataclass(frozen=True)
class InferenceCache:
    """What one mixer carries from a token to the next in generation, for a batch of sequences
    (a stack holds one per layer). Both tensors are updated in place by each step.

    Attributes:
        conv_state: (b, conv_dim, d_conv - 1) in the model dtype: the last d_conv - 1 inputs of
            the conv (xBC before it), oldest first. That is the form of the conv's
            ``initial_states`` (:func:`ssd.layer_ops.causal_conv1d`); mamba_ssm keeps d_conv
            columns, the newest of which each step overwrites before reading.
        ssm_state: (b, h, p, n): the SSM state h_t, the form of the SSD's final_states and of
            ``ssd.selective_state_update``'s state; fp32 (fp64 in an fp64 model) unless asked
            otherwise.
    """

    conv_state: torch.Tensor
    ssm_state: torch.Tensor

    @classmethod
    def zeros(cls, config: Mamba2Config, batch: int, device=None,
              ssm_dtype: torch.dtype | None = None) -> "InferenceCache":
        """The state before any token: zeros, the history a sequence starts from."""
        dtype = config.torch_dtype
        return cls(torch.zeros(batch, config.conv_dim, config.d_conv - 1, device=device,
                               dtype=dtype),
                   torch.zeros(batch, config.nheads, config.headdim, config.d_state,
                               device=device, dtype=ssm_dtype or _param_dtype(dtype)))

    @property
    def batch(self) -> int:
        return self.ssm_state.shape[0]

    def check(self, config: Mamba2Config, batch: int, device, name: str = "cache"):
        """Raise TypeError / ValueError naming ``<name>.<field>`` unless the cache fits a step of
        ``batch`` tokens through a mixer of ``config`` on ``device``."""
        expected = {
            "conv_state": ((batch, config.conv_dim, config.d_conv - 1),
                           f"(batch={batch}, conv_dim={config.conv_dim}, "
                           f"d_conv-1={config.d_conv - 1})"),
            "ssm_state": ((batch, config.nheads, config.headdim, config.d_state),
                          f"(batch={batch}, nheads={config.nheads}, headdim={config.headdim}, "
                          f"d_state={config.d_state})")}
        for field, (shape, what) in expected.items():
            t = getattr(self, field)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}.{field}: expected a torch.Tensor, got "
                                f"{type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}.{field}: expected shape {what}, got {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"{name}.{field}: on {t.device}, but the layer is on {device}")
        if self.conv_state.dtype != config.torch_dtype:
            raise TypeError(f"{name}.conv_state: dtype {self.conv_state.dtype}, expected the "
                            f"model's {config.dtype}")
        if not self.ssm_state.is_floating_point():
            raise TypeError(f"{name}.ssm_state: dtype {self.ssm_state.dtype}, expected a float")


class Mamba2Mixer(nn.Module):
    """One Mamba-2 mixer with random weights, frozen until ``requires_grad_()`` (see the module
    docstring: which backends train).

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

    ``forward(u)``: u (b, l, d_model) -> (b, l, d_model), both in config.dtype. Generation:
    ``prefill(u, cu_seqlens=None)`` -> (out, :class:`InferenceCache`), then ``step(u_t, cache)``
    one token at a time, (b, 1, d_model) -> (b, 1, d_model); or ``new_cache(b)`` and steps.
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

    def forward(self, u):
        _check_input(u, self.config, self.in_proj.weight.device)
        return self._mix(u)[0]

    def new_cache(self, batch: int, ssm_dtype: torch.dtype | None = None) -> InferenceCache:
        """A zero :class:`InferenceCache` for ``batch`` sequences, to generate from the start."""
        return InferenceCache.zeros(self.config, batch, self.in_proj.weight.device, ssm_dtype)

    @torch.no_grad()
    def prefill(self, u, cu_seqlens=None, *, ssm_dtype: torch.dtype | None = None,
                check_values: bool = False):
        """The forward over prompts, handing each prompt's decode state over.

        Args:
            u: (b, l, d_model): b prompts of l tokens; or, with cu_seqlens, (1, l, d_model):
                prompts of different lengths packed along one row.
            cu_seqlens: optional (S + 1,) int32 / int64 on u's device, mamba_ssm's offsets:
                prompt i is u[0, cu_seqlens[i]:cu_seqlens[i + 1]] (0, rising, l). The conv
                and the SSD restart at each prompt (seq_idx).
            ssm_dtype: the cache's SSM state dtype (default fp32, fp64 in an fp64 model).
            check_values: check cu_seqlens' values (a device synchronisation on a GPU).
        Returns:
            (out (b, l, d_model), an :class:`InferenceCache` of b, or S, sequences): out is
            what :meth:`forward` gives each prompt alone; the cache holds each prompt's last
            d_conv - 1 conv inputs (zeros before its start) and its final SSM state.
        """
        _check_input(u, self.config, self.in_proj.weight.device)
        seq_idx = None if cu_seqlens is None else _packed_seq_idx(u, cu_seqlens, check_values)
        return self._prefill(u, cu_seqlens, seq_idx, ssm_dtype)

    @torch.no_grad()
    def step(self, u_t, cache: InferenceCache):
        """One token per sequence: u_t (b, 1, d_model) -> (b, 1, d_model), both in
        config.dtype; ``cache`` (from :meth:`prefill` or :meth:`new_cache`) advanced in place.
        The output equals the forward's at that position of the whole sequence."""
        device = self.in_proj.weight.device
        _check_input(u_t, self.config, device, name="u_t", one_token=True)
        cache.check(self.config, u_t.shape[0], device)
        return self._step(u_t, cache)

    def _mix(self, u, seq_idx=None, **packed_and_states):
        """The layer on u (b, l, d_model) -> (out (b, l, d_model), xBC (b, l, conv_dim) before
        the conv, the states the SSD returned as asked by ``packed_and_states``)."""
        cfg = self.config
        h, p, g, n = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
        zxbcdt = self.in_proj(u)  # (b, l, d_in_proj)
        z, xBC_in, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, h], dim=-1)  # views
        # Depthwise causal conv over time + SiLU -> one contiguous (b, l, conv_dim) buffer.
        if self._ops is None:
            xBC = causal_conv1d_torch(xBC_in, self.conv1d, seq_idx)
        else:  # reads the xBC columns of zxbcdt in place
            packed = {} if seq_idx is None else dict(seq_idx=seq_idx)
            xBC = self._ops.causal_conv1d(xBC_in, self.conv1d.weight[:, 0], self.conv1d.bias,
                                          **packed)
        x, B, C = torch.split(xBC, [cfg.d_inner, g * n, g * n], dim=-1)
        A = -torch.exp(self.A_log)  # (h,), < 0
        if seq_idx is not None:
            packed_and_states["seq_idx"] = seq_idx
        y = self.ssd(x.unflatten(-1, (h, p)),  # (b, l, h, p)
                     dt,  # (b, l, h), raw: the SSD adds dt_bias and applies softplus
                     A, B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),  # (b, l, g, n)
                     self.D, self.dt_bias, **packed_and_states)  # y: (b, l, h, p)
        y, *states = y if isinstance(y, tuple) else (y,)
        return self._norm_out(y.flatten(-2), z), xBC_in, states

    def _norm_out(self, y, z):
        """Gated RMSNorm and out_proj: y, z (..., d_inner) -> (..., d_model)."""
        if self._ops is None:
            y = self.norm(y, z)
        else:  # z: the z columns of zxbcdt, read in place
            y = self._ops.gated_rmsnorm(y, z, self.norm.weight, self.norm.group_size,
                                        self.norm.eps)
        return self.out_proj(y)

    def _prefill(self, u, cu_seqlens, seq_idx, ssm_dtype):
        states = (dict(cu_seqlens=cu_seqlens, return_varlen_states=True) if cu_seqlens is not None
                  else dict(return_final_states=True))
        out, xBC_in, (ssm_state,) = self._mix(u, seq_idx, **states)
        conv_state = conv_state_of(xBC_in, self.config.d_conv, cu_seqlens)
        ssm_dtype = ssm_dtype or _param_dtype(self.config.torch_dtype)
        return out, InferenceCache(conv_state, ssm_state.to(ssm_dtype).contiguous())

    def _step(self, u_t, cache: InferenceCache):
        cfg = self.config
        h, p, g, n = cfg.nheads, cfg.headdim, cfg.ngroups, cfg.d_state
        zxbcdt = self.in_proj(u_t[:, 0])  # (b, d_in_proj)
        z, xBC, dt = torch.split(zxbcdt, [cfg.d_inner, cfg.conv_dim, h], dim=-1)  # views
        conv_step = conv_step_torch if self._ops is None else self._ops.conv_step
        xBC = conv_step(cache.conv_state, xBC, self.conv1d.weight[:, 0], self.conv1d.bias)
        x, B, C = torch.split(xBC, [cfg.d_inner, g * n, g * n], dim=-1)  # (b, conv_dim) views
        y = self.ssd.step(cache.ssm_state, x.unflatten(-1, (h, p)),  # (b, h, p)
                          dt, -torch.exp(self.A_log),  # (b, h) raw, (h,)
                          B.unflatten(-1, (g, n)), C.unflatten(-1, (g, n)),  # (b, g, n)
                          self.D, self.dt_bias)  # y: (b, h, p)
        return self._norm_out(y.flatten(-2), z)[:, None]  # (b, 1, d_model)


class Mamba2Stack(nn.Module):
    """``n_layers`` mixers with pre-norm RMSNorm and residuals, and a final norm: the Mamba-2
    backbone (no embedding, no LM head, no MLP, as the published Mamba-2 models); frozen until
    ``requires_grad_()``, as :class:`Mamba2Mixer`.

    Per layer ``residual = residual + mixer(norm(residual))``, with the residual stream in fp32
    (mamba_ssm's ``residual_in_fp32``) and the mixer's input cast to config.dtype; the result
    is ``norm_f(residual)`` in config.dtype. Layer i's weights come from one generator seeded
    with ``seed`` and used in layer order; out_proj is scaled by 1/sqrt(n_layers). ``backend``
    and ``kernels`` as :class:`Mamba2Mixer`'s, for every layer.

    ``forward(u)``: u (b, l, d_model) -> hidden states (b, l, d_model). Generation:
    :meth:`prefill` (the forward, plus one :class:`InferenceCache` per layer) then :meth:`step`
    one token at a time, or :meth:`new_cache` and steps from the start.
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
        step_function(backend)  # fail before changing any layer (checks the forward's too)
        for m in self.mixers:
            m.set_backend(backend, chunk_size)
        return self

    def set_kernels(self, kernels: str) -> "Mamba2Stack":
        self.mixers[0].set_kernels(kernels)  # fail before changing the others
        for m in self.mixers[1:]:
            m.set_kernels(kernels)
        return self

    def forward(self, u):
        _check_input(u, self.config, self.norm_f.weight.device)
        dtype = self.config.torch_dtype
        residual = u.to(_param_dtype(dtype))  # (b, l, d_model), fp32 (fp64)
        for norm, mixer in zip(self.norms, self.mixers):
            residual = residual + mixer(norm(residual, out_dtype=dtype)).to(residual.dtype)
        return self.norm_f(residual, out_dtype=dtype)

    def new_cache(self, batch: int, ssm_dtype: torch.dtype | None = None) -> list:
        """One zero :class:`InferenceCache` a layer, for ``batch`` sequences."""
        return [m.new_cache(batch, ssm_dtype) for m in self.mixers]

    @torch.no_grad()
    def prefill(self, u, cu_seqlens=None, *, ssm_dtype: torch.dtype | None = None,
                check_values: bool = False):
        """The forward over prompts, batched or packed (arguments as
        :meth:`Mamba2Mixer.prefill`) -> (hidden states (b, l, d_model), [one
        :class:`InferenceCache` a layer])."""
        _check_input(u, self.config, self.norm_f.weight.device)
        seq_idx = None if cu_seqlens is None else _packed_seq_idx(u, cu_seqlens, check_values)
        dtype = self.config.torch_dtype
        residual = u.to(_param_dtype(dtype))  # (b, l, d_model), fp32 (fp64)
        caches = []
        for norm, mixer in zip(self.norms, self.mixers):
            out, cache = mixer._prefill(norm(residual, out_dtype=dtype), cu_seqlens, seq_idx,
                                        ssm_dtype)
            residual = residual + out.to(residual.dtype)
            caches.append(cache)
        return self.norm_f(residual, out_dtype=dtype), caches

    @torch.no_grad()
    def step(self, u_t, caches):
        """One token per sequence through every layer: u_t (b, 1, d_model) -> hidden states
        (b, 1, d_model); ``caches`` (one :class:`InferenceCache` a layer, from :meth:`prefill`
        or :meth:`new_cache`) advanced in place. Every cache is checked before any changes."""
        device = self.norm_f.weight.device
        _check_input(u_t, self.config, device, name="u_t", one_token=True)
        if not isinstance(caches, (list, tuple)) or len(caches) != len(self.mixers):
            raise ValueError(f"caches: expected a list of {len(self.mixers)} InferenceCache (one "
                             f"a layer), got {type(caches).__name__} of "
                             f"{len(caches) if isinstance(caches, (list, tuple)) else '?'}")
        for i, cache in enumerate(caches):
            if not isinstance(cache, InferenceCache):
                raise TypeError(f"caches[{i}]: expected an InferenceCache, got "
                                f"{type(cache).__name__}")
            cache.check(self.config, u_t.shape[0], device, name=f"caches[{i}]")
        dtype = self.config.torch_dtype
        residual = u_t.to(_param_dtype(dtype))  # (b, 1, d_model)
        for norm, mixer, cache in zip(self.norms, self.mixers, caches):
            residual = residual + mixer._step(norm(residual, out_dtype=dtype),
                                              cache).to(residual.dtype)
        return self.norm_f(residual, out_dtype=dtype)


class Mamba2LM(nn.Module):
    """A Mamba-2 language model: token embedding -> :class:`Mamba2Stack` (its final norm
    included) -> LM head, every weight trainable (``ssd.tools.train`` trains it).

    Args:
        vocab_size: V.
        config: the mixers' :class:`Mamba2Config`; its dtype is the weights' (float32 to train
            in mixed precision under ``torch.autocast``).
        n_layers: the stack's depth.
        backend: the SSD backend of every layer (:data:`BACKENDS`; one with a backward).
        kernels: the conv and norm of every layer (:data:`KERNELS`; both train).
        tie: the LM head is the embedding matrix (True) or a linear map of its own.
        device: where the weights live (default: the CPU).
        seed: the stack's weights are ``Mamba2Stack(config, n_layers, seed=seed)``'s; the
            embedding (and an untied head) come from a generator of their own.

    Initialisation: embedding ~ N(0, 0.02^2) (mamba_ssm's language model); an untied head
    ~ U(+-1/sqrt(d_model)) (nn.Linear's).

    ``forward(tokens, positions=None)``: tokens (b, l) int -> logits (b, l, V) (the model's
    dtype, or autocast's); with positions (b, k) int, the logits at those positions only,
    (b, k, V).
    """

    def __init__(self, vocab_size: int, config: Mamba2Config, n_layers: int,
                 backend: str = "torch", *, kernels: str = "torch", tie: bool = True,
                 device=None, seed: int = 0):
        super().__init__()
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
            raise ValueError(f"vocab_size: expected an int >= 2, got {vocab_size!r}")
        self.config, self.vocab_size = config, vocab_size
        device = torch.device(device or "cpu")
        d, dtype = config.d_model, config.torch_dtype
        self.stack = Mamba2Stack(config, n_layers, backend, kernels=kernels, device=device,
                                 seed=seed)
        # Another seed than the stack's: the same seed would replay the same random stream.
        gen = torch.Generator(device=device).manual_seed(seed + 0x5EED)
        self.embedding = nn.Embedding.from_pretrained(torch.empty(
            vocab_size, d, device=device).normal_(0.0, 0.02, generator=gen).to(dtype),
            freeze=False)
        self.head = None
        if not tie:
            self.head = nn.Linear(d, vocab_size, bias=False, device="meta")
            self.head.weight = _uniform(gen, (vocab_size, d), -d ** -0.5, d ** -0.5, device,
                                        dtype)
        self.requires_grad_(True)  # the stack's weights are made frozen

    @property
    def backend(self) -> str:
        return self.stack.backend

    def set_backend(self, backend: str, chunk_size: int | None = None) -> "Mamba2LM":
        self.stack.set_backend(backend, chunk_size)
        return self

    def forward(self, tokens, positions=None):
        weight = self.embedding.weight
        if (not isinstance(tokens, torch.Tensor) or tokens.dim() != 2
                or tokens.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"tokens: expected a (batch, seqlen) int32 / int64 tensor, got "
                             f"{getattr(tokens, 'shape', type(tokens).__name__)} "
                             f"{getattr(tokens, 'dtype', '')}")
        if tokens.device != weight.device:
            raise ValueError(f"tokens: on {tokens.device}, but the model is on {weight.device}")
        hidden = self.stack(self.embedding(tokens))  # (b, l, d_model)
        if positions is not None:
            if (not isinstance(positions, torch.Tensor) or positions.dim() != 2
                    or positions.shape[0] != tokens.shape[0]):
                raise ValueError(f"positions: expected a (batch={tokens.shape[0]}, k) int "
                                 f"tensor, got {getattr(positions, 'shape', positions)}")
            # A gather, not a boolean mask: no device synchronisation, a static shape.
            hidden = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
        head = weight if self.head is None else self.head.weight
        return F.linear(hidden, head)  # (b, l or k, V)


__all__ = ["Mamba2Config", "PRESETS", "PRESET_LAYERS", "preset", "config_for_shape", "ssd_torch",
           "ssd_reference_torch", "BACKENDS", "KERNELS", "BackendUnavailable", "backend_function",
           "available_backends", "kernel_ops", "SSDStep", "ssd_replaced", "capture_ssd_calls",
           "causal_conv1d_torch", "GatedRMSNorm", "RMSNorm", "Mamba2Mixer", "Mamba2Stack",
           "Mamba2LM", "InferenceCache", "step_function", "selective_state_update_torch",
           "selective_state_update_reference_torch", "conv_step_torch", "conv_state_of"]
