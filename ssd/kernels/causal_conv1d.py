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


def tap(x, initial_states, seq_idx, ib, rows, cols, seq_here, first, k, WIDTH, HAS_SEQ,
        HAS_INIT):
    """Tile code: the [L, C] fp32 values tap ``k`` reads for positions ``rows`` ([L], the
    smallest ``first``) and channels ``cols`` ([C]): x at rows - (w-1-k); before position 0 the
    initial conv state (or 0), past l and past c 0; with seq_idx 0 where the tap reaches back
    across a change of sequence (``seq_here``: [L] seq_idx at ``rows``)."""
    src = rows - (WIDTH - 1 - k)  # [L] the position tap k reads
    # Rows before 0 (the causal padding), past l and channels past c are out of bounds: the
    # gather reads them as 0.
    xk = ct.gather(x, (ib, src[:, None], cols[None, :])).astype(ct.float32)  # [L, C]
    if HAS_INIT:
        if k < WIDTH - 1:
            if first - (WIDTH - 1 - k) < 0:  # only a block at the start reaches before it
                # Position src < 0 is the conv state's entry w-1+src (oldest first).
                xk = xk + ct.gather(initial_states, (ib, cols[None, :], (src + WIDTH - 1)[:, None]),
                                    mask=(src < 0)[:, None]).astype(ct.float32)
    if HAS_SEQ:
        if k < WIDTH - 1:  # the last tap reads position t itself
            # Before the row start the sequence is 0, as the SSD's virtual seq_idx[-1]: the
            # initial state feeds sequence 0 only (an out-of-bounds gather reads 0).
            seq_src = ct.gather(seq_idx, (ib, src))  # [L]
            xk = ct.where((seq_src == seq_here)[:, None], xk, 0.0)
    return xk


def preactivation(x, weight, bias, initial_states, seq_idx, ib, rows, cols, seq_here, first,
                  WIDTH, BLOCK_L, BLOCK_C, HAS_BIAS, HAS_SEQ, HAS_INIT):
    """Tile code: s = bias + sum_k weight[:, k] tap_k, [L, C] fp32 (:func:`tap`)."""
    acc = ct.zeros((BLOCK_L, BLOCK_C), dtype=ct.float32)
    if HAS_BIAS:
        acc = acc + ct.gather(bias, cols).astype(ct.float32)[None, :]  # channels past c: 0
    for k in ct.static_iter(range(WIDTH)):
        wk = ct.gather(weight, (cols, k)).astype(ct.float32)  # [C]
        acc = acc + wk[None, :] * tap(x, initial_states, seq_idx, ib, rows, cols, seq_here,
                                      first, k, WIDTH, HAS_SEQ, HAS_INIT)
    return acc


def sequence_at(seq_idx, ib, rows, BLOCK_L, HAS_SEQ):
    """Tile code: [L] seq_idx at ``rows`` (0 past l, and unread without HAS_SEQ)."""
    seq = ct.zeros((BLOCK_L,), dtype=ct.int32)
    if HAS_SEQ:
        seq = ct.gather(seq_idx, (ib, rows))
    return seq


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
        acc = preactivation(x, weight, bias, initial_states, seq_idx, ib, rows, cols,
                            sequence_at(seq_idx, ib, rows, BLOCK_L, HAS_SEQ), il * BLOCK_L,
                            WIDTH, BLOCK_L, BLOCK_C, HAS_BIAS, HAS_SEQ, HAS_INIT)  # fp32
        if SILU:
            acc = acc / (1.0 + ct.exp(-acc))  # x * sigmoid(x); exp overflows to inf -> -0
        ct.store(out, index=(ib, il, jc),
                 tile=acc.astype(out.dtype).reshape((1, BLOCK_L, BLOCK_C)))

    return causal_conv1d_kernel


