"""The decode step, state_update: one token advances each sequence's state, in place.

For every (batch entry b, head h) and channel i of the head, with the state row r of b (b
itself, or ``state_batch_indices[b]`` in a paged cache)::

    dt'     = dt[b, h, i] + dt_bias[h, i]          (softplus where <= 20; clamp if asked)
    state[r, h, i, :] <- exp(dt' A[h, i, :]) state[r, h, i, :] + dt' x[b, h, i] B[b, g(h), :]
    y[b, h, i] = state[r, h, i, :] . C[b, g(h), :] + D[h, i] x[b, h, i]   (* silu(z[b, h, i]))

This is one step of the recurrence (:func:`ssd.reference.recurrence_step`): the work is a few
FLOPs per state element, so the kernel is bound by moving the state, which it reads once and
writes once. A block owns ``block_p`` channels of one head with the whole state width n in its
tile; everything is computed in fp32 in registers, the state stored back in its own dtype and y
computed from the fp32 state before that rounding.

dt, dt_bias, D and A come per channel or per head. A per-head one reaches the kernel as an axis
of extent 1 (the launcher drops the broadcast axis of a stride-0 view, as mamba_ssm's Mamba-2
layer passes them), and its ``*_W`` constant is 1: the block loads one value and the tile
arithmetic broadcasts it, so the per-head decay is one exp2 a block, not one a state element.
"""

import functools
import math

import cuda.tile as ct

from ..config import StateUpdateConfig, next_pow2, state_update_config
from ..launch import array_type, index_dtype_for, launch, optional
from .tiles import LOG2E, ZERO, ConstBool, ConstInt, softplus


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None):
    """The state_update kernel with arrays indexed by ``index_dtype`` (int64 only for huge
    states)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def state_update_kernel(
        state: Array,      # (s, h, p, n), updated in place
        x: Array,          # (b, h, p)
        dt: Array,         # (b, h, p) per channel, or (b, h, 1) per head
        dt_bias: Array,    # (h, p) or (h, 1) (ignored unless HAS_BIAS)
        A: Array,          # (h, p or 1, n or 1)
        B: Array,          # (b, g, n)
        C: Array,          # (b, g, n)
        D: Array,          # (h, p) or (h, 1) (ignored unless HAS_D)
        z: Array,          # (b, h, p) (ignored unless HAS_Z)
        slots: Array,      # (b,) int: each entry's state row, negative for padding (HAS_SLOTS)
        y: Array,          # (b, h, p) out
        heads_per_group: int,
        dt_min: float,
        dt_max: float,
        BLOCK_P: ConstInt,
        N_PAD: ConstInt,   # n rounded up to a power of two
        DT_W: ConstInt,    # BLOCK_P per channel, 1 per head; likewise the next three
        BIAS_W: ConstInt,
        D_W: ConstInt,
        A_WP: ConstInt,
        A_WN: ConstInt,    # N_PAD where A varies along n, else 1
        HAS_BIAS: ConstBool,
        SOFTPLUS: ConstBool,
        HAS_D: ConstBool,
        HAS_Z: ConstBool,
        HAS_SLOTS: ConstBool,
    ):
        """Grid: (b, h, cdiv(p, BLOCK_P)); one block advances one [BLOCK_P, n] state slice."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2)
        ig = ih // heads_per_group
        row = ib
        if HAS_SLOTS:
            row = ct.load(slots, index=(ib,), shape=()).astype(ct.int32)
            if row < 0:  # a padding entry: no state row is its own; y = 0, as mamba_ssm
                ct.store(y, index=(ib, ih, ip), tile=ct.zeros((1, 1, BLOCK_P), dtype=y.dtype))
                return
        # The state slice, the one large load: rows past p and columns past n read as 0 and
        # are never stored.
        h0 = ct.load(state, index=(row, ih, ip, 0), shape=(1, 1, BLOCK_P, N_PAD),
                     padding_mode=ZERO).reshape((BLOCK_P, N_PAD)).astype(ct.float32)
        x_t = ct.load(x, index=(ib, ih, ip), shape=(1, 1, BLOCK_P),
                      padding_mode=ZERO).reshape((BLOCK_P, 1)).astype(ct.float32)  # [P, 1]
        # dt' per channel [P, 1] or per head [1, 1]; a width-1 axis is read at index 0.
        d = ct.load(dt, index=(ib, ih, ip if DT_W > 1 else 0), shape=(1, 1, DT_W),
                    padding_mode=ZERO).reshape((DT_W, 1)).astype(ct.float32)
        if HAS_BIAS:
            bias = ct.load(dt_bias, index=(ih, ip if BIAS_W > 1 else 0), shape=(1, BIAS_W),
                           padding_mode=ZERO).reshape((BIAS_W, 1)).astype(ct.float32)
            d = d + bias
        if SOFTPLUS:
            d = softplus(d)
        d = ct.minimum(ct.maximum(d, dt_min), dt_max)  # (-inf, inf) unless the caller clamps
        a = ct.load(A, index=(ih, ip if A_WP > 1 else 0, 0), shape=(1, A_WP, A_WN),
                    padding_mode=ZERO).reshape((A_WP, A_WN)).astype(ct.float32)
        # exp(dt' A) as exp2, the native unit: [1, 1] per head, up to [P, N] per channel
        decay = ct.exp2(d * a * LOG2E)
        b_t = ct.load(B, index=(ib, ig, 0), shape=(1, 1, N_PAD),
                      padding_mode=ZERO).reshape((1, N_PAD)).astype(ct.float32)
        c_t = ct.load(C, index=(ib, ig, 0), shape=(1, 1, N_PAD),
                      padding_mode=ZERO).reshape((1, N_PAD)).astype(ct.float32)
        h1 = h0 * decay + (d * x_t) * b_t  # [P, N] fp32
        ct.store(state, index=(row, ih, ip, 0),
                 tile=h1.astype(state.dtype).reshape((1, 1, BLOCK_P, N_PAD)))
        # y from the fp32 state, before its rounding to the stored dtype
        out = ct.sum(h1 * c_t, axis=1, keepdims=True)  # [P, 1]
        if HAS_D:
            skip = ct.load(D, index=(ih, ip if D_W > 1 else 0), shape=(1, D_W),
                           padding_mode=ZERO).reshape((D_W, 1)).astype(ct.float32)
            out = out + skip * x_t
        if HAS_Z:
            z_t = ct.load(z, index=(ib, ih, ip), shape=(1, 1, BLOCK_P),
                          padding_mode=ZERO).reshape((BLOCK_P, 1)).astype(ct.float32)
            out = out * z_t / (1.0 + ct.exp(-z_t))  # y * silu(z)
        ct.store(y, index=(ib, ih, ip), tile=out.reshape((1, 1, BLOCK_P)).astype(y.dtype))

    return state_update_kernel


