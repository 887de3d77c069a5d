"""The decode step of the layer's causal conv1d: one token per sequence, the conv state rolled in
place.

For batch entry b with state row r (b itself, or ``state_batch_indices[b]`` in a paged cache)
and channel c, with the window of the w most recent inputs, oldest first::

    window[k] = conv_state[r, c, k]   (k < w - 1),   window[w - 1] = x[b, c]
    out[b, c] = silu(bias[c] + sum_k weight[c, k] * window[k])
    conv_state[r, c, :] <- window[1:]                 (the oldest input dropped)

This is :func:`ssd.kernels.causal_conv1d` one position further with the conv state as its
initial state (the float64 reference is :func:`ssd.layer_reference.conv_step`). A block owns
``block_c`` channels of one batch entry: it gathers the window as one [C, W] tile (the w - 1
state columns, x in the last), reduces it against the weights in fp32, rounds once, and scatters
the window's last w - 1 columns back one place to the left. The state is read once and written
once; the scatter consumes the tile the gather produced, so every element is read before it is
overwritten. A negative ``state_batch_indices`` entry is padding, as in the SSM's decode step
(:mod:`ssd.kernels.state_update`): its out is 0 and no state row is touched.
"""
import functools

import cuda.tile as ct

from ..config import ConvStepConfig, next_pow2
from ..launch import array_type, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The conv_step kernel with arrays indexed by ``index_dtype``."""
    Array = array_type(index_dtype)

    @ct.kernel
    def conv_step_kernel(
        conv_state: Array,  # (s, c, w-1) x's dtype, any strides; updated in place
        x: Array,           # (b, c) fp32 / bf16 / fp16, any strides
        weight: Array,      # (c, w) any float dtype
        bias: Array,        # (c,) (ignored unless HAS_BIAS)
        slots: Array,       # (b,) int: each entry's state row, negative for padding (HAS_SLOTS)
        out: Array,         # (b, c) x's dtype
        WIDTH: ConstInt,
        W_PAD: ConstInt,    # next_pow2(WIDTH): tile extents are powers of two
        BLOCK_C: ConstInt,
        HAS_BIAS: ConstBool,
        HAS_SLOTS: ConstBool,
        SILU: ConstBool,
    ):
        """Grid: (cdiv(c, BLOCK_C), b); one block per BLOCK_C channels of one batch entry."""
        jc = ct.bid(0)
        ib = ct.bid(1)
        row = ib
        if HAS_SLOTS:
            row = ct.load(slots, index=(ib,), shape=()).astype(ct.int32)
            if row < 0:  # a padding entry: no state row is its own; out = 0
                ct.store(out, index=(ib, jc), tile=ct.zeros((1, BLOCK_C), dtype=out.dtype))
                return
        cols = jc * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)  # [C]
        taps = ct.arange(W_PAD, dtype=ct.int32)  # [W]
        # The w-1 state columns; the taps from w-1 on read nothing (x and the padding).
        past = ct.gather(conv_state, (row, cols[:, None], taps[None, :]),
                         mask=(taps < WIDTH - 1)[None, :])  # [C, W] x's dtype
        x_t = ct.gather(x, (ib, cols))  # [C]; channels past c read 0
        window = ct.where((taps == WIDTH - 1)[None, :], x_t[:, None], past)  # [C, W]
        # Taps past w are out of the weight's bounds: they read 0.
        wt = ct.gather(weight, (cols[:, None], taps[None, :])).astype(ct.float32)  # [C, W]
        acc = ct.sum(window.astype(ct.float32) * wt, axis=1)  # [C] fp32
        if HAS_BIAS:
            acc = acc + ct.gather(bias, cols).astype(ct.float32)
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))  # x * sigmoid(x); exp overflows to inf -> -0
        ct.store(out, index=(ib, jc), tile=acc.astype(out.dtype).reshape((1, BLOCK_C)))
        # The roll: window column k (1 <= k < w) to state column k - 1, exact (x's dtype).
        ct.scatter(conv_state, (row, cols[:, None], (taps - 1)[None, :]), window,
                   mask=((taps >= 1) & (taps < WIDTH))[None, :])

    return conv_step_kernel


def conv_step(conv_state, x, weight, bias=None, state_batch_indices=None, silu: bool = True,
              config: ConvStepConfig = ConvStepConfig(), out=None):
    """Launch the conv step (no argument checks: :func:`ssd.layer_ops.conv_step` makes them).

    Args:
        conv_state: (b, c, w-1), or (s, c, w-1) rows of a paged cache with state_batch_indices;
            x's dtype, updated in place.
        x: (b, c) float tensor on the GPU, any strides.
        weight: (c, w) with 1 <= w <= MAX_WIDTH of :mod:`ssd.kernels.causal_conv1d`; bias:
            optional (c,).
        state_batch_indices: optional (b,) int32 / int64 state rows; negative: padding.
        silu: apply SiLU after the bias.
        out: optional preallocated (b, c) tensor of x's dtype (tests poison it).
    Returns:
        out (b, c) in x's dtype.
    """
    import torch

    b, c = x.shape
    width = weight.shape[1]
    dev = x.device
    if out is None:
        out = torch.empty((b, c), device=dev, dtype=x.dtype)
    # Width 1 has no history: a stand-in the masks never touch (cuTile takes no empty array).
    state = conv_state if width > 1 else optional(None, 3, x.dtype, dev)
    block_c = min(config.block_c, next_pow2(c))
    launch(build_kernel(index_dtype_for(state, x, out)), (-(-c // block_c), b, 1), dict(
        conv_state=state, x=x, weight=weight, bias=optional(bias, 1, x.dtype, dev),
        slots=optional(state_batch_indices, 1, torch.int32, dev), out=out, WIDTH=width,
        W_PAD=next_pow2(width), BLOCK_C=block_c, HAS_BIAS=bias is not None,
        HAS_SLOTS=state_batch_indices is not None, SILU=bool(silu)), device=dev)
    return out