@functools.lru_cache(maxsize=None)
def build_backward_kernel(index_dtype=ct.int32):
    """The causal_conv1d backward kernel with arrays indexed by ``index_dtype``."""
    Array = array_type(index_dtype)

    @ct.kernel
    def causal_conv1d_backward_kernel(
        dout: Array,            # (b, l, c) any float dtype, any strides
        x: Array,               # (b, l, c), any strides
        weight: Array,          # (c, w)
        bias: Array,            # (c,) (ignored unless HAS_BIAS)
        seq_idx: Array,         # (b, l) int32 (ignored unless HAS_SEQ)
        initial_states: Array,  # (b, c, w-1) (ignored unless HAS_INIT)
        dx: Array,              # (b, l, c) x's dtype, out
        dweight_parts: Array,   # (b, cdiv(l, BLOCK_L), w, c) fp32 out: each row block's sums
        dbias_parts: Array,     # (b, cdiv(l, BLOCK_L), c) fp32 out (HAS_BIAS)
        WIDTH: ConstInt,
        BLOCK_L: ConstInt,
        BLOCK_C: ConstInt,
        HAS_BIAS: ConstBool,
        HAS_SEQ: ConstBool,
        HAS_INIT: ConstBool,
        SILU: ConstBool,
    ):
        """Grid: (cdiv(c, BLOCK_C), cdiv(l, BLOCK_L), b), as the forward's but with its own,
        smaller tiles (Conv1dConfig.backward_block_*); one block per tile of positions u and
        channels: dx[u] sums ds[u + d] weight[w-1-d] over the w outputs t = u + d that read
        x[u], each ds recomputed from x (the forward's preactivation, then SiLU's slope); the
        block's own ds (d = 0) gives its parts of dweight and dbias."""
        jc = ct.bid(0)
        il = ct.bid(1)
        ib = ct.bid(2)
        u = il * BLOCK_L + ct.arange(BLOCK_L, dtype=ct.int32)  # [L] the positions of dx
        cols = jc * BLOCK_C + ct.arange(BLOCK_C, dtype=ct.int32)  # [C]
        seq_u = sequence_at(seq_idx, ib, u, BLOCK_L, HAS_SEQ)
        acc = ct.zeros((BLOCK_L, BLOCK_C), dtype=ct.float32)
        for d in ct.static_iter(range(WIDTH)):
            t = u + d  # [L] the outputs whose tap w-1-d reads x[u]
            seq_t = sequence_at(seq_idx, ib, t, BLOCK_L, HAS_SEQ)
            ds = ct.gather(dout, (ib, t[:, None], cols[None, :])).astype(ct.float32)  # 0 past l
            if SILU:
                s = preactivation(x, weight, bias, initial_states, seq_idx, ib, t, cols, seq_t,
                                  il * BLOCK_L + d, WIDTH, BLOCK_L, BLOCK_C, HAS_BIAS, HAS_SEQ,
                                  HAS_INIT)
                sig = 1.0 / (1.0 + ct.exp(-s))
                ds = ds * sig * (1.0 + s * (1.0 - sig))  # silu'(s)
            term = ds * ct.gather(weight, (cols, WIDTH - 1 - d)).astype(ct.float32)[None, :]
            if HAS_SEQ:
                if d > 0:  # tap w-1-d of t reads x[u] only within one sequence
                    term = ct.where((seq_u == seq_t)[:, None], term, 0.0)
            acc = acc + term
            if d == 0:  # ds of the block's own positions: its parts of dweight and dbias
                if HAS_BIAS:
                    ct.store(dbias_parts, index=(ib, il, jc),
                             tile=ct.sum(ds, axis=0).reshape((1, 1, BLOCK_C)))
                for k in ct.static_iter(range(WIDTH)):
                    xk = tap(x, initial_states, seq_idx, ib, u, cols, seq_u, il * BLOCK_L, k,
                             WIDTH, HAS_SEQ, HAS_INIT)
                    ct.store(dweight_parts, index=(ib, il, k, jc),
                             tile=ct.sum(ds * xk, axis=0).reshape((1, 1, 1, BLOCK_C)))
        ct.store(dx, index=(ib, il, jc), tile=acc.astype(dx.dtype).reshape((1, BLOCK_L, BLOCK_C)))

    return causal_conv1d_backward_kernel


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


def causal_conv1d_backward(dout, x, weight, bias=None, seq_idx=None, initial_states=None,
                           silu: bool = True, config: Conv1dConfig = Conv1dConfig()) -> dict:
    """Launch the conv's backward: :func:`ssd.layer_autograd.causal_conv1d_backward`'s arguments
    and gradients, dx in x's dtype (computed in fp32), dweight and dbias fp32 from the row
    blocks' parts (added on the host in a fixed order).

    d initial_states reads only the outputs at positions 0 .. w-2 (the ones whose taps reach
    before the start), so it is that PyTorch function's on the first w-1 positions: a
    (b, w-1, c) slice, not a pass over the sequence.

    Args:
        dout: (b, l, c) gradient of the output, any float dtype; the rest as
            :func:`causal_conv1d`.
    Returns:
        dict of dx (b, l, c), dweight (c, w), dbias (c,) or None, dinitial_states (b, c, w-1)
        or None.
    """
    import torch

    from ..layer_autograd import causal_conv1d_backward as torch_backward

    b, l, c = x.shape
    width = weight.shape[1]
    block_l = min(config.backward_block_l, next_pow2(l))
    block_c = min(config.backward_block_c, next_pow2(c))
    row_blocks = -(-l // block_l)
    f, dev = torch.float32, x.device
    dx = torch.empty((b, l, c), device=dev, dtype=x.dtype)
    dweight_parts = torch.empty((b, row_blocks, width, c), device=dev, dtype=f)
    dbias_parts = None if bias is None else torch.empty((b, row_blocks, c), device=dev, dtype=f)
    has_init = initial_states is not None and width > 1
    seq = None if seq_idx is None else seq_idx.to(torch.int32)
    launch(build_backward_kernel(index_dtype_for(dout, x, dx, initial_states)),
           (-(-c // block_c), row_blocks, b), dict(
               dout=dout, x=x, weight=weight, bias=optional(bias, 1, x.dtype, dev),
               seq_idx=optional(seq, 2, torch.int32, dev),
               initial_states=optional(initial_states if has_init else None, 3, x.dtype, dev),
               dx=dx, dweight_parts=dweight_parts,
               dbias_parts=optional(dbias_parts, 3, f, dev), WIDTH=width, BLOCK_L=block_l,
               BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_SEQ=seq is not None,
               HAS_INIT=has_init, SILU=bool(silu)), device=dev)
    dinit = None
    if initial_states is not None:
        head = slice(0, width - 1)
        dinit = torch_backward(dout[:, head], x[:, head], weight, bias,
                               None if seq_idx is None else seq_idx[:, head], initial_states,
                               "silu" if silu else None)["dinitial_states"]
    return dict(dx=dx, dweight=dweight_parts.sum((0, 1)).t(),
                dbias=None if bias is None else dbias_parts.sum((0, 1)), dinitial_states=dinit)
