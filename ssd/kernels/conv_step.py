"""The decode step of the layer's causal conv1d: one token per sequence, the conv state rolled in
place.

For batch entry b with state row r (b itself, or ``state_batch_indices[b]`` in a paged cache)
and channel c, with the window of the w most recent inputs, oldest first::

    window[k] = conv_state[r, c, k]   (k < w - 1),   window[w - 1] = x[b, c]
    out[b, c] = silu(bias[c] + sum_k weight[c, k] * window[k])
    conv_state[r, c, :] <- window[1:]                 (the oldest input dropped)

This is :func:`ssd.kernels.causal_conv1d` one position further with the conv state as its
initial state (the float64 reference is :func:`ssd.layer_reference.conv_step`). A block owns
``block_c`` channels of one batch entry: it gathers x and each of the w - 1 state columns as a
[C] tile, sums the taps against the weights in fp32, rounds once, and scatters the window's newest
w - 1 columns back one place to the left. The state is read once and written once. Every column
is a [C] tile indexed by the same channels, so a channel's reads and writes are one thread's, in
program order, and no read sees a write (a [C, W] tile of the window would let the compiler give
a channel's columns to different threads, and one could overwrite a column before another read
it). A negative ``state_batch_indices`` entry is padding, as in the SSM's decode step
(:mod:`ssd.kernels.state_update`): its out is 0 and no state row is touched.
"""
import functools

import cuda.tile as ct

from ..config import ConvStepConfig, next_pow2
from ..launch import array_type, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt


#: The widest conv the kernel is unrolled for (Mamba-2's d_conv is 4): w - 1 <= 3 state columns.
MAX_WIDTH = 4


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
        WIDTH: ConstInt,    # 1 <= WIDTH <= MAX_WIDTH
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
        cols = jc * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)  # [C]; past c: read as 0
        # Every window column is a [C] tile indexed alike, so the thread that reads a channel's
        # state is the one that writes it back in the roll below: no read can see a write.
        x_t = ct.gather(x, (ib, cols))  # [C] the newest input, tap w-1
        acc = ct.gather(weight, (cols, WIDTH - 1)).astype(ct.float32) * x_t.astype(ct.float32)
        if WIDTH > 1:  # the state columns, oldest first: taps 0 .. w-2
            s0 = ct.gather(conv_state, (row, cols, 0))  # [C]
            acc = acc + ct.gather(weight, (cols, 0)).astype(ct.float32) * s0.astype(ct.float32)
        if WIDTH > 2:
            s1 = ct.gather(conv_state, (row, cols, 1))  # [C]
            acc = acc + ct.gather(weight, (cols, 1)).astype(ct.float32) * s1.astype(ct.float32)
        if WIDTH > 3:
            s2 = ct.gather(conv_state, (row, cols, 2))  # [C]
            acc = acc + ct.gather(weight, (cols, 2)).astype(ct.float32) * s2.astype(ct.float32)
        if HAS_BIAS:
            acc = acc + ct.gather(bias, cols).astype(ct.float32)
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))  # x * sigmoid(x); exp overflows to inf -> -0
        ct.store(out, index=(ib, jc), tile=acc.astype(out.dtype).reshape((1, BLOCK_C)))
        # The roll, after every read: column k takes column k + 1, the last one x (values of
        # x's dtype moved, exact). Channels past c are out of bounds: not stored.
        if WIDTH > 2:
            ct.scatter(conv_state, (row, cols, 0), s1)
        if WIDTH > 3:
            ct.scatter(conv_state, (row, cols, 1), s2)
        if WIDTH > 1:
            ct.scatter(conv_state, (row, cols, WIDTH - 2), x_t)

    return conv_step_kernel


def conv_step(conv_state, x, weight, bias=None, state_batch_indices=None, silu: bool = True,
              config: ConvStepConfig = ConvStepConfig(), out=None):
    """Launch the conv step (no argument checks: :func:`ssd.layer_ops.conv_step` makes them).

    Args:
        conv_state: (b, c, w-1), or (s, c, w-1) rows of a paged cache with state_batch_indices;
            x's dtype, updated in place.
        x: (b, c) float tensor on the GPU, any strides.
        weight: (c, w) with 1 <= w <= MAX_WIDTH; bias: optional (c,).
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
        BLOCK_C=block_c, HAS_BIAS=bias is not None,
        HAS_SLOTS=state_batch_indices is not None, SILU=bool(silu)), device=dev)
    return out
