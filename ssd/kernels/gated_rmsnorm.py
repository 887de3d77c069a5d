"""The layer's gated RMSNorm, gate before the norm, per group, in one pass.

For row m (a (batch, position) pair) and group j of ``group_size`` channels::

    v   = y[m, j, :] * silu(z[m, j, :])                      fp32
    out = v / sqrt(mean(v^2) + eps) * weight[j, :]           rounded once to y's dtype

mamba_ssm's ``RMSNormGated(norm_before_gate=False)``, the norm of its ``Mamba2``; the float64
reference is :func:`ssd.layer_reference.gated_rmsnorm`. y is the SSD's output (b, l, h, p) seen
as (rows, g, group_size), z a column slice of in_proj's output seen the same way (rows
d_in_proj apart): neither is copied.

A block holds whole groups of its rows, each group padded with zeros to a power of two (tile
extents must be): the zeros add nothing to the sum of squares, which is divided by the true
group size, so y and z are read once and out written once.

The backward (:func:`gated_rmsnorm_backward`; the maths in :mod:`ssd.layer_autograd`) walks a
block's groups in channel tiles twice: first the rows' sums mean(v^2) and sum(dn v) (dn = dout
weight), then, with r = (mean(v^2) + eps)^-1/2 and n = v r, dy = dv silu(z) and
dz = dv y silu'(z), dv = r (dn - n mean(dn n)), in y's and z's dtypes, and each block's part of
dweight = sum_rows dout n, which the host adds in a fixed order.
"""
import functools

import cuda.tile as ct

from ..config import GatedNormConfig, next_pow2
from ..launch import array_type, flattens, index_dtype_for, launch
from .tiles import ConstInt, ZERO