def _per_head(t, lead: int, full_ndim: int):
    """``t`` as the kernel reads it: a per-head form (fewer dimensions than ``full_ndim``) gets
    trailing axes of extent 1, and a trailing axis (past the ``lead`` batch and head axes) along
    which a full-form view does not move (stride 0, an ``expand``) is cut to extent 1, so the
    kernel loads one value instead of a row of copies. The kernel's width constant of each
    trailing axis is then its extent > 1. An axis of extent 1 gets stride 1 (any stride reads
    the same element): the compact and the expanded form then compile to one kernel, and no
    array reaches cuTile with a stride of 0."""
    while t.dim() < full_ndim:
        t = t.unsqueeze(-1)
    for axis in range(lead, full_ndim):
        if t.stride(axis) == 0 and t.shape[axis] > 1:
            t = t.narrow(axis, 0, 1)
    return t.as_strided(t.shape, [1 if n == 1 else s for n, s in zip(t.shape, t.stride())])


def state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                 state_batch_indices=None, dt_limit=None,
                 config: StateUpdateConfig = StateUpdateConfig(), out=None):
    """Launch the decode step (arguments as checked by :func:`ssd.decode.validate_step`).

    Args:
        state: (b, h, p, n), or (s, h, p, n) with state_batch_indices; fp32 / bf16 / fp16,
            last dimension contiguous; updated in place.
        x: (b, h, p). dt: (b, h, p) or (b, h). A: (h, p, n) or (h,). B, C: (b, g, n).
        D, dt_bias: optional (h, p) or (h,). z: optional (b, h, p).
        dt_softplus: softplus(dt + dt_bias). dt_limit: optional clamp (lo, hi) after it.
        state_batch_indices: optional (b,) int32 / int64 state rows; negative: padding.
        config: ``block_p`` (None: :func:`ssd.config.state_update_config`'s without a GPU's SM
            count) and the occupancy hint.
        out: optional preallocated y, (b, h, p) of x's dtype (tests poison it).
    Returns:
        y (b, h, p) in x's dtype.
    """
    import torch

    b, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    dev = x.device
    y = torch.empty_like(x) if out is None else out
    block_p = state_update_config(config, (b, h, p, n), state.element_size()).block_p
    n_pad = next_pow2(n)
    dt_k = _per_head(dt, 2, 3)  # (b, h, p or 1)
    A_k = _per_head(A, 1, 3)  # (h, p or 1, n or 1)
    bias_k = None if dt_bias is None else _per_head(dt_bias, 1, 2)  # (h, p or 1)
    D_k = None if D is None else _per_head(D, 1, 2)
    width = lambda t, pad: 1 if t is None or t.shape[-1] == 1 else pad  # noqa: E731
    lo, hi = (-math.inf, math.inf) if dt_limit is None else (float(v) for v in dt_limit)
    kernel = build_kernel(index_dtype_for(state, x, z, y), config.occupancy)
    launch(kernel, (b, h, -(-p // block_p)), dict(
        state=state, x=x, dt=dt_k, dt_bias=optional(bias_k, 2, torch.float32, dev), A=A_k,
        B=B, C=C, D=optional(D_k, 2, torch.float32, dev), z=optional(z, 3, x.dtype, dev),
        slots=optional(state_batch_indices, 1, torch.int32, dev), y=y,
        heads_per_group=h // g, dt_min=lo, dt_max=hi, BLOCK_P=block_p, N_PAD=n_pad,
        DT_W=width(dt_k, block_p), BIAS_W=width(bias_k, block_p), D_W=width(D_k, block_p),
        A_WP=block_p if A_k.shape[1] > 1 else 1, A_WN=width(A_k, n_pad),
        HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), HAS_D=D is not None,
        HAS_Z=z is not None, HAS_SLOTS=state_batch_indices is not None), device=dev)
    return y
