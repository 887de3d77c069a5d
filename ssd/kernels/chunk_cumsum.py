"""Stage 1, chunk_cumsum: the step sizes dt and the cumulative log-decay inside each chunk.

For every (batch b, head h, chunk c) and position q of the chunk::

    dt'[q]        = clamp(softplus(dt[q] + dt_bias[h]), lo, hi)   (bias, softplus optional)
    dA_cumsum[q]  = sum_{k <= q} dt'[k] * A[h]                      (natural-log units)

Positions past the end of the sequence get dt' = 0, so dA_cumsum stays flat there and
``dA_cumsum[..., -1]`` is always the decay of the whole (valid part of the) chunk.
Outputs use the chunked layout (b, h, c, q) that stages 2 and 3 read row by row.
"""

import functools
import math

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import CumsumConfig
from .tiles import ConstInt, ConstBool, ZERO


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The chunk_cumsum kernel with arrays indexed by ``index_dtype`` (int64 only for huge inputs)."""
    Array = array_type(index_dtype)

    @ct.kernel
    def chunk_cumsum_kernel(
        dt: Array,          # (b, l, h)  any float dtype
        A: Array,           # (h,)       fp32
        dt_bias: Array,     # (h,)       fp32 (ignored unless HAS_BIAS)
        dt_out: Array,      # (b, h, c, q) fp32
        dA_cumsum: Array,   # (b, h, c, q) fp32
        seqlen: int,
        dt_min: float,
        dt_max: float,
        Q: ConstInt,        # chunk size (power of two)
        BLOCK_H: ConstInt,  # heads per block
        HAS_BIAS: ConstBool,
        SOFTPLUS: ConstBool,
    ):
        """Grid: (b, c, cdiv(h, BLOCK_H)); one block scans one chunk for BLOCK_H heads."""
        ib = ct.bid(0)
        ic = ct.bid(1)
        ih = ct.bid(2)
        # One chunk of dt for BLOCK_H heads; rows past seqlen and heads past h read as 0.
        d = ct.load(dt, index=(ib, ic, ih), shape=(1, Q, BLOCK_H), padding_mode=ZERO)
        d = d.reshape((Q, BLOCK_H)).astype(ct.float32)  # [Q, BLOCK_H]
        if HAS_BIAS:
            bias = ct.load(dt_bias, index=(ih,), shape=(BLOCK_H,), padding_mode=ZERO)
            d = d + bias[None, :]
        if SOFTPLUS:
            # softplus(x) = log1p(e^x); above 20 it equals x to fp32 precision and e^x would
            # only risk overflow, so pass x through there (the threshold mamba_ssm uses).
            # There is no log1p tile op, and log(1 + e) loses e's low bits when e is small
            # (typical dt' ~ 1e-3 would keep only ~4 significant digits). Goldberg's
            # identity log1p(e) = log(u) * e / (u - 1), u = fl(1 + e), cancels that rounding.
            e = ct.exp(ct.minimum(d, 20.0))
            u = 1.0 + e
            log1p = ct.where(u == 1.0, e, ct.log(u) * e / (u - 1.0))
            d = ct.where(d <= 20.0, log1p, d)
        # Always clamp, as mamba_ssm does: the default (0, inf) maps a negative dt' to 0,
        # which keeps every decay exp(dt' * A) <= 1.
        d = ct.minimum(ct.maximum(d, dt_min), dt_max)
        # Padding rows must not decay the state: force dt' = 0 past the sequence end
        # (softplus(bias) of a zero-padded row would otherwise be positive).
        pos = ic * Q + ct.arange(Q, dtype=ct.int32)  # [Q]
        d = ct.where(pos[:, None] < seqlen, d, 0.0)
        a = ct.load(A, index=(ih,), shape=(BLOCK_H,), padding_mode=ZERO)  # [BLOCK_H]
        cs = ct.cumsum(d * a[None, :], axis=0)  # [Q, BLOCK_H], fp32 running sum
        # Store transposed into the chunked (b, h, c, q) layout.
        ct.store(dt_out, index=(ib, ih, ic, 0),
                 tile=ct.transpose(d).reshape((1, BLOCK_H, 1, Q)))
        ct.store(dA_cumsum, index=(ib, ih, ic, 0),
                 tile=ct.transpose(cs).reshape((1, BLOCK_H, 1, Q)))

    return chunk_cumsum_kernel


def chunk_cumsum(dt, A, chunk_size: int, dt_bias=None, dt_softplus: bool = False,
                 dt_limit=(0.0, math.inf), config: CumsumConfig = CumsumConfig(), out=None):
    """Launch stage 1.

    Args:
        dt: (b, l, h) float tensor on the GPU.
        A: (h,) float tensor (converted to fp32).
        chunk_size: q, a power of two.
        dt_bias: optional (h,) float tensor.
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (lo, hi) clamp after softplus (always applied; (0, inf) clips negatives).
        out: optional pair of preallocated (b, h, c, q) fp32 tensors (tests poison them).
    Returns:
        dt_out (b, h, c, q) fp32, dA_cumsum (b, h, c, q) fp32.
    """
    import torch

    b, l, h = dt.shape
    nchunks = -(-l // chunk_size)
    if out is None:
        out = tuple(torch.empty((b, h, nchunks, chunk_size), device=dt.device, dtype=torch.float32)
                    for _ in range(2))
    dt_out, dA_cumsum = out
    A32 = A.to(torch.float32).contiguous()
    bias = optional(dt_bias, 1, torch.float32, dt.device).to(torch.float32).contiguous()
    kernel = build_kernel(index_dtype_for(dt))
    grid = (b, nchunks, -(-h // config.block_h))
    launch(kernel, grid, dict(
        dt=dt, A=A32, dt_bias=bias, dt_out=dt_out, dA_cumsum=dA_cumsum, seqlen=l,
        dt_min=float(dt_limit[0]), dt_max=float(dt_limit[1]), Q=chunk_size,
        BLOCK_H=config.block_h, HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus)),
        device=dt.device)
    return dt_out, dA_cumsum