#: The widest group the kernel keeps on chip (a block's fp32 row of the padded group): the
#: 2.7b layer's one group of 5120 channels pads to 8192.
MAX_GROUP = 8192


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The gated_rmsnorm kernel with arrays indexed by ``index_dtype``."""
    Array = array_type(index_dtype)

    @ct.kernel
    def gated_rmsnorm_kernel(
        y: Array,        # (m, g, group_size) fp32 / bf16 / fp16
        z: Array,        # (m, g, group_size) any float dtype, any strides
        weight: Array,   # (g, group_size) any float dtype
        out: Array,      # (m, g, group_size) y's dtype
        group_size: int,
        eps: float,
        BLOCK_M: ConstInt,  # rows a block
        BLOCK_G: ConstInt,  # next_pow2(group_size)
    ):
        """Grid: (cdiv(m, BLOCK_M), g); one block per BLOCK_M rows of one group."""
        im = ct.bid(0)
        ig = ct.bid(1)
        # Channels past group_size and rows past m load as 0: silu(0) = 0, so v is 0 there.
        yt = ct.load(y, index=(im, ig, 0), shape=(BLOCK_M, 1, BLOCK_G), padding_mode=ZERO)
        zt = ct.load(z, index=(im, ig, 0), shape=(BLOCK_M, 1, BLOCK_G), padding_mode=ZERO)
        yt = yt.reshape((BLOCK_M, BLOCK_G)).astype(ct.float32)
        zt = zt.reshape((BLOCK_M, BLOCK_G)).astype(ct.float32)
        v = yt * zt / (1.0 + ct.exp(-zt))  # [M, G] y * silu(z), fp32
        mean_sq = ct.sum(v * v, axis=1, keepdims=True) / group_size  # [M, 1]
        w = ct.load(weight, index=(ig, 0), shape=(1, BLOCK_G), padding_mode=ZERO)
        o = v * ct.rsqrt(mean_sq + eps) * w.astype(ct.float32)  # [M, G]
        ct.store(out, index=(im, ig, 0), tile=o.astype(out.dtype).reshape((BLOCK_M, 1, BLOCK_G)))

    return gated_rmsnorm_kernel


#: The elements of one backward tile, [rows, channels]: the backward walks a group in tiles of at
#: most this many channels twice (sums, then outputs), since a whole 8192-wide group of y, z,
#: dout and what derives from them does not fit in registers (in one pass of [1, 8192] tiles the
#: kernel spilled 392 bytes of stack a thread on sm_90, and 8 bytes with [4, 1024] tiles; none
#: with [1, 1024]); the second walk reads what the first brought into L2.
BACKWARD_TILE = 1024


@functools.lru_cache(maxsize=None)
def build_backward_kernel(index_dtype=ct.int32):
    """The gated_rmsnorm backward kernel with arrays indexed by ``index_dtype``."""
    Array = array_type(index_dtype)

    @ct.kernel
    def gated_rmsnorm_backward_kernel(
        dout: Array,           # (m, g, group_size) any float dtype
        y: Array,              # (m, g, group_size)
        z: Array,              # (m, g, group_size) any strides
        weight: Array,         # (g, group_size) fp32
        dy: Array,             # (m, g, group_size) y's dtype, out
        dz: Array,             # (m, g, group_size) z's dtype, out
        dweight_parts: Array,  # (cdiv(m, BLOCK_M), g, group_size) fp32 out: each block's sum
        group_size: int,
        tiles: int,            # cdiv(group_size, BLOCK_C)
        eps: float,
        BLOCK_M: ConstInt,     # rows a block
        BLOCK_C: ConstInt,     # channels a tile, a power of two
    ):
        """Grid: (cdiv(m, BLOCK_M), g); one block per BLOCK_M rows of one group, walking the
        group in ``tiles`` tiles twice."""
        im = ct.bid(0)
        ig = ct.bid(1)
        # 1. the rows' sums: mean(v^2), and sum(dn v) (sum(dn n) = r sum(dn v))
        sq = ct.zeros((BLOCK_M, 1), dtype=ct.float32)
        dnv = ct.zeros((BLOCK_M, 1), dtype=ct.float32)
        for jc in range(tiles):
            yt, zt, gt, w = channel_tile(dout, y, z, weight, im, ig, jc, BLOCK_M, BLOCK_C)
            v = yt * zt / (1.0 + ct.exp(-zt))  # y silu(z)
            sq = sq + ct.sum(v * v, axis=1, keepdims=True)
            dnv = dnv + ct.sum(gt * w * v, axis=1, keepdims=True)
        r = ct.rsqrt(sq / group_size + eps)  # [M, 1]
        mean_dnn = r * dnv / group_size  # [M, 1] mean(dn n)
        # 2. the outputs and dweight's part, tile by tile
        for jc in range(tiles):
            yt, zt, gt, w = channel_tile(dout, y, z, weight, im, ig, jc, BLOCK_M, BLOCK_C)
            sig = 1.0 / (1.0 + ct.exp(-zt))
            gate = zt * sig  # silu(z)
            n = yt * gate * r
            ct.store(dweight_parts, index=(im, ig, jc),
                     tile=ct.sum(gt * n, axis=0).reshape((1, 1, BLOCK_C)))
            dv = r * (gt * w - n * mean_dnn)  # [M, C]
            ct.store(dy, index=(im, ig, jc),
                     tile=(dv * gate).astype(dy.dtype).reshape((BLOCK_M, 1, BLOCK_C)))
            dzt = dv * yt * sig * (1.0 + zt * (1.0 - sig))  # silu'(z) = sig (1 + z (1 - sig))
            ct.store(dz, index=(im, ig, jc),
                     tile=dzt.astype(dz.dtype).reshape((BLOCK_M, 1, BLOCK_C)))

    return gated_rmsnorm_backward_kernel


def channel_tile(dout, y, z, weight, im, ig, jc, BLOCK_M, BLOCK_C):
    """Tile code: fp32 [M, C] tiles of y, z and dout and the [1, C] weight, channels
    ``jc*BLOCK_C ...`` of group ``ig``, rows ``im*BLOCK_M ...``; rows past m and channels past
    the group load as 0 (and add 0 to every sum: silu(0) = 0)."""
    shape = (BLOCK_M, 1, BLOCK_C)
    yt = ct.load(y, index=(im, ig, jc), shape=shape, padding_mode=ZERO)
    zt = ct.load(z, index=(im, ig, jc), shape=shape, padding_mode=ZERO)
    gt = ct.load(dout, index=(im, ig, jc), shape=shape, padding_mode=ZERO)
    w = ct.load(weight, index=(ig, jc), shape=(1, BLOCK_C), padding_mode=ZERO)
    return (yt.reshape((BLOCK_M, BLOCK_C)).astype(ct.float32),
            zt.reshape((BLOCK_M, BLOCK_C)).astype(ct.float32),
            gt.reshape((BLOCK_M, BLOCK_C)).astype(ct.float32), w)


def gated_rmsnorm(y, z, weight, group_size: int, eps: float,
                  config: GatedNormConfig = GatedNormConfig(), out=None):
    """Launch the gated RMSNorm (no argument checks: :func:`ssd.layer_ops.gated_rmsnorm`
    makes them).

    Args:
        y, z: (..., d) float tensors on the GPU whose leading axes flatten to one without a
            copy (a contiguous y; z a column slice of a contiguous tensor), unit channel stride.
        weight: (d,); group_size: divides d, at most MAX_GROUP; eps: added to the mean square.
        out: optional preallocated contiguous tensor of y's shape and dtype (tests poison it).
    Returns:
        out (..., d) in y's dtype, contiguous.
    """
    import torch

    d = y.shape[-1]
    groups = d // group_size
    if out is None:
        out = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    rows = out.numel() // d
    views = [t.view(rows, groups, group_size) for t in (y, z, out)]
    block_m = config.block_rows(rows, group_size)
    grid = (-(-rows // block_m), groups, 1)
    launch(build_kernel(index_dtype_for(y, z, out)), grid, dict(
        y=views[0], z=views[1], weight=weight.reshape(groups, group_size), out=views[2],
        group_size=group_size, eps=float(eps), BLOCK_M=block_m,
        BLOCK_G=next_pow2(group_size)), device=y.device)
    return out


def gated_rmsnorm_backward(dout, y, z, weight, group_size: int, eps: float) -> dict:
    """Launch the norm's backward: :func:`ssd.layer_autograd.gated_rmsnorm_backward`'s
    arguments and gradients, dy in y's dtype and dz in z's (computed in fp32), dweight fp32.

    Args:
        dout: (..., d), y's shape, any float dtype (a copy is made unless its channels have a
            unit stride and its leading axes flatten); y, z, weight, group_size, eps: the
            forward's (:func:`gated_rmsnorm`). A block takes [rows, channels] tiles of
            BACKWARD_TILE elements.
    Returns:
        dict of dy (..., d), dz (..., d) contiguous, and dweight (d,).
    """
    import torch

    d = y.shape[-1]
    groups = d // group_size
    rows = y.numel() // d
    if dout.stride(-1) != 1 or not flattens(dout, rows, d):
        dout = dout.contiguous()
    dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    dz = torch.empty(y.shape, device=y.device, dtype=z.dtype)
    block_c = min(next_pow2(group_size), BACKWARD_TILE)
    block_m = max(1, min(BACKWARD_TILE // block_c, next_pow2(rows)))  # [M, C] of BACKWARD_TILE
    grid = (-(-rows // block_m), groups, 1)
    parts = torch.empty((grid[0], groups, group_size), device=y.device, dtype=torch.float32)
    views = [t.view(rows, groups, group_size) for t in (dout, y, z, dy, dz)]
    launch(build_backward_kernel(index_dtype_for(dout, y, z, dy, dz)), grid, dict(
        dout=views[0], y=views[1], z=views[2],
        weight=weight.to(torch.float32).reshape(groups, group_size), dy=views[3], dz=views[4],
        dweight_parts=parts, group_size=group_size, tiles=-(-group_size // block_c),
        eps=float(eps), BLOCK_M=block_m, BLOCK_C=block_c), device=y.device)
    return dict(dy=dy, dz=dz, dweight=parts.sum(0).reshape(d))
