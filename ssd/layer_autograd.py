"""The layer's conv and norm as ``torch.autograd.Function``s: the forward and the backward
injected (cuTile kernels on a GPU, PyTorch on the CPU).

:class:`CausalConv1d` and :class:`GatedRMSNorm` run an injected forward (the cuTile launchers of
:mod:`ssd.layer_ops` on a GPU; in the CPU tests :func:`causal_conv1d_torch` and
:func:`gated_rmsnorm_torch`, the same maths in PyTorch) and differentiate it with
:func:`causal_conv1d_backward` and :func:`gated_rmsnorm_backward` (on a GPU the backward
kernels of :mod:`ssd.kernels.causal_conv1d` and :mod:`ssd.kernels.gated_rmsnorm`, checked
against these), written from the maths below and checked against ``torch.autograd`` of the
layer's PyTorch path in float64 (tests/test_layer_kernels.py). :mod:`ssd.layer_ops` routes a
call through them only where a gradient is required, so an inference call saves nothing and
runs the kernel alone.

The gradients (per element; sums run over every index the left side does not carry)
-------------------------------------------------------------------------------------
causal_conv1d, with xe = [initial_states (or 0), x] along time, m_k[b, t] = 1 unless tap k
crosses a change of seq_idx, s the pre-activation and out = silu(s)::

    s[b, t, c]   = bias[c] + sum_k weight[c, k] m_k[b, t] xe[b, t + k, c]
    ds           = dout * silu'(s),   silu'(s) = sigmoid(s) (1 + s (1 - sigmoid(s)))
    dbias[c]     = sum_{b,t} ds[b, t, c]
    dweight[c, k] = sum_{b,t} ds[b, t, c] m_k[b, t] xe[b, t + k, c]
    dxe[b, t + k, c] += ds[b, t, c] m_k[b, t] weight[c, k]     (dx and d initial_states: its parts)

gated_rmsnorm, per group of G channels, v = y silu(z), r = (mean(v^2) + eps)^-1/2, n = v r,
out = n weight::

    dweight = sum_rows dout n;   dn = dout weight
    dv = r (dn - n mean(dn n))                  (the RMSNorm backward)
    dy = dv silu(z);   dz = dv y silu'(z)

Saved versus recomputed
-----------------------
* :class:`CausalConv1d` saves its inputs only (references to the caller's tensors: x is the xBC
  column view of in_proj's output, which ``nn.Conv1d``'s backward holds as well). The backward
  recomputes the pre-activation s (b, l, c) in fp32 from them, the w multiply-adds an element of
  the forward again, instead of holding an fp32 (b, l, c) tensor (twice xBC's bytes in bf16)
  from the forward to the backward: SiLU's slope needs s, and the kernel writes only silu(s).
* :class:`GatedRMSNorm` saves y, z and the weight; the backward recomputes v = y silu(z) and
  each group's r from them in the one pass over y and z it makes anyway, so nothing of y's size
  is kept between the passes.

Gradients come back in each input's dtype, computed in fp32 (fp64 for fp64 inputs, the CPU
tests); the backwards are differentiable once (no second derivatives). seq_idx has no gradient.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

__all__ = ["CausalConv1d", "GatedRMSNorm", "causal_conv1d", "gated_rmsnorm",
           "causal_conv1d_torch", "gated_rmsnorm_torch", "causal_conv1d_backward",
           "gated_rmsnorm_backward", "conv1d_preactivation"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _silu_slope(s):
    """d silu(s) / ds = sigmoid(s) (1 + s (1 - sigmoid(s)))."""
    sig = torch.sigmoid(s)
    return sig * (1.0 + s * (1.0 - sig))


# ----------------------------------------------------------------------------- causal_conv1d


def _extended(x, initial_states, width: int, f):
    """xe (b, w-1+l, c) in ``f``: the w-1 inputs before t = 0 (initial_states transposed, or
    0), then x; xe[:, w-1+t] = x[:, t]."""
    b, _, c = x.shape
    history = (torch.zeros(b, width - 1, c, dtype=f, device=x.device) if initial_states is None
               else initial_states.to(f).transpose(1, 2))
    return torch.cat([history, x.to(f)], dim=1)


def _tap_masks(seq_idx, width: int):
    """Per tap k, (b, l, 1) bool: tap k of position t reads position t-(w-1)+k of the same
    sequence (the positions before 0 count as sequence 0); None without seq_idx."""
    if seq_idx is None:
        return [None] * width
    b, l = seq_idx.shape
    se = torch.cat([seq_idx.new_zeros(b, width - 1), seq_idx], dim=1)  # (b, w-1+l)
    return [(se[:, k:k + l] == seq_idx)[..., None] for k in range(width)]


def conv1d_preactivation(x, weight, bias=None, seq_idx=None, initial_states=None):
    """s = bias + the causal taps, (b, l, c) in fp32 (fp64 for fp64 x), before the activation.

    Args as :func:`ssd.layer_ops.causal_conv1d`: x (b, l, c), weight (c, w), bias optional (c,),
    seq_idx optional (b, l) int, initial_states optional (b, c, w-1)."""
    b, l, c = x.shape
    w = weight.shape[1]
    f = _compute_dtype(x)
    xe = _extended(x, initial_states, w, f)
    s = torch.zeros(b, l, c, dtype=f, device=x.device) if bias is None else bias.to(f).expand(
        b, l, c)
    for k, mask in enumerate(_tap_masks(seq_idx, w)):  # tap k reads xe[:, t + k]
        tap = xe[:, k:k + l]
        s = s + weight[:, k].to(f) * (tap if mask is None else tap.masked_fill(~mask, 0.0))
    return s


def causal_conv1d_torch(x, weight, bias=None, seq_idx=None, initial_states=None,
                        activation="silu"):
    """The conv's forward in PyTorch, one rounding to x's dtype: the CPU stand-in for the
    kernel (the forward the Function's CPU tests inject). (b, l, c) in x's dtype."""
    s = conv1d_preactivation(x, weight, bias, seq_idx, initial_states)
    return (torch.nn.functional.silu(s) if activation else s).to(x.dtype)


def causal_conv1d_backward(dout, x, weight, bias=None, seq_idx=None, initial_states=None,
                           activation="silu") -> dict:
    """The gradients of the conv (module docstring), from the forward's inputs and dout.

    Args:
        dout: (b, l, c), the gradient of the output; the rest as :func:`conv1d_preactivation`.
    Returns:
        dict of dx (b, l, c), dweight (c, w), dbias (c,) or None, dinitial_states (b, c, w-1)
        or None, each in fp32 (fp64 for fp64 x).
    """
    b, l, c = x.shape
    w = weight.shape[1]
    f = _compute_dtype(x)
    ds = dout.to(f)
    if activation:
        ds = ds * _silu_slope(conv1d_preactivation(x, weight, bias, seq_idx, initial_states))
    xe = _extended(x, initial_states, w, f)
    dxe = torch.zeros_like(xe)
    dweight = torch.empty(c, w, dtype=f, device=x.device)
    for k, mask in enumerate(_tap_masks(seq_idx, w)):
        dsk = ds if mask is None else ds.masked_fill(~mask, 0.0)  # (b, l, c)
        dweight[:, k] = (dsk * xe[:, k:k + l]).sum((0, 1))
        dxe[:, k:k + l] += dsk * weight[:, k].to(f)
    return dict(dx=dxe[:, w - 1:], dweight=dweight,
                dbias=None if bias is None else ds.sum((0, 1)),
                dinitial_states=None if initial_states is None
                else dxe[:, :w - 1].transpose(1, 2))


class ConvOptions(NamedTuple):
    """The non-tensor arguments of one conv call, and the forward to run."""

    activation: str | None
    #: (x, weight, bias, seq_idx, initial_states, activation) -> (b, l, c) in x's dtype, on
    #: tensors that do not require grad
    forward: Callable
    #: (dout, x, weight, bias, seq_idx, initial_states, activation) -> dict of dx, dweight,
    #: dbias, dinitial_states (any float dtype, None where not given), on tensors that do not
    #: require grad
    backward: Callable


class CausalConv1d(torch.autograd.Function):
    """(opts, x, weight, bias, initial_states, seq_idx) -> out (b, l, c); the gradients of x,
    weight, bias and initial_states."""

    @staticmethod
    def forward(ctx, opts: ConvOptions, x, weight, bias, initial_states, seq_idx):
        # detached views (no copy): a kernel launch takes its arrays through DLPack, which
        # refuses a tensor that requires grad
        bare = [None if t is None else t.detach() for t in (x, weight, bias, initial_states)]
        out = opts.forward(bare[0], bare[1], bare[2], seq_idx, bare[3], opts.activation)
        ctx.save_for_backward(x, weight, bias, initial_states, seq_idx)
        ctx.opts = opts
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        x, weight, bias, initial_states, seq_idx = ctx.saved_tensors
        bare = [None if t is None else t.detach() for t in (x, weight, bias, initial_states)]
        grads = ctx.opts.backward(dout, bare[0], bare[1], bare[2], seq_idx, bare[3],
                                  ctx.opts.activation)
        out = [grads[k].to(t.dtype) if t is not None and ctx.needs_input_grad[i + 1] else None
               for i, (k, t) in enumerate((("dx", x), ("dweight", weight), ("dbias", bias),
                                           ("dinitial_states", initial_states)))]
        return (None, *out, None)


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, activation="silu",
                  *, forward: Callable = causal_conv1d_torch,
                  backward: Callable = causal_conv1d_backward):
    """The differentiable conv: ``forward`` and ``backward`` (default the PyTorch ones; on a GPU
    :mod:`ssd.layer_ops` passes the cuTile kernels). Arguments as
    :func:`ssd.layer_ops.causal_conv1d` (not validated here). (b, l, c)."""
    return CausalConv1d.apply(ConvOptions(activation, forward, backward), x, weight, bias,
                              initial_states, seq_idx)


# ----------------------------------------------------------------------------- gated_rmsnorm


def _gate_and_norm(y, z, group_size: int, eps: float, f):
    """(silu(z), v = y silu(z), n = v r) in ``f``, v and n as (..., groups, group_size), and r
    (..., groups, 1)."""
    gate = torch.nn.functional.silu(z.to(f))
    v = (y.to(f) * gate).unflatten(-1, (-1, group_size))
    r = torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    return gate, v, v * r, r


def gated_rmsnorm_torch(y, z, weight, group_size: int, eps: float):
    """The norm's forward in PyTorch, one rounding to y's dtype: the CPU stand-in for the
    kernel. y, z (..., d), weight (d,) -> (..., d) in y's dtype."""
    f = _compute_dtype(y)
    _, _, n, _ = _gate_and_norm(y, z, group_size, eps, f)
    return (n.flatten(-2) * weight.to(f)).to(y.dtype)


def gated_rmsnorm_backward(dout, y, z, weight, group_size: int, eps: float) -> dict:
    """The gradients of the norm (module docstring), from the forward's inputs and dout.

    Args:
        dout, y, z: (..., d); weight: (d,); group_size: divides d; eps > 0.
    Returns:
        dict of dy, dz (..., d) and dweight (d,), in fp32 (fp64 for fp64 y).
    """
    f = _compute_dtype(y)
    gate, v, n, r = _gate_and_norm(y, z, group_size, eps, f)
    g = dout.to(f)
    dweight = (g * n.flatten(-2)).reshape(-1, g.shape[-1]).sum(0)
    dn = (g * weight.to(f)).unflatten(-1, (-1, group_size))
    dv = (r * (dn - n * (dn * n).mean(-1, keepdim=True))).flatten(-2)
    zf = z.to(f)
    return dict(dy=dv * gate, dz=dv * y.to(f) * _silu_slope(zf), dweight=dweight)


class NormOptions(NamedTuple):
    """The non-tensor arguments of one norm call, and the forward to run."""

    group_size: int
    eps: float
    #: (y, z, weight, group_size, eps) -> (..., d) in y's dtype, on tensors that do not
    #: require grad
    forward: Callable
    #: (dout, y, z, weight, group_size, eps) -> dict of dy, dz, dweight (any float dtype), on
    #: tensors that do not require grad
    backward: Callable


class GatedRMSNorm(torch.autograd.Function):
    """(opts, y, z, weight) -> out (..., d); the gradients of y, z and weight."""

    @staticmethod
    def forward(ctx, opts: NormOptions, y, z, weight):
        out = opts.forward(y.detach(), z.detach(), weight.detach(), opts.group_size, opts.eps)
        ctx.save_for_backward(y, z, weight)
        ctx.opts = opts
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        y, z, weight = ctx.saved_tensors
        grads = ctx.opts.backward(dout, y.detach(), z.detach(), weight.detach(),
                                  ctx.opts.group_size, ctx.opts.eps)
        return (None, *(grads[k].to(t.dtype) if ctx.needs_input_grad[i + 1] else None
                        for i, (k, t) in enumerate((("dy", y), ("dz", z), ("dweight", weight)))))


def gated_rmsnorm(y, z, weight, group_size: int, eps: float, *,
                  forward: Callable = gated_rmsnorm_torch,
                  backward: Callable = gated_rmsnorm_backward):
    """The differentiable norm: ``forward`` and ``backward`` (default the PyTorch ones; on a GPU
    :mod:`ssd.layer_ops` passes the cuTile kernels). Arguments as
    :func:`ssd.layer_ops.gated_rmsnorm` with group_size resolved (not validated here).
    (..., d)."""
    return GatedRMSNorm.apply(NormOptions(group_size, float(eps), forward, backward), y, z,
                              weight)
