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
"""
import functools

import cuda.tile as ct

from ..config import GatedNormConfig, next_pow2
from ..launch import array_type, index_dtype_for, launch
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
