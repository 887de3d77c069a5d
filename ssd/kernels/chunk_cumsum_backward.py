"""The backward of chunk_cumsum: the gradients of dt', dA_cumsum back to dt, A and dt_bias.

The forward (:mod:`ssd.kernels.chunk_cumsum`) computes, per (batch, head, chunk) and position
k of the chunk, u = dt + dt_bias, s = softplus(u) (u above 20, or u without softplus),
dt'_k = clamp(s, lo, hi) (0 past the sequence end) and dA_cumsum[t] = sum_{k <= t} dt'_k A.
Given ddt_out and ddA_cumsum (every stage's contributions summed)::

    dlog_k   = sum_{t >= k in the chunk} ddA_cumsum[t]       (the cumsum's adjoint: a suffix sum)
    ddt'_k   = ddt_out[k] + A dlog_k
    ddt_k    = ddt'_k sigmoid(u_k)  where lo <= s_k <= hi    (slope 1 for u > 20 or without
               softplus; 0 strictly outside the clamp, where the forward returned lo or hi)
    dA       = sum_{b, c, k} dlog_k dt'_k
    ddt_bias = sum_{b, l} ddt

(``ssd.backward.chunk_cumsum_backward_torch`` is the specification). The padded tail of a
partial last chunk carries no gradient to dt, but its dlog does not vanish: the last column of
ddA_cumsum (the chunk's whole decay, which chunk_state and state_passing read) sums into every
valid position's dlog.

Two passes, deterministic (no atomics): :func:`build_kernel`, one block per (batch, chunk,
``BLOCK_H`` heads) as the forward, writes ddt and each chunk's parts of dA and ddt_bias,
(2, b * c, h); :func:`build_sum_kernel`, one block per ``BLOCK_H`` heads, sums the parts over
(b, c) in a fixed order, ``BLOCK_ROWS`` chunks at a time.
"""
import functools
import math

import cuda.tile as ct

from ..config import CumsumBackwardConfig
from ..launch import array_type, check_array, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt, ZERO, softplus

FLOATS = ("float32", "bfloat16", "float16")


