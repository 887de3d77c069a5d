"""The layer's depthwise causal conv1d over time, with bias and SiLU, in the layouts around it.

For batch row b, position t and channel c of xBC (kernel width w = Mamba-2's d_conv)::

    out[b, t, c] = silu(bias[c] + sum_k weight[c, k] * x[b, t - (w - 1) + k, c])

x is read where in_proj wrote it: (b, l, c) with the channels innermost, a column slice of
in_proj's output (rows d_in_proj apart), so no transpose and no copy come before the kernel.
out is one contiguous (b, l, c) buffer, which the SSD reads as x (b, l, h, p), B and C
(b, l, g, n) through views.

Before the sequence start a tap reads 0, or the initial conv state (b, c, w-1); with seq_idx
a tap that reaches back across a change of sequence reads 0 (the positions before the start
count as sequence 0, as in the SSD). The float64 reference is
:func:`ssd.layer_reference.causal_conv1d`.

Each tap is a gather of the block's rows shifted back by w-1-k: a tile load can only start at
a multiple of its own shape, and a gather's indices can be anything, negative ones reading as
out of bounds (zero), which is the causal padding. Along the channels the indices are
consecutive, so on sm_90 each thread's gather compiles to 16-byte vector loads; the rows the
taps share are meant to hit the L1 cache (untimed: were they to miss, L2 would serve each
input row w times).
"""
import functools

import cuda.tile as ct

from ..config import Conv1dConfig, next_pow2
from ..launch import array_type, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt

#: Widths the kernel is compiled for (Mamba-2's d_conv is 4; mamba_ssm's conv takes 2 to 4).
MAX_WIDTH = 4


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The causal_conv1d kernel with arrays indexed by ``index_dtype``."""
    Array = array_type(index_dtype)

    @ct.kernel
    def causal_conv1d_kernel(
        x: Array,               # (b, l, c) fp32 / bf16 / fp16, any strides
        weight: Array,          # (c, w) any float dtype
        bias: Array,            # (c,) (ignored unless HAS_BIAS)
        seq_idx: Array,         # (b, l) int32 (ignored unless HAS_SEQ)
        initial_states: Array,  # (b, c, w-1) (ignored unless HAS_INIT)
        out: Array,             # (b, l, c) x's dtype
        WIDTH: ConstInt,
        BLOCK_L: ConstInt,
        BLOCK_C: ConstInt,
        HAS_BIAS: ConstBool,
        HAS_SEQ: ConstBool,
        HAS_INIT: ConstBool,
        SILU: ConstBool,
    ):
        """Grid: (cdiv(c, BLOCK_C), cdiv(l, BLOCK_L), b); one block per tile of positions and
        channels, the channel tiles of one row block side by side in launch order."""
        jc = ct.bid(0)
        il = ct.bid(1)
        ib = ct.bid(2)
        rows = il * BLOCK_L + ct.arange(BLOCK_L, dtype=ct.int32)  # [L]
        cols = jc * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)  # [C]
        acc = ct.zeros((BLOCK_L, BLOCK_C), dtype=ct.float32)  # fp32 accumulation
        if HAS_BIAS:
            acc = acc + ct.gather(bias, cols).astype(ct.float32)[None, :]  # channels past c: 0
        if HAS_SEQ:
            seq_here = ct.gather(seq_idx, (ib, rows))  # [L]
        for k in ct.static_iter(range(WIDTH)):
            src = rows - (WIDTH - 1 - k)  # [L] the position tap k reads
            # Rows before 0 (the causal padding), past l and channels past c are out of
            # bounds: the gather reads them as 0.
            xk = ct.gather(x, (ib, src[:, None], cols[None, :])).astype(ct.float32)  # [L, C]
            if HAS_SEQ:
                if k < WIDTH - 1:  # the last tap reads position t itself
                    seq_src = ct.gather(seq_idx, (ib, src))  # [L]
                    xk = ct.where((seq_src == seq_here)[:, None], xk, 0.0)
            wk = ct.gather(weight, (cols, k)).astype(ct.float32)  # [C]
            acc = acc + wk[None, :] * xk
        if HAS_INIT:
            if il == 0:  # only the first row block reaches before position 0
                for k in ct.static_iter(range(WIDTH - 1)):
                    src = rows - (WIDTH - 1 - k)  # [L]
                    # Position src < 0 is the conv state's entry w-1+src (oldest first).
                    state = ct.gather(initial_states,
                                      (ib, cols[None, :], (src + WIDTH - 1)[:, None]),
                                      mask=(src < 0)[:, None]).astype(ct.float32)  # [L, C]
                    if HAS_SEQ:
                        # Before the row start the sequence is 0, as the SSD's virtual
                        # seq_idx[-1]: the initial state feeds sequence 0 only.
                        state = ct.where((seq_here == 0)[:, None], state, 0.0)
                    acc = acc + ct.gather(weight, (cols, k)).astype(ct.float32)[None, :] * state
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))  # x * sigmoid(x); exp overflows to inf -> -0
        ct.store(out, index=(ib, il, jc),
                 tile=acc.astype(out.dtype).reshape((1, BLOCK_L, BLOCK_C)))

    return causal_conv1d_kernel


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, silu: bool = True,
                  config: Conv1dConfig = Conv1dConfig(), out=None):
    """Launch the causal conv1d (no argument checks: :func:`ssd.layer_ops.causal_conv1d` makes
    them).

    Args:
        x: (b, l, c) float tensor on the GPU, any strides (unit channel stride is fastest).
        weight: (c, w) with 1 <= w <= MAX_WIDTH; bias: optional (c,).
        seq_idx: optional (b, l) int; initial_states: optional (b, c, w-1).
        silu: apply SiLU after the bias.
        out: optional preallocated contiguous (b, l, c) tensor of x's dtype (tests poison it).
    Returns:
        out (b, l, c) in x's dtype, contiguous.
    """
    import torch

    b, l, c = x.shape
    width = weight.shape[1]
    if out is None:
        out = torch.empty((b, l, c), device=x.device, dtype=x.dtype)
    has_init = initial_states is not None and width > 1  # width 1 has no history
    args = dict(
        x=x, weight=weight, bias=optional(bias, 1, x.dtype, x.device),
        seq_idx=optional(None if seq_idx is None else seq_idx.to(torch.int32), 2, torch.int32,
                         x.device),
        initial_states=optional(initial_states if has_init else None, 3, x.dtype, x.device),
        out=out, WIDTH=width, BLOCK_L=min(config.block_l, next_pow2(l)),
        BLOCK_C=min(config.block_c, next_pow2(c)), HAS_BIAS=bias is not None,
        HAS_SEQ=seq_idx is not None, HAS_INIT=has_init, SILU=bool(silu))
    grid = (-(-c // args["BLOCK_C"]), -(-l // args["BLOCK_L"]), b)
    launch(build_kernel(index_dtype_for(x, out, initial_states)), grid, args, device=x.device)
    return out
