"""NumPy references for the Mamba-2 layer's operations around the SSD, in float64.

The mixer of :mod:`ssd.layer` runs, besides its two projections and the SSD, two operations that
:mod:`ssd.kernels.causal_conv1d` and :mod:`ssd.kernels.gated_rmsnorm` implement in cuTile; these
are their slow truths, computed in float64 whatever the input dtype:

* :func:`causal_conv1d` -- the depthwise causal convolution over time of xBC, with bias and
  SiLU, in the layout in_proj writes it, (b, l, c) with the channels innermost:

      out[b, t, c] = silu(bias[c] + sum_k weight[c, k] * x[b, t - (w - 1) + k, c])

  where x before the sequence start is 0, or the initial conv state; with ``seq_idx`` the
  history is also zero across a sequence boundary inside a row (packed sequences).
* :func:`conv_step` -- the same convolution one token further in generation: the conv state
  holds the w - 1 previous inputs, and the step is :func:`causal_conv1d` of one position with
  that state as its initial state (:func:`conv_step_torch`: the same step in PyTorch, what the
  layer runs with ``kernels="torch"``; :mod:`ssd.kernels.conv_step` is the cuTile one).
* :func:`gated_rmsnorm` -- Mamba-2's gated RMSNorm with the gate before the norm (mamba_ssm's
  ``RMSNormGated(norm_before_gate=False)``), per group of ``group_size`` channels:

      v = y * silu(z);  out = v / sqrt(mean_group(v^2) + eps) * weight

Legend as in :mod:`ssd.reference`: b batch, l seqlen; c channels (conv_dim = d_inner + 2 g n in
the layer), w the kernel width (Mamba-2's d_conv), d = d_inner the normalised width.

The shape contracts (:func:`conv1d_dims`, :func:`conv_step_dims`, :func:`norm_dims`) are shared with the torch
entry points of :mod:`ssd.layer_ops`, so a bad shape reads the same on the CPU and the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from .reference import check_inputs, silu

__all__ = ["conv1d_dims", "conv_step_dims", "norm_dims", "causal_conv1d", "conv_step",
           "conv_step_torch", "gated_rmsnorm"]


def _shape_of(name, shape, ndim, what):
    if shape is None or len(shape) != ndim:
        raise ValueError(f"{name}: expected {what}, got shape {None if shape is None else tuple(shape)}")
    return tuple(int(s) for s in shape)


def conv1d_dims(*, x, weight, bias=None, seq_idx=None, initial_states=None) -> tuple:
    """(b, l, c, w) from the shapes of :func:`causal_conv1d`'s arguments (None: absent).

    Raises ValueError naming the argument whose shape does not fit."""
    b, l, c = _shape_of("x", x, 3, "(batch, seqlen, channels)")
    if b < 1 or l < 1 or c < 1:
        raise ValueError(f"x: expected a non-empty (batch, seqlen, channels), got {tuple(x)}")
    c_w, w = _shape_of("weight", weight, 2, f"(channels={c}, width)")
    if c_w != c or w < 1:
        raise ValueError(f"weight: expected (channels={c}, width >= 1), got {tuple(weight)}")
    if bias is not None and tuple(bias) != (c,):
        raise ValueError(f"bias: expected ({c},), got {tuple(bias)}")
    if seq_idx is not None and tuple(seq_idx) != (b, l):
        raise ValueError(f"seq_idx: expected (batch={b}, seqlen={l}), got {tuple(seq_idx)}")
    if initial_states is not None and tuple(initial_states) != (b, c, w - 1):
        raise ValueError(f"initial_states: expected (batch={b}, channels={c}, width-1={w - 1}), "
                         f"got {tuple(initial_states)}")
    return b, l, c, w


def conv_step_dims(*, conv_state, x, weight, bias=None, state_batch_indices=None) -> tuple:
    """(b, c, w) from the shapes of :func:`conv_step`'s arguments (bias None: absent). With
    ``state_batch_indices`` (b,) (the kernel's paged cache), conv_state may hold any number of
    rows, (s, c, w-1).

    Raises ValueError naming the argument whose shape does not fit."""
    b, c = _shape_of("x", x, 2, "(batch, channels)")
    if b < 1 or c < 1:
        raise ValueError(f"x: expected a non-empty (batch, channels), got {tuple(x)}")
    c_w, w = _shape_of("weight", weight, 2, f"(channels={c}, width)")
    if c_w != c or w < 1:
        raise ValueError(f"weight: expected (channels={c}, width >= 1), got {tuple(weight)}")
    if bias is not None and tuple(bias) != (c,):
        raise ValueError(f"bias: expected ({c},), got {tuple(bias)}")
    if state_batch_indices is None:
        if conv_state is None or tuple(conv_state) != (b, c, w - 1):
            raise ValueError(f"conv_state: expected (batch={b}, channels={c}, width-1={w - 1}), "
                             f"got {None if conv_state is None else tuple(conv_state)}")
        return b, c, w
    if tuple(state_batch_indices) != (b,):
        raise ValueError(f"state_batch_indices: expected (batch={b},), got "
                         f"{tuple(state_batch_indices)}")
    if conv_state is None or len(conv_state) != 3 or conv_state[0] < 1 \
            or tuple(conv_state[1:]) != (c, w - 1):
        raise ValueError(f"conv_state: expected (rows >= 1, channels={c}, width-1={w - 1}) with "
                         f"state_batch_indices, got "
                         f"{None if conv_state is None else tuple(conv_state)}")
    return b, c, w


def norm_dims(*, y, z, weight, group_size=None) -> tuple:
    """(m, d, g, group_size) from the shapes of :func:`gated_rmsnorm`'s arguments: m rows (the
    product of y's leading axes), d channels, g groups of ``group_size`` (None: one group).

    Raises ValueError naming the argument whose shape or value does not fit."""
    if y is None or len(y) < 1 or int(y[-1]) < 1:
        raise ValueError(f"y: expected (..., channels) with channels >= 1, got {y}")
    d = int(y[-1])
    if z is None or tuple(z) != tuple(y):
        raise ValueError(f"z: expected y's shape {tuple(y)}, got {None if z is None else tuple(z)}")
    if weight is None or tuple(weight) != (d,):
        raise ValueError(f"weight: expected ({d},), got {None if weight is None else tuple(weight)}")
    group_size = d if group_size is None else group_size
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1 \
            or d % group_size:
        raise ValueError(f"group_size: expected a positive divisor of the {d} channels, "
                         f"got {group_size!r}")
    m = int(np.prod(y[:-1], dtype=np.int64))
    if m < 1:
        raise ValueError(f"y: expected at least one row, got shape {tuple(y)}")
    return m, d, d // group_size, group_size


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, activation="silu"):
    """Depthwise causal conv1d over time with bias and optional SiLU, in float64.

    What the layer's PyTorch path computes (``nn.Conv1d(groups=c, padding=w-1)`` over the
    transposed xBC, the first l outputs kept, then SiLU), extended by two inputs a server needs:

    * ``initial_states`` (b, c, w-1): the w-1 inputs before the sequence start, oldest first
      (mamba_ssm's conv state), in place of zeros;
    * ``seq_idx`` (b, l) int, >= 0 and non-decreasing: a row packs several sequences, and a tap that
      reaches back across a change of seq_idx reads 0. As in the SSD (:mod:`ssd.reference`), the
      positions before the row start carry a virtual seq_idx 0, so the initial state feeds the
      first sequence only where ``seq_idx[b, 0] == 0``.

    Args:
        x: (b, l, c); weight: (c, w); bias: optional (c,).
        seq_idx: optional (b, l) int; initial_states: optional (b, c, w-1).
        activation: "silu" (or its other name "swish") or None.
    Returns:
        out: (b, l, c) float64.
    """
    shapes = {k: None if v is None else np.shape(v) for k, v in dict(
        x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states).items()}
    b, l, c, w = conv1d_dims(**shapes)
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    x = np.asarray(x, dtype=np.float64)
    weight = np.asarray(weight, dtype=np.float64)
    # The w-1 inputs before t = 0 and the sequence ids along the extended time axis.
    history = (np.zeros((b, w - 1, c)) if initial_states is None
               else np.asarray(initial_states, dtype=np.float64).transpose(0, 2, 1))
    xe = np.concatenate([history, x], axis=1)  # (b, w-1+l, c): xe[:, w-1+t] = x[:, t]
    seq = (np.zeros((b, l), dtype=np.int64) if seq_idx is None
           else check_inputs(seq_idx=seq_idx)[0]["seq_idx"])  # int, >= 0, non-decreasing
    seq_e = np.concatenate([np.zeros((b, w - 1), dtype=np.int64), seq], axis=1)  # virtual 0
    out = np.zeros((b, l, c)) if bias is None else np.broadcast_to(
        np.asarray(bias, dtype=np.float64), (b, l, c)).copy()
    for k in range(w):  # tap k reads position t - (w-1) + k, i.e. xe[:, t + k]
        same = (seq_e[:, k:k + l] == seq)[..., None]  # (b, l, 1): no boundary crossed
        out += weight[:, k] * np.where(same, xe[:, k:k + l], 0.0)
    return silu(out) if activation else out


def gated_rmsnorm(y, z, weight, group_size=None, eps=1e-5):
    """Mamba-2's gated RMSNorm, gate before the norm, per group of ``group_size`` channels:
    ``v = y * silu(z)``, ``out = v / sqrt(mean(v^2 over the group) + eps) * weight``, in float64.

    Args:
        y, z: (..., d); weight: (d,); group_size: divides d (None: d, one group); eps > 0.
    Returns:
        out: (..., d) float64.
    """
    norm_dims(y=np.shape(y), z=np.shape(z), weight=np.shape(weight), group_size=group_size)
    y, z, weight = (np.asarray(a, dtype=np.float64) for a in (y, z, weight))
    d = y.shape[-1]
    group_size = group_size or d
    v = (y * silu(z)).reshape(*y.shape[:-1], d // group_size, group_size)  # (..., g, group)
    v = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
    return v.reshape(y.shape) * weight


def conv_step(conv_state, x, weight, bias=None, activation="silu"):
    """One token through the depthwise causal conv1d, in float64: the decode step of
    :func:`causal_conv1d`.

        out[b, c] = silu(bias[c] + sum_k weight[c, k] * [conv_state[b, c, :], x[b, c]][k])

    Args:
        conv_state: (b, c, w-1), the w-1 inputs before this token, oldest first (the form of
            :func:`causal_conv1d`'s initial_states).
        x: (b, c), this token's input; weight: (c, w); bias: optional (c,).
        activation: "silu" (or "swish") or None.
    Returns:
        (out (b, c) float64, the next conv state (b, c, w-1) float64: the oldest input dropped,
        x appended). ``conv_state`` itself is not modified.
    """
    conv_step_dims(conv_state=np.shape(conv_state), x=np.shape(x), weight=np.shape(weight),
                   bias=None if bias is None else np.shape(bias))
    x = np.asarray(x, dtype=np.float64)
    state = np.asarray(conv_state, dtype=np.float64)
    out = causal_conv1d(x[:, None, :], weight, bias, initial_states=state,
                        activation=activation)[:, 0]
    window = np.concatenate([state, x[..., None]], axis=-1)  # (b, c, w): oldest first
    return out, window[..., 1:]


def conv_step_torch(conv_state, x, weight, bias=None, activation="silu"):
    """One token through the depthwise causal conv1d, in plain PyTorch: the decode step of
    :func:`ssd.layer.causal_conv1d_torch` (the layer's ``kernels="torch"``; with
    ``kernels="cutile"`` :func:`ssd.layer_ops.conv_step` launches the cuTile step). Computes in
    fp32 (fp64 for fp64) and rounds once, as :func:`conv_step` does in float64.

    Args:
        conv_state: (b, c, w-1) of x's dtype, the w-1 previous inputs, oldest first; updated
            in place: the oldest dropped, x appended.
        x: (b, c), this token's input (in the layer, the xBC columns of in_proj's output).
        weight: (c, w); bias: optional (c,); activation: "silu" (or "swish") or None.
    Returns:
        (b, c) in x's dtype.
    """
    conv_step_dims(**{k: None if t is None else tuple(t.shape) for k, t in dict(
        conv_state=conv_state, x=x, weight=weight, bias=bias).items()})
    if conv_state.dtype != x.dtype:
        raise TypeError(f"conv_state: dtype {conv_state.dtype}, expected x's {x.dtype} (it holds "
                        "earlier inputs exactly)")
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    window = torch.cat([conv_state.to(f), x.to(f)[..., None]], dim=-1)  # (b, c, w): t-w+1 .. t
    out = (window * weight.to(f)).sum(-1)  # (b, c)
    if bias is not None:
        out = out + bias.to(f)
    conv_state.copy_(window[..., 1:])  # exact: the values came from x's dtype
    return (torch.nn.functional.silu(out) if activation else out).to(x.dtype)