def chunk_rows(arr, ib, ih, ic, Q, BLOCK_H):
    """Tile code: one chunk of BLOCK_H heads of a (b, h, c, q) array as [Q, BLOCK_H] fp32, the
    layout of dt (heads past h load as 0)."""
    t = ct.load(arr, index=(ib, ih, ic, 0), shape=(1, BLOCK_H, 1, Q), padding_mode=ZERO)
    return ct.transpose(t.reshape((BLOCK_H, Q)).astype(ct.float32))


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The per-chunk pass for arrays indexed by ``index_dtype`` (int64 only for huge inputs)."""
    Array = array_type(index_dtype)

    @ct.kernel
    def chunk_cumsum_backward_kernel(
        ddt_out: Array,     # (b, h, c, q)
        ddA_cumsum: Array,  # (b, h, c, q)
        dt: Array,          # (b, l, h) any float dtype
        A: Array,           # (h,) fp32
        dt_bias: Array,     # (h,) fp32 (ignored unless HAS_BIAS)
        dt_out: Array,      # (b, h, c, q) the forward's dt' (ignored unless HAS_DT_OUT)
        ddt: Array,         # (b, l, h) out
        parts: Array,       # (2, b * c, h) fp32 out: each chunk's dA and ddt_bias terms
        seqlen: int,
        nchunks: int,
        dt_min: float,
        dt_max: float,
        Q: ConstInt,
        BLOCK_H: ConstInt,
        HAS_BIAS: ConstBool,
        SOFTPLUS: ConstBool,
        HAS_DT_OUT: ConstBool,
    ):
        """Grid: (b, c, cdiv(h, BLOCK_H)); one block, one chunk of BLOCK_H heads."""
        ib = ct.bid(0)
        ic = ct.bid(1)
        ih = ct.bid(2)
        valid = (ic * Q + ct.arange(Q, dtype=ct.int32) < seqlen)[:, None]  # [Q, 1]
        # the step's forward again, elementwise: u, s and the clamp (as chunk_cumsum)
        u = ct.load(dt, index=(ib, ic, ih), shape=(1, Q, BLOCK_H), padding_mode=ZERO)
        u = u.reshape((Q, BLOCK_H)).astype(ct.float32)  # [Q, H]
        if HAS_BIAS:
            u = u + ct.load(dt_bias, index=(ih,), shape=(BLOCK_H,), padding_mode=ZERO)[None, :]
        s = u
        slope = ct.full((Q, BLOCK_H), 1.0, dtype=ct.float32)
        if SOFTPLUS:
            s = softplus(u)
            # softplus' = sigmoid(u) on its softplus branch; above 20 the forward passed u on
            # (slope 1). exp(-u) may overflow to inf for very negative u: 1 / inf = 0, right.
            slope = ct.where(u <= 20.0, 1.0 / (1.0 + ct.exp(-u)), 1.0)
        if HAS_DT_OUT:
            step = chunk_rows(dt_out, ib, ih, ic, Q, BLOCK_H)
        else:
            step = ct.where(valid, ct.minimum(ct.maximum(s, dt_min), dt_max), 0.0)  # [Q, H] dt'
        # the cumsum's adjoint: step k's log-decay dt'_k A feeds dA_cumsum[t] for every t >= k
        dlog = ct.cumsum(chunk_rows(ddA_cumsum, ib, ih, ic, Q, BLOCK_H), axis=0, reverse=True)
        a = ct.load(A, index=(ih,), shape=(BLOCK_H,), padding_mode=ZERO)  # [H]
        ddt_prime = chunk_rows(ddt_out, ib, ih, ic, Q, BLOCK_H) + a[None, :] * dlog  # [Q, H]
        # the clamp passes the gradient inside [lo, hi], edges included; padded rows get none
        inside = (s >= dt_min) & (s <= dt_max) & valid
        g = ct.where(inside, ddt_prime * slope, 0.0)  # [Q, H]
        ct.store(ddt, index=(ib, ic, ih), tile=g.reshape((1, Q, BLOCK_H)).astype(ddt.dtype))
        # this chunk's terms of the sums over (b, l); padded rows have dt' = 0 and g = 0
        row = ib * nchunks + ic
        ct.store(parts, index=(0, row, ih),
                 tile=ct.sum(dlog * step, axis=0).reshape((1, 1, BLOCK_H)))
        if HAS_BIAS:
            ct.store(parts, index=(1, row, ih), tile=ct.sum(g, axis=0).reshape((1, 1, BLOCK_H)))

    return chunk_cumsum_backward_kernel


@functools.lru_cache(maxsize=None)
def build_sum_kernel(index_dtype=ct.int32):
    """The second pass: the per-chunk parts summed over (b, c) into dA and ddt_bias."""
    Array = array_type(index_dtype)

    @ct.kernel
    def chunk_cumsum_backward_sum_kernel(
        parts: Array,       # (2, b * c, h) fp32
        dA: Array,          # (h,) out
        ddt_bias: Array,    # (h,) out (HAS_BIAS only)
        rows: int,          # b * c
        BLOCK_ROWS: ConstInt,
        BLOCK_H: ConstInt,
        HAS_BIAS: ConstBool,
    ):
        """Grid: (cdiv(h, BLOCK_H),); the rows in ascending tiles, each reduced as a tree:
        the same order on every run."""
        ih = ct.bid(0)
        acc_a = ct.zeros((BLOCK_H,), dtype=ct.float32)
        acc_b = ct.zeros((BLOCK_H,), dtype=ct.float32)
        for k in range(ct.cdiv(rows, BLOCK_ROWS)):
            t = ct.load(parts, index=(0, k, ih), shape=(1, BLOCK_ROWS, BLOCK_H), padding_mode=ZERO)
            acc_a = acc_a + ct.sum(t.reshape((BLOCK_ROWS, BLOCK_H)), axis=0)
            if HAS_BIAS:
                t = ct.load(parts, index=(1, k, ih), shape=(1, BLOCK_ROWS, BLOCK_H),
                            padding_mode=ZERO)
                acc_b = acc_b + ct.sum(t.reshape((BLOCK_ROWS, BLOCK_H)), axis=0)
        ct.store(dA, index=(ih,), tile=acc_a.astype(dA.dtype))
        if HAS_BIAS:
            ct.store(ddt_bias, index=(ih,), tile=acc_b.astype(ddt_bias.dtype))

    return chunk_cumsum_backward_sum_kernel


def chunk_cumsum_backward_cutile(ddt_out, ddA_cumsum, dt, A, chunk_size, dt_bias=None,
                                 dt_softplus=False, dt_limit=(0.0, math.inf), *, dt_out=None,
                                 config: CumsumBackwardConfig = CumsumBackwardConfig()):
    """The backward of chunk_cumsum in cuTile: the arguments and result of
    :func:`ssd.backward.chunk_cumsum_backward_torch`, plus the tiles (``config``).

    Args:
        ddt_out, ddA_cumsum: (b, h, c, q) fp32 / bf16 / fp16, every stage's contributions
            summed; c = ceil(l / q), q = chunk_size a power of two.
        dt: (b, l, h), A: (h,), dt_bias: optional (h,), fp32 / bf16 / fp16; dt_softplus,
            dt_limit: the forward's.
        dt_out: the forward's (b, h, c, q) step sizes; None recomputes them in the kernel.
    Returns:
        dict with ddt (b, l, h), dA (h,) and, with dt_bias, ddt_bias (h,), in ddA_cumsum's
        dtype, computed in fp32; dA and ddt_bias summed in two passes (per-chunk parts, then
        their sum), the same bits on every run.
    Raises:
        ValueError naming an argument of the wrong shape, dtype or value.
    """
    import torch

    floats = tuple(getattr(torch, d) for d in FLOATS)
    b, l, h = check_array("dt", dt, tuple("blh"), floats)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 or \
            chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: expected a power of two, got {chunk_size!r}")
    q, c = chunk_size, -(-l // chunk_size)
    check_array("A", A, (h,), floats)
    for name, t in (("ddt_out", ddt_out), ("ddA_cumsum", ddA_cumsum), ("dt_out", dt_out)):
        if t is not None or name != "dt_out":
            check_array(name, t, (b, h, c, q), floats)
    if dt_bias is not None:
        check_array("dt_bias", dt_bias, (h,), floats)
    lo, hi = (float(v) for v in dt_limit)
    if math.isnan(lo) or math.isnan(hi) or not 0.0 <= lo <= hi:
        raise ValueError(f"dt_limit: expected 0 <= lo <= hi, got {tuple(dt_limit)!r}")
    dev, f = ddA_cumsum.device, ddA_cumsum.dtype
    ddt = torch.empty((b, l, h), device=dev, dtype=f)
    dA = torch.empty((h,), device=dev, dtype=f)
    dbias = torch.empty((h,), device=dev, dtype=f) if dt_bias is not None else None
    parts = torch.empty((2, b * c, h), device=dev, dtype=torch.float32)
    f32 = lambda t: None if t is None else t.to(torch.float32).contiguous()  # noqa: E731
    args = dict(ddt_out=ddt_out.contiguous(), ddA_cumsum=ddA_cumsum.contiguous(),
                dt=dt.contiguous(), A=f32(A), dt_bias=optional(f32(dt_bias), 1, torch.float32, dev),
                dt_out=optional(None if dt_out is None else dt_out.contiguous(), 4,
                                torch.float32, dev),
                ddt=ddt, parts=parts, seqlen=l, nchunks=c, dt_min=lo, dt_max=hi, Q=q,
                BLOCK_H=config.block_h, HAS_BIAS=dt_bias is not None,
                SOFTPLUS=bool(dt_softplus), HAS_DT_OUT=dt_out is not None)
    launch(build_kernel(index_dtype_for(dt, ddt_out, ddA_cumsum)), (b, c, -(-h // config.block_h)),
           args, device=dev)
    launch(build_sum_kernel(index_dtype_for(parts)), (-(-h // config.block_h),), dict(
        parts=parts, dA=dA, ddt_bias=optional(dbias, 1, torch.float32, dev), rows=b * c,
        BLOCK_ROWS=config.block_rows, BLOCK_H=config.block_h, HAS_BIAS=dbias is not None),
        device=dev)
    out = {"ddt": ddt}  # the torch function's keys, in its order
    if dbias is not None:
        out["ddt_bias"] = dbias
    out["dA"] = dA
    return out
