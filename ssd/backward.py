r"""The SSD backward pass, stage by stage: ``ssd.reference_backward`` on tensors.

One function per stage, each named after its NumPy reference with a ``_torch`` suffix and
returning the same dict of gradients; a cuTile kernel stands behind the same boundary
(``ssd.kernels.<stage>_backward``, ``<stage>_backward_cutile``: same arguments, same dict)::

    chunk_scan_backward_torch -> state_passing_backward_torch -> chunk_state_backward_torch
        -> chunk_cumsum_backward_torch (-> prepare_dt_backward_torch)

composed in reverse stage order by :func:`ssd_chunked_backward`, which takes each stage's
implementation from one :class:`StageBackwards` table: :data:`TORCH_BACKWARDS` on the CPU (and
for float64), :func:`cutile_backwards` on a GPU (every stage's cuTile kernels);
:func:`ssd_chunked_backward_torch` is the composition of the PyTorch
stages alone. The derivation is the module docstring of ``ssd.reference_backward``; the code
below follows it line for line, batched over chunks, heads and the batch with einsums (one bmm
each), on any device.

Differences from the NumPy rungs, all about what is read rather than what is computed:

* The forward's intermediates are arguments: ``dt_out`` and ``dA_cumsum`` (b, h, c, q), and the
  entering states ``prev_states`` (b, c, h, p, n), which ``state_passing_backward_torch`` takes
  instead of the per-chunk states the reference rebuilds them from. Whatever
  :func:`ssd_chunked_backward` is not given it recomputes with the forward stages here
  (:func:`chunk_cumsum_torch`, :func:`chunk_state_torch`, :func:`state_passing_torch`; with
  :func:`chunk_scan_torch` they make a whole forward, ``ssd.autograd.torch_stages``).
* B and C are read per group and never expanded to heads: heads are split as (g, r), r = h / g
  (head i = group i // r, member i % r), and the gradients of a group's B and C are summed over
  its r heads inside the contraction.
* Everything is computed in float32, or float64 where x is float64 (the CPU tests), whatever
  the dtype of the inputs and intermediates; the results stay in that compute dtype (the caller
  casts them, see ``ssd.autograd``). fp32 matmuls follow torch's TF32 switch
  (``torch.backends.cuda.matmul.allow_tf32``, off by default): keep it off for fp32 gradients.

Memory: ``chunk_scan_backward_torch`` holds a few (b, c, h, q, q) float32 arrays at once (the
decay mask, the diagonal block's weights and their gradient), the size of one (q x q) attention
matrix per head and chunk.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

INF = float("inf")

__all__ = [
    "prepare_dt_backward_torch",
    "chunk_cumsum_backward_torch",
    "chunk_state_backward_torch",
    "state_passing_backward_torch",
    "chunk_scan_backward_torch",
    "chunk_scan_backward_cutile",
    "ssd_chunked_backward",
    "ssd_chunked_backward_torch",
    "StageBackwards",
    "TORCH_BACKWARDS",
    "cutile_backwards",
    "default_backwards",
    "chunk_cumsum_torch",
    "chunk_state_torch",
    "state_passing_torch",
    "chunk_scan_torch",
    "compute_dtype",
]


# --------------------------------------------------------------------------------------
# Layouts and masks shared by the stages
# --------------------------------------------------------------------------------------


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the backward computes in: float64 for float64 x, float32 otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk(t, q, dtype):
    """(b, l, ...) -> (b, c, q, ...) in ``dtype``, the tail zero-padded (a zero x, B, C, dy or
    dt' contributes nothing)."""
    b, l = t.shape[:2]
    c = math.ceil(l / q)
    t = F.pad(t.to(dtype), [0, 0] * (t.dim() - 2) + [0, c * q - l])
    return t.reshape(b, c, q, *t.shape[2:])


def _unchunk(t, l):
    """(b, c, q, ...) -> (b, l, ...): the padded tail dropped."""
    b, c, q = t.shape[:3]
    return t.reshape(b, c * q, *t.shape[3:])[:, :l]


def _by_group(t, g):
    """A (b, h, c, q) row array -> (b, c, q, g, r), heads split by group."""
    b, h, c, q = t.shape
    return t.permute(0, 2, 3, 1).reshape(b, c, q, g, h // g)


def _by_head(t):
    """(b, c, q, g, r) -> (b, h, c, q): the inverse of :func:`_by_group`."""
    b, c, q, g, r = t.shape
    return t.reshape(b, c, q, g * r).permute(0, 3, 1, 2)


class SeqMasks(NamedTuple):
    """The masks seq_idx puts on each stage (``ssd.reference``'s ``_scan_masks``,
    ``_state_keep`` and ``_chunk_carry``), from the chunked seq_idx, the tail padded with its
    last value."""

    same: torch.Tensor  # (b, c, t, s) bool: t and s of one sequence (chunk_scan's diagonal)
    enters: torch.Tensor  # (b, c, q) bool: t continues the sequence before the chunk
    keep: torch.Tensor  # (b, c, q) bool: s of the sequence running at the chunk's end
    carry: torch.Tensor  # (b, c) bool: chunk c continues the sequence chunk c - 1 ended with


def seq_masks(seq_idx, q) -> SeqMasks | None:
    """:class:`SeqMasks` of a (b, l) integer seq_idx for chunk size q, or None without one."""
    if seq_idx is None:
        return None
    b, l = seq_idx.shape
    c = math.ceil(l / q)
    seq = seq_idx.long()
    seq = torch.cat([seq, seq[:, -1:].expand(b, c * q - l)], dim=1).reshape(b, c, q)
    last = seq[:, :, -1]  # (b, c): the edge padding makes it the last valid position's
    before = torch.cat([torch.zeros_like(last[:, :1]), last[:, :-1]], dim=1)  # virtual 0 first
    return SeqMasks(same=seq[:, :, :, None] == seq[:, :, None, :],
                    enters=seq == before[:, :, None], keep=seq == last[:, :, None],
                    carry=last == before)


def _group_sizes(x, B, dA_cumsum):
    b, l, h, p = x.shape
    g, n = B.shape[2:]
    c, q = dA_cumsum.shape[2:]
    return b, l, h, p, g, n, c, q


# --------------------------------------------------------------------------------------
# Forward stages, for what the backward recomputes
# --------------------------------------------------------------------------------------


def _step_size(dt, dt_bias, dt_softplus, dt_limit, dtype):
    """u = dt + dt_bias, s = softplus(u) where u <= 20 (else u), dt' = clamp(s, lo, hi):
    returns (u, s, dt'), (b, l, h) in ``dtype``."""
    u = dt.to(dtype) + (0.0 if dt_bias is None else dt_bias.to(dtype))
    s = torch.where(u <= 20.0, F.softplus(u), u) if dt_softplus else u
    lo, hi = (float(v) for v in dt_limit)
    return u, s, s.clamp(min=lo, max=hi)


def chunk_cumsum_torch(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF),
                       dtype=torch.float32):
    """Stage 1 (``ssd.reference.chunk_cumsum``): dt_out, dA_cumsum, both (b, h, c, q) in
    ``dtype``; dt_out is 0 on the padded tail, so dA_cumsum stays flat there."""
    _, _, dtp = _step_size(dt, dt_bias, dt_softplus, dt_limit, dtype)
    dt_out = _chunk(dtp, chunk_size, dtype).permute(0, 3, 1, 2)  # (b, h, c, q)
    return dt_out, torch.cumsum(dt_out * A.to(dtype)[None, :, None, None], dim=-1)


def _decay_to_end(dA_cumsum, masks):
    """exp(dA_cumsum[last] - dA_cumsum[s]) (b, h, c, q), <= 1; 0 where seq_idx leaves s out of
    its chunk's state."""
    decay = torch.exp(dA_cumsum[..., -1:] - dA_cumsum)
    return decay if masks is None else decay * masks.keep[:, None]


def chunk_state_torch(B, x, dt_out, dA_cumsum, seq_idx=None):
    """Stage 2 (``ssd.reference.chunk_state``): states (b, c, h, p, n) in dA_cumsum's dtype."""
    b, l, h, p, g, n, c, q = _group_sizes(x, B, dA_cumsum)
    f = dA_cumsum.dtype
    masks = seq_masks(seq_idx, q)
    w = _by_group(_decay_to_end(dA_cumsum, masks) * dt_out.to(f), g)  # (b, c, q, g, r)
    x_c = _chunk(x, q, f).reshape(b, c, q, g, h // g, p)
    states = torch.einsum("bcsgrp,bcsgn->bcgrpn", w[..., None] * x_c, _chunk(B, q, f))
    return states.reshape(b, c, h, p, n)


def _chunk_decay(dA_cumsum, masks):
    """(b, h, c): each chunk's whole decay, 0 where a sequence starts inside it."""
    decay = torch.exp(dA_cumsum[..., -1])
    return decay if masks is None else decay * masks.carry[:, None]


def state_passing_torch(states, dA_cumsum, initial_states=None, seq_idx=None):
    """Stage 3 (``ssd.reference.state_passing``): prev_states (b, c, h, p, n) and final_states
    (b, h, p, n), in states' dtype. Sequential over chunks, as the forward."""
    b, c, h, p, n = states.shape
    decay = _chunk_decay(dA_cumsum, seq_masks(seq_idx, dA_cumsum.shape[-1]))  # (b, h, c)
    running = (states.new_zeros(b, h, p, n) if initial_states is None
               else initial_states.to(states.dtype))
    prev = []
    for ci in range(c):
        prev.append(running)
        running = torch.addcmul(states[:, ci], decay[:, :, ci, None, None], running)
    return torch.stack(prev, dim=1), running


# --------------------------------------------------------------------------------------
# Stage backwards
# --------------------------------------------------------------------------------------


def prepare_dt_backward_torch(ddt_prime, dt, dt_bias=None, dt_softplus=False,
                              dt_limit=(0.0, INF)):
    """The backward of dt' = clamp(softplus(dt + dt_bias), lo, hi)
    (``ssd.reference_backward.prepare_dt_backward``: the gradient passes where lo <= s <= hi,
    edges included; softplus's slope is sigmoid(u) where u <= 20, 1 above).

    Args:
        ddt_prime: (b, l, h) gradient of dt'. dt, dt_bias, dt_softplus, dt_limit: the forward's.
    Returns:
        dict with ddt (b, l, h) and, with dt_bias, ddt_bias (h,), in ddt_prime's dtype.
    """
    f = ddt_prime.dtype
    u, s, _ = _step_size(dt, dt_bias, dt_softplus, dt_limit, f)
    lo, hi = (float(v) for v in dt_limit)
    slope = torch.where(u <= 20.0, torch.sigmoid(u), 1.0) if dt_softplus else 1.0
    ddt = torch.where((s >= lo) & (s <= hi), ddt_prime * slope, 0.0)  # (b, l, h)
    out = {"ddt": ddt}
    if dt_bias is not None:
        out["ddt_bias"] = ddt.sum(dim=(0, 1))  # (h,)
    return out


def chunk_cumsum_backward_torch(ddt_out, ddA_cumsum, dt, A, chunk_size, dt_bias=None,
                                dt_softplus=False, dt_limit=(0.0, INF), *, dt_out=None):
    """The backward of stage 1 (``ssd.reference_backward.chunk_cumsum_backward``).

    Args:
        ddt_out, ddA_cumsum: (b, h, c, q), every stage's contributions summed.
        dt, A, chunk_size, dt_bias, dt_softplus, dt_limit: the forward's arguments.
        dt_out: the forward's (b, h, c, q) step sizes; None recomputes them.
    Returns:
        dict with ddt (b, l, h), dA (h,) and, with dt_bias, ddt_bias (h,), in ddA_cumsum's
        dtype.
    """
    f = ddA_cumsum.dtype
    if dt_out is None:
        dt_out, _ = chunk_cumsum_torch(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit, f)
    # the cumsum's adjoint is a suffix sum: step k's log-decay feeds dA_cumsum[t >= k]
    dlog_decay = ddA_cumsum.flip(-1).cumsum(-1).flip(-1)  # (b, h, c, q)
    dA = torch.einsum("bhcq,bhcq->h", dlog_decay, dt_out.to(f))  # padded dt' = 0 adds nothing
    ddt_prime = ddt_out.to(f) + A.to(f)[None, :, None, None] * dlog_decay  # (b, h, c, q)
    ddt_prime = _unchunk(ddt_prime.permute(0, 2, 3, 1), dt.shape[1])  # (b, l, h)
    out = prepare_dt_backward_torch(ddt_prime, dt, dt_bias, dt_softplus, dt_limit)
    out["dA"] = dA
    return out


def chunk_state_backward_torch(dstates, B, x, dt_out, dA_cumsum, seq_idx=None, *,
                               dx_prior=None, dx_dtype=None):
    """The backward of stage 2 (``ssd.reference_backward.chunk_state_backward``).

    Args:
        dstates: (b, c, h, p, n) gradient of states.
        B, x, dt_out, dA_cumsum, seq_idx: the forward's arguments.
        dx_prior: optional (b, l, h, p) tensor in the compute dtype, x's other gradient
            (chunk_scan's), added to this stage's dx (only read).
        dx_dtype: dx's dtype (None: the compute dtype).
    Returns:
        dict with dB (b, l, g, n), dx (b, l, h, p), ddt_out and ddA_cumsum (b, h, c, q), this
        stage's contributions (dx: plus dx_prior, in dx_dtype), in the compute dtype:
        dstates', at least fp32 (dstates may come rounded to x's dtype).
    """
    b, l, h, p, g, n, c, q = _group_sizes(x, B, dA_cumsum)
    r, f = h // g, torch.promote_types(dstates.dtype, torch.float32)
    dA_cs = dA_cumsum.to(f)
    decay = _decay_to_end(dA_cs, seq_masks(seq_idx, q))  # (b, h, c, q)
    w = _by_group(decay * dt_out.to(f), g)  # (b, c, q, g, r): the forward's weights
    x_c = _chunk(x, q, f).reshape(b, c, q, g, r, p)
    B_c = _chunk(B, q, f)  # (b, c, q, g, n)
    dS = dstates.to(f).reshape(b, c, g, r, p, n)

    # x and B: the state's gradient read back by B_s (resp. x_s), weighted
    dSB = torch.einsum("bcgrpn,bcsgn->bcsgrp", dS, B_c)  # (b, c, q, g, r, p)
    dx_c = w[..., None] * dSB
    dB_c = torch.einsum("bcsgrp,bcgrpn->bcsgn", w[..., None] * x_c, dS)  # summed over heads
    # the weight: its dt' factor and its exponent dA_cs[last] - dA_cs[s]
    dweight = (x_c * dSB).sum(-1)  # (b, c, q, g, r)
    dexponent = dweight * w
    ddA = -dexponent
    ddA[:, :, -1] += dexponent.sum(2)
    dx = _unchunk(dx_c, l).reshape(b, l, h, p)
    if dx_prior is not None:
        dx = dx + dx_prior
    return {"dB": _unchunk(dB_c, l), "dx": dx.to(dx_dtype or f),
            "ddt_out": _by_head(dweight) * decay, "ddA_cumsum": _by_head(ddA)}


def state_passing_backward_torch(dprev_states, prev_states, dA_cumsum, initial_states=None,
                                 seq_idx=None, *, dfinal_states=None, dstates_dtype=None):
    """The backward of stage 3 (``ssd.reference_backward.state_passing_backward``): the scan
    over chunks run backwards with the same decays.

        R = dfinal_states;  for c = C-1 .. 0:  dstates[c] = R;  R = dprev[c] + decay_c R

    Takes the forward's entering states (the decay's gradient reads them) where the reference
    takes the per-chunk states and rebuilds them.

    Args:
        dprev_states: (b, c, h, p, n) gradient of prev_states.
        prev_states: (b, c, h, p, n) the forward's entering states (any float dtype).
        dA_cumsum: (b, h, c, q); initial_states: the forward's (only whether it was given
            matters); seq_idx: optional (b, l).
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
        dstates_dtype: dstates' dtype (None: dprev_states'); the backward asks for x's, the dtype
            chunk_state's MMAs take it in, so that the (b, c, h, p, n) tensor is stored rounded
            once, at half the size in bf16 and fp16.
    Returns:
        dict with dstates (b, c, h, p, n; in dstates_dtype), ddA_cumsum (b, h, c, q) (non-zero
        in the last column only) and, with initial_states, dinitial_states (b, h, p, n); in
        dprev_states' dtype.
    """
    if isinstance(dprev_states, EnteringGradient):
        raise TypeError("dprev_states: an EnteringGradient (chunk_scan's cuTile backward with "
                        "ScanBackwardConfig.dprev_in_walk) is formed only by state_passing's "
                        "cuTile backward; pair this one with dprev_in_walk=False")
    b, c, h, p, n = dprev_states.shape
    f = dprev_states.dtype
    decay = _chunk_decay(dA_cumsum.to(f), seq_masks(seq_idx, dA_cumsum.shape[-1]))  # (b, h, c)
    R = (dprev_states.new_zeros(b, h, p, n) if dfinal_states is None else dfinal_states.to(f))
    dstates = []
    for ci in range(c - 1, -1, -1):  # R is dLoss/d(the state after chunk ci)
        dstates.append(R)
        R = torch.addcmul(dprev_states[:, ci], decay[:, :, ci, None, None], R)
    dstates = torch.stack(dstates[::-1], dim=1)  # (b, c, h, p, n)
    # d exp(dA_cs[last]) / d dA_cs[last] = the decay itself (0 where not carried)
    ddecay = torch.einsum("bchpn,bchpn->bhc", dstates, prev_states.to(f))
    ddA = torch.zeros_like(dA_cumsum, dtype=f)
    ddA[..., -1] = ddecay * decay
    out = {"dstates": dstates.to(dstates_dtype or f), "ddA_cumsum": ddA}
    if initial_states is not None:
        out["dinitial_states"] = R
    return out


def _skip(D, f):
    """D as (h, 1) or (h, p) in dtype ``f``, to broadcast over (b, l, h, p); None for None."""
    return None if D is None else (D.to(f)[:, None] if D.dim() == 1 else D.to(f))


def _gate(z, f):
    """(z, sigmoid(z)) in dtype ``f``: what both gradients of y = y_pre silu(z) read."""
    zf = z.to(f)
    return zf, torch.sigmoid(zf)


def _gate_grad(dy, y_pre, gate):
    """dz of y = y_pre silu(z) from ``gate`` = :func:`_gate`: dy y_pre silu'(z),
    silu' = sig (1 + z (1 - sig))."""
    zf, sig = gate
    return dy * y_pre * sig * (1.0 + zf * (1.0 - sig))


def _skip_and_gate_backward(dy, y_ssm, x, D, z):
    """The backward of y = (y_ssm + D x) silu(z) (``ssd.reference_backward``'s helper).

    Args:
        dy, x: (b, l, h, p) in the compute dtype. y_ssm: a callable returning the forward's
            (b, l, h, p) output before the skip and gate (only called with z). D: None, (h,) or
            (h, p). z: None or (b, l, h, p).
    Returns:
        dy_ssm (b, l, h, p), dx_skip (b, l, h, p) or None, dD (D's shape) or None,
        dz (b, l, h, p) or None.
    """
    Dhp = _skip(D, dy.dtype)  # (h, 1|p)
    dz = None
    if z is not None:
        y_pre = y_ssm() if Dhp is None else y_ssm() + Dhp * x  # the output before the gate
        zf, sig = gate = _gate(z, dy.dtype)
        dy, dz = dy * zf * sig, _gate_grad(dy, y_pre, gate)  # dy silu(z) reaches y_pre
    if Dhp is None:
        return dy, None, None, dz
    dD = torch.einsum("blhp,blhp->hp", dy, x)  # (h, p)
    return dy, Dhp * dy, (dD.sum(-1) if D.dim() == 1 else dD), dz


class _Scan(NamedTuple):
    """chunk_scan's operands as both directions read them, heads split as (g, r)."""

    x: torch.Tensor  # (b, c, q, g, r, p)
    B: torch.Tensor  # (b, c, q, g, n): per group, never per head
    C: torch.Tensor  # (b, c, q, g, n)
    P: torch.Tensor  # (b, c, g, r, p, n) the entering states
    L: torch.Tensor  # (b, c, g, r, t, s) decays exp(dA_cs[t] - dA_cs[s]), 0 where masked
    CB: torch.Tensor  # (b, c, g, 1, t, s) C_t . B_s, shared by a group's heads
    Ldt: torch.Tensor  # (b, c, g, r, t, s) L[t, s] dt'_s
    W: torch.Tensor  # (b, c, g, r, t, s) the diagonal block's weights (C_t . B_s) L dt'_s
    decay_in: torch.Tensor  # (b, c, q, g, r) exp(dA_cs[t]), 0 where t starts a new sequence
    CP: torch.Tensor  # (b, c, q, g, r, p) C_t . P_c, the entering state read at t

    def y_ssm(self, l):
        """The output before the skip and gate, (b, l, h, p): diagonal block plus entering
        states' term."""
        y = torch.einsum("bcgrts,bcsgrp->bctgrp", self.W, self.x)
        y = y + self.CP * self.decay_in[..., None]
        b, _, _, g, r, p = y.shape
        return _unchunk(y, l).reshape(b, l, g * r, p)


def _scan_operands(B, C, x, dt_out, dA_cumsum, prev_states, masks, f) -> _Scan:
    b, l, h, p, g, n, c, q = _group_sizes(x, B, dA_cumsum)
    r = h // g
    x_c = _chunk(x, q, f).reshape(b, c, q, g, r, p)
    B_c, C_c = _chunk(B, q, f), _chunk(C, q, f)
    P = prev_states.to(f).reshape(b, c, g, r, p, n)
    dA_c = _by_group(dA_cumsum.to(f), g)  # (b, c, q, g, r)
    # the diagonal blocks: W[t, s] = (C_t . B_s) L[t, s] dt'_s. The exponent dA_cs[t] - dA_cs[s]
    # is >= 0 above the diagonal: masked to -inf BEFORE exp, so that L is exactly 0 there and
    # between sequences (masking after exp could meet inf * 0 = NaN)
    pos = torch.arange(q, device=x.device)
    causal = pos[:, None] >= pos[None, :]  # (t, s): s <= t
    allowed = causal if masks is None else causal & masks.same[:, :, None, None]
    seg = dA_c.permute(0, 1, 3, 4, 2)  # (b, c, g, r, q)
    L = torch.exp((seg[..., :, None] - seg[..., None, :]).masked_fill(~allowed, -INF))
    CB = torch.einsum("bctgn,bcsgn->bcgts", C_c, B_c)[:, :, :, None]
    Ldt = L * _by_group(dt_out.to(f), g).permute(0, 1, 3, 4, 2)[..., None, :]
    # the off-diagonal term exp(dA_cs[t]) C_t . P_c: decays from the chunk's start
    decay_in = torch.exp(dA_c)  # in (0, 1]
    if masks is not None:
        decay_in = decay_in * masks.enters[..., None, None]
    CP = torch.einsum("bctgn,bcgrpn->bctgrp", C_c, P)
    return _Scan(x_c, B_c, C_c, P, L, CB, Ldt, CB * Ldt, decay_in, CP)


def chunk_scan_torch(B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None, seq_idx=None):
    """Stage 4 (``ssd.reference.chunk_scan``): y (b, l, h, p) in the compute dtype
    (:func:`compute_dtype` of x)."""
    f = compute_dtype(x)
    q = dA_cumsum.shape[-1]
    y = _scan_operands(B, C, x, dt_out, dA_cumsum, prev_states, seq_masks(seq_idx, q),
                       f).y_ssm(x.shape[1])
    if D is not None:
        y = y + (D.to(f)[:, None] if D.dim() == 1 else D.to(f)) * x.to(f)
    return y if z is None else y * F.silu(z.to(f))


def chunk_scan_backward_torch(dy, B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None,
                              seq_idx=None):
    """The backward of stage 4 (``ssd.reference_backward.chunk_scan_backward``): the diagonal
    block as masked attention's backward, the off-diagonal term as a chunk_state of (dy, C).

    With z, the gate's gradient needs the output before it: the SSM part is recomputed from
    the diagonal block's weights (built here anyway) and the entering states.

    Args:
        dy: (b, l, h, p) gradient of y (any float dtype).
        B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx: the forward's arguments
            (prev_states the entering states, in any float dtype).
    Returns:
        dict with dB and dC (b, l, g, n), dx (b, l, h, p), ddt_out and ddA_cumsum
        (b, h, c, q), dprev_states (b, c, h, p, n) and, where given, dD ((h,) or (h, p)) and
        dz (b, l, h, p); dB, dx, ddt_out and ddA_cumsum are this stage's contributions. In the
        compute dtype (:func:`compute_dtype` of x).
    """
    b, l, h, p, g, n, c, q = _group_sizes(x, B, dA_cumsum)
    r, f = h // g, compute_dtype(x)
    # 1. the forward's operands: decay mask, diagonal weights, entering states' term
    op = _scan_operands(B, C, x, dt_out, dA_cumsum, prev_states, seq_masks(seq_idx, q), f)

    # 2. the gate and skip (the gate needs the SSM part of y); then dy reaches the SSM
    dy_ssm, dx_skip, dD, dz = _skip_and_gate_backward(dy.to(f), lambda: op.y_ssm(l), x.to(f),
                                                      D, z)
    dy_c = _chunk(dy_ssm, q, f).reshape(b, c, q, g, r, p)  # 0 on the padded tail

    # 3. diagonal blocks: dx by the transposed (anti-causal) product; dW = dy_t . x_s
    dx_c = torch.einsum("bcgrts,bctgrp->bcsgrp", op.W, dy_c)
    dW = torch.einsum("bctgrp,bcsgrp->bcgrts", dy_c, op.x)  # (b, c, g, r, t, s)
    dCB = (dW * op.Ldt).sum(3)  # (b, c, g, t, s): the group's heads share C_t . B_s
    dC_c = torch.einsum("bcgts,bcsgn->bctgn", dCB, op.B)
    dB_c = torch.einsum("bcgts,bctgn->bcsgn", dCB, op.C)
    ddt = (dW * op.CB * op.L).sum(-2)  # (b, c, g, r, s)
    # the exponent dA_cs[t] - dA_cs[s]: + to row t, - to column s (W is 0 where masked)
    dexponent = dW * op.W
    ddA = dexponent.sum(-1) - dexponent.sum(-2)  # (b, c, g, r, q)
    del dW, dexponent

    # 4. off-diagonal term: a chunk_state of (dy, C) gives dprev_states
    dy_in = dy_c * op.decay_in[..., None]  # (b, c, q, g, r, p)
    dprev = torch.einsum("bctgrp,bctgn->bcgrpn", dy_in, op.C)
    dC_c = dC_c + torch.einsum("bctgrp,bcgrpn->bctgn", dy_in, op.P)
    ddA_off = op.decay_in * (dy_c * op.CP).sum(-1)  # (b, c, q, g, r)

    dx = _unchunk(dx_c, l).reshape(b, l, h, p)
    out = {"dB": _unchunk(dB_c, l), "dC": _unchunk(dC_c, l),
           "dx": dx if dx_skip is None else dx + dx_skip,
           "ddt_out": _by_head(ddt.permute(0, 1, 4, 2, 3)),
           "ddA_cumsum": _by_head(ddA.permute(0, 1, 4, 2, 3) + ddA_off),
           "dprev_states": dprev.reshape(b, c, h, p, n)}
    if dD is not None:
        out["dD"] = dD
    if dz is not None:
        out["dz"] = dz
    return out


class EnteringGradient(NamedTuple):
    """dprev_states (b, c, h, p, n), not formed: for chunk c, sum_t e^{a_t} dy_tᵀ C_t over its
    rows t that continue the sequence entering it (``chunk_scan_backward_torch``'s step 4).
    chunk_scan's cuTile backward returns it in place of the tensor where
    ``ScanBackwardConfig.dprev_in_walk``; state_passing's cuTile backward then forms each
    chunk's where its walk adds it to the carried gradient."""

    dy: torch.Tensor  # (b, l, h, p) gradient of y's SSM part
    C: torch.Tensor  # (b, l, g, n), the MMA's dtype (x's)
    seq_last: torch.Tensor | None  # (b, c) int32 seq_idx at each chunk's last valid position


def chunk_scan_backward_cutile(dy, B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None,
                               seq_idx=None, *, config=None, walk=None, dx_dtype=None):
    """The backward of stage 4 with the cuTile kernels: ``chunk_scan_backward_torch``'s
    arguments and result (its docstring), on a GPU.

    The skip's gradients (D dy into dx, and dD) come from the columns kernel; the gate (z) runs
    in PyTorch around the kernels' launcher,
    :func:`ssd.kernels.chunk_scan_backward.chunk_scan_backward`: dy reaches the SSM part as
    dy silu(z) before the kernels, and the gate's gradient reads the SSM part of y, which the
    rows kernel rebuilds (``rebuild_y``).

    Args:
        dy: (b, l, h, p) gradient of y; B, C: (b, l, g, n); x: (b, l, h, p); z: optional
            (b, l, h, p): fp32, bf16 or fp16 (B and C are read in x's dtype).
        dt_out, dA_cumsum: (b, h, c, q) fp32; prev_states: (b, c, h, p, n) fp32, bf16 or fp16;
            D: optional (h,) or (h, p); seq_idx: optional (b, l) int32 or int64.
        config: the kernels' tiles (None: :class:`ssd.config.ScanBackwardConfig`'s defaults).
        walk: state_passing's backward as a function of dprev_states alone (its other arguments
            bound): given, chunk_state's backward is folded into the kernels. The walk runs
            first, on the :class:`EnteringGradient` (dy after the gate, C), and the kernels take
            its dstates (:func:`ssd.kernels.chunk_scan_backward.fold_state`); its result is
            returned under "passing", and dx, dB, ddt_out and ddA_cumsum hold chunk_state's parts.
        dx_dtype: dx's dtype where it is final (with ``walk``; None: the compute dtype).
    Returns:
        dict with dB and dC (b, l, g, n), dx (b, l, h, p), ddt_out and ddA_cumsum
        (b, h, c, q), dprev_states (b, c, h, p, n; an :class:`EnteringGradient` where
        config.dprev_in_walk, the default) and, where given, dD ((h,) or (h, p)) and dz
        (b, l, h, p), all fp32 (the compute dtype); dB, dx, ddt_out and ddA_cumsum are this
        stage's contributions.
    Raises:
        ValueError naming the argument, for a shape, dtype or device the kernels do not take.
    """

    from .config import ScanBackwardConfig
    from .kernels.chunk_scan_backward import check_inputs, chunk_scan_backward
    from .launch import chunk_seq_last

    dims = check_inputs(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx)
    f = torch.float32

    def last_dim_contiguous(t):  # the kernels take strides, but the last one must be 1
        return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()

    x, dy, z, prev_states = map(last_dim_contiguous, (x, dy, z, prev_states))
    B, C = (last_dim_contiguous(t.to(x.dtype)) for t in (B, C))
    dt_out, dA_cumsum = map(last_dim_contiguous, (dt_out, dA_cumsum))
    seq_last = None
    if seq_idx is not None:
        seq_last = chunk_seq_last(seq_idx, dims["q"])
        seq_idx = seq_idx.to(torch.int32).contiguous()
    # dy through the gate: dy silu(z) before the kernels, dz from the output before the gate
    # (the SSM part the rows kernel rebuilds, plus D x) after them
    config = config or ScanBackwardConfig()
    if walk is not None and not config.dprev_in_walk:
        raise ValueError("walk: chunk_state's backward folds into chunk_scan's only where "
                         "state_passing's walk forms dprev_states (config.dprev_in_walk)")
    dy_ssm = dy  # without z the caller holds it anyway: the walk reads it as it is
    if z is not None:
        dy = dy.to(f)
        zf, sig = _gate(z, f)
        dy_ssm = dy * zf * sig
        del zf, sig  # formed again after the kernels: two fp32 (b, l, h, p) tensors not held

    def entering(dy_ssm):  # chunk_scan's (dy, C) as the walk reads them: in the MMA's dtype
        return EnteringGradient(dy_ssm if z is None else dy_ssm.to(C.dtype), C, seq_last)

    # with walk, the walk first: the kernels read the state gradient it forms
    passing = None if walk is None else walk(entering(dy_ssm))
    out = chunk_scan_backward(dy_ssm, B, C, x, dt_out, dA_cumsum, prev_states, seq_idx, seq_last,
                              config, rebuild_y=z is not None, D=D,
                              dstates=None if passing is None else passing["dstates"],
                              dx_dtype=dx_dtype if passing is not None else None)
    # unformed: state_passing's walk forms it from (dy, C)
    if passing is None and out["dprev_states"] is None:
        out["dprev_states"] = entering(dy_ssm)
    del dy_ssm  # with z an fp32 (b, l, h, p) temporary, not held through the gate's gradient
    if z is not None:
        y_pre = out.pop("y_ssm")
        if D is not None:
            y_pre += _skip(D, f) * x
        out["dz"] = _gate_grad(dy, y_pre, _gate(z, f))
    if passing is not None:
        del out["dprev_states"]  # formed and consumed in the walk
        out["passing"] = passing
    return out


# --------------------------------------------------------------------------------------
# The composition
# --------------------------------------------------------------------------------------


class StageBackwards(NamedTuple):
    """One implementation of each stage's backward, each with the arguments and result of its
    ``*_backward_torch`` function: the table :func:`ssd_chunked_backward` composes. ``fold``,
    where not None, takes the place of ``chunk_scan`` and ``chunk_state``: chunk_scan's
    arguments plus ``walk`` and ``dx_dtype``, as :func:`chunk_scan_backward_cutile` takes them to
    fold chunk_state's backward into its kernels."""

    chunk_scan: Callable
    state_passing: Callable
    chunk_state: Callable
    chunk_cumsum: Callable
    fold: Callable | None = None


#: Every stage in PyTorch: the CPU's, float64's, and the path to compare the kernels with.
TORCH_BACKWARDS = StageBackwards(chunk_scan_backward_torch, state_passing_backward_torch,
                                 chunk_state_backward_torch, chunk_cumsum_backward_torch)


def cutile_backwards(fold: bool = True) -> StageBackwards:
    """Every stage's cuTile kernels (``ssd.kernels.<stage>_backward``); ``fold``: chunk_state's
    backward folded into chunk_scan's kernels (:attr:`StageBackwards.fold`), which spares the
    dstates read, x's second read and the fp32 dx round trip between the two stages
    (``python -m ssd.tools.backward_stages --dprev walk,fold`` times both). Imported on call:
    the CPU path needs no cuTile."""
    from .kernels.chunk_cumsum_backward import chunk_cumsum_backward_cutile
    from .kernels.chunk_state_backward import chunk_state_backward_cutile
    from .kernels.state_passing_backward import state_passing_backward_cutile

    return StageBackwards(chunk_scan_backward_cutile, state_passing_backward_cutile,
                          chunk_state_backward_cutile, chunk_cumsum_backward_cutile,
                          chunk_scan_backward_cutile if fold else None)


def default_backwards(x: torch.Tensor) -> StageBackwards:
    """The table for x's device and dtype: :func:`cutile_backwards` on a CUDA device, where the
    compute dtype is float32 (the kernels compute in fp32); :data:`TORCH_BACKWARDS` otherwise
    (the CPU, float64)."""
    if x.device.type == "cuda" and compute_dtype(x) == torch.float32:
        return cutile_backwards()
    return TORCH_BACKWARDS


def ssd_chunked_backward(dy, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                         initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, INF), *, dfinal_states=None, dt_out=None,
                         dA_cumsum=None, prev_states=None, backwards: StageBackwards | None = None,
                         dx_dtype=None):
    """The gradients of the chunked SSD: its four stages differentiated in reverse
    (``ssd.reference_backward.ssd_chunked_backward`` on tensors), each stage's backward taken
    from ``backwards``.

    Args:
        dy: (b, l, h, p) gradient of y, or None (0: only final_states is used).
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
            dt_limit: the forward's arguments.
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
        dt_out, dA_cumsum: the forward's (b, h, c, q) stage-1 outputs; None recomputes them
            (both or neither).
        prev_states: the forward's (b, c, h, p, n) entering states; None recomputes them
            (chunk_state and state_passing in PyTorch).
        backwards: the stage implementations (None: :func:`default_backwards` of x;
            :data:`TORCH_BACKWARDS` forces PyTorch).
        dx_dtype: dx's dtype (None: the compute dtype); the autograd Function asks for x's, which
            the last stage to add to dx then writes directly.
    Returns:
        dict of gradients in the compute dtype (:func:`compute_dtype`; dx in dx_dtype): dx, ddt,
        dA, dB, dC and, where given, dD, dz, ddt_bias, dinitial_states (the reference's keys
        and order).
    """
    f = compute_dtype(x)
    stage = backwards or default_backwards(x)
    if dy is None:
        dy = torch.zeros(x.shape, dtype=f, device=x.device)
    if dt_out is None or dA_cumsum is None:
        dt_out, dA_cumsum = chunk_cumsum_torch(dt, A, chunk_size, dt_bias, dt_softplus,
                                               dt_limit, f)
    if prev_states is None:
        states = chunk_state_torch(B, x, dt_out, dA_cumsum.to(f), seq_idx)
        prev_states, _ = state_passing_torch(states, dA_cumsum.to(f), initial_states, seq_idx)
        del states
    def walk(dprev_states):  # 3. state_passing: back over the chunks, from dfinal_states
        return stage.state_passing(dprev_states, prev_states, dA_cumsum, initial_states, seq_idx,
                                   dfinal_states=dfinal_states,
                                   dstates_dtype=x.dtype)  # what chunk_state's MMAs read

    if stage.fold is not None:  # 4, 3 and 2 in one call: the walk, then both stages' kernels
        scan = stage.fold(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx, walk=walk,
                          dx_dtype=dx_dtype)
        passing = scan.pop("passing")  # chunk_state's parts are in chunk_scan's gradients
        ddt_out, ddA_cumsum = scan["ddt_out"], scan["ddA_cumsum"] + passing["ddA_cumsum"]
        dx, dB = scan["dx"], scan["dB"]
    else:
        # 4. chunk_scan: the outputs' gradients reach x, B, C, D, z, dt', dA_cumsum and the
        #    entering states
        scan = stage.chunk_scan(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx)
        passing = walk(scan.pop("dprev_states"))
        # 2. chunk_state: each chunk's state gradient reaches its x, B, dt' and dA_cumsum; its
        #    kernel adds chunk_scan's dx and writes the sum in dx_dtype (no sum, no cast pass)
        state = stage.chunk_state(passing["dstates"], B, x, dt_out, dA_cumsum, seq_idx,
                                  dx_prior=scan.pop("dx"), dx_dtype=dx_dtype)
        ddt_out = scan["ddt_out"] + state["ddt_out"]
        ddA_cumsum = scan["ddA_cumsum"] + passing["ddA_cumsum"] + state["ddA_cumsum"]
        dx, dB = state["dx"], scan["dB"] + state["dB"]
    # 1. chunk_cumsum: every stage's dt' and dA_cumsum gradients, back to dt, A, dt_bias
    cumsum = stage.chunk_cumsum(ddt_out, ddA_cumsum, dt, A, chunk_size, dt_bias, dt_softplus,
                                dt_limit, dt_out=dt_out)
    out = {"dx": dx, "ddt": cumsum["ddt"], "dA": cumsum["dA"], "dB": dB, "dC": scan["dC"]}
    for key, value in (("dD", scan.get("dD")), ("dz", scan.get("dz")),
                       ("ddt_bias", cumsum.get("ddt_bias")),
                       ("dinitial_states", passing.get("dinitial_states"))):
        if value is not None:
            out[key] = value
    return out


def ssd_chunked_backward_torch(dy, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                               initial_states=None, seq_idx=None, dt_softplus=False,
                               dt_limit=(0.0, INF), *, dfinal_states=None, dt_out=None,
                               dA_cumsum=None, prev_states=None):
    """:func:`ssd_chunked_backward` with every stage in PyTorch (:data:`TORCH_BACKWARDS`), on
    any device: same arguments and result."""
    return ssd_chunked_backward(
        dy, x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
        dt_limit, dfinal_states=dfinal_states, dt_out=dt_out, dA_cumsum=dA_cumsum,
        prev_states=prev_states, backwards=TORCH_BACKWARDS)
