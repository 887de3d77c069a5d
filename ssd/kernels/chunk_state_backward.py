"""The backward of chunk_state: a chunk's state gradient back to its x, B, dt' and dA_cumsum.

The forward (:mod:`ssd.kernels.chunk_state`) sums, for chunk c of head h (its group's B),

    states[c] = sum_s w_s x_s B_s^T,   w_s = exp(dA_cumsum[q-1] - dA_cumsum[s]) dt'_s

(w_s = 0 for a position of a sequence that ended before the chunk's last valid position). Given
dS = dstates[c] (p x n), with dSB_s = dS B_s (p), the state read back by B_s::

    dx_s          = w_s dSB_s
    dB_s          = sum over the group's heads of w_s dS^T x_s
    dw_s          = x_s . dSB_s
    ddt_out[s]    = dw_s exp(dA_cumsum[q-1] - dA_cumsum[s])
    ddA_cumsum[s] = -dw_s w_s,  and  ddA_cumsum[q-1] += sum_s dw_s w_s

(the exponent dA_cumsum[q-1] - dA_cumsum[s] sends dw_s w_s to the last column with a plus sign
and to column s with a minus; ``ssd.backward.chunk_state_backward_torch`` is the specification).

Two kernels. Their MMAs take operands in the inputs' dtype, dS rounded once to it (and w x,
formed in fp32), with fp32 accumulation, as chunk_scan's backward rounds its weights: on sm_90
fp32 operands compile to CUDA-core multiplies and adds, bf16 ones to tensor-core MMAs
(``cuobjdump -sass``). Everything elementwise is fp32:

* :func:`build_dx_kernel`, one block per (batch, chunk, head): the chunk ``BLOCK_S`` positions
  at a time; for each, dSB over the channel tiles (a K loop over the state tiles), dx stored,
  dw summed over channels; then the row tiles of ddt_out and ddA_cumsum. Walking the whole
  chunk in one block keeps sum_s dw_s w_s, which the last column needs, in the block.
* :func:`build_db_kernel`, one block per (batch, chunk, run of a group's heads, state tile): dB,
  whose contraction runs over the run's heads and their channels (one K loop over both), so that
  its sum never leaves the block; with several runs a group (``head_splits``, as chunk_scan's
  backward: :func:`ssd.config.head_splits`) the host adds the runs' parts in a fixed order.

Positions past the sequence end (a partial last chunk) load as 0 (x, B) and carry dt' = 0, so
they add nothing; row tiles wholly past the end are not loaded (a tile wholly out of bounds is
undefined), and their ddt_out and ddA_cumsum (b, h, c, q rows, in bounds) are written as 0
but the last column.
"""
import functools

import cuda.tile as ct

from ..config import StateBackwardConfig, head_splits, next_pow2
from ..launch import array_type, check_array, gpu_facts, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt, LOG2E, ZERO, chunk_end_decay, head_run

FLOATS = ("float32", "bfloat16", "float16")


def sequence_end(seq_idx, ib, ic, seqlen, Q, HAS_SEQ):
    """Tile code: the [1] sequence id at chunk ``ic``'s last valid position (0 unless
    HAS_SEQ: then unread)."""
    seq_end = ct.zeros((1,), dtype=ct.int32)
    if HAS_SEQ:
        pos = ct.minimum(ic * Q + Q - 1, seqlen - 1)
        seq_end = ct.load(seq_idx, index=(ib, pos), shape=(1, 1)).reshape((1,))
    return seq_end


def row_weights(dt_out, dA_cumsum, seq_idx, last, seq_end, ib, ih, ic, ks, row, BLOCK_S, HAS_SEQ):
    """Tile code: the decay to the chunk's end [S] and the forward's weights w [S] of row tile
    ``ks`` of chunk ``ic`` (``row``: the same tile along l), head ``ih``; both 0 for positions of
    an earlier sequence than ``seq_end``."""
    dacs = ct.load(dA_cumsum, index=(ib, ih, ic, ks), shape=(1, 1, 1, BLOCK_S))
    dts = ct.load(dt_out, index=(ib, ih, ic, ks), shape=(1, 1, 1, BLOCK_S))
    dacs = dacs.reshape((BLOCK_S,)).astype(ct.float32)
    # last - dacs <= 0: the cumulative log-decay only falls, so exp2 never overflows
    decay = ct.exp2((last - dacs) * LOG2E)  # [S]
    if HAS_SEQ:
        seq = ct.load(seq_idx, index=(ib, row), shape=(1, BLOCK_S), padding_mode=ZERO)
        decay = ct.where(seq.reshape((BLOCK_S,)) == seq_end, decay, 0.0)
    return decay, decay * dts.reshape((BLOCK_S,)).astype(ct.float32)


def state_tile(dstates, ib, ic, ih, ip, jn, BLOCK_P, BLOCK_N, dtype):
    """Tile code: the [P, N] tile (ip, jn) of chunk ``ic``'s state gradient, head ``ih``, in
    ``dtype`` (the MMA's operand dtype)."""
    ds = ct.load(dstates, index=(ib, ic, ih, ip, jn), shape=(1, 1, 1, BLOCK_P, BLOCK_N),
                 padding_mode=ZERO)
    return ds.reshape((BLOCK_P, BLOCK_N)).astype(dtype)


@functools.lru_cache(maxsize=None)
def build_dx_kernel(index_dtype=ct.int32, occupancy=None):
    """dx, ddt_out and ddA_cumsum, for arrays indexed by ``index_dtype``, with the compiler's
    occupancy hint (None: its own choice)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def chunk_state_backward_dx_kernel(
        dstates: Array,     # (b, c, h, p, n) any float dtype
        B: Array,           # (b, l, g, n)
        x: Array,           # (b, l, h, p)
        dt_out: Array,      # (b, h, c, q)
        dA_cumsum: Array,   # (b, h, c, q)
        seq_idx: Array,     # (b, l) int32 (ignored unless HAS_SEQ)
        dx_prior: Array,    # (b, l, h, p) x's other gradient, added (ignored unless ACCUMULATE)
        dx: Array,          # (b, l, h, p) out
        ddt_out: Array,     # (b, h, c, q) out
        ddA_cumsum: Array,  # (b, h, c, q) out
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        p_tiles: int,       # cdiv(p, BLOCK_P)
        n_tiles: int,       # cdiv(n, BLOCK_N)
        Q: ConstInt,
        BLOCK_S: ConstInt,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        HAS_SEQ: ConstBool,
        ACCUMULATE: ConstBool,
    ):
        """Grid: (b * c, h); one block walks one chunk of one head."""
        ib = ct.bid(0) // nchunks
        ic = ct.bid(0) % nchunks
        ih = ct.bid(1)
        ig = ih // heads_per_group
        s_per_chunk = Q // BLOCK_S
        last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_S).astype(ct.float32)  # [1]
        seq_end = sequence_end(seq_idx, ib, ic, seqlen, Q, HAS_SEQ)
        total = ct.zeros((1,), dtype=ct.float32)  # sum_s dw_s w_s over the tiles walked so far
        s_end = ct.cdiv(ct.minimum(Q, seqlen - ic * Q), BLOCK_S)  # row tiles holding a position
        for ks in range(s_end):
            row = ic * s_per_chunk + ks  # the row tile along l, in units of BLOCK_S
            decay, w = row_weights(dt_out, dA_cumsum, seq_idx, last, seq_end, ib, ih, ic, ks,
                                   row, BLOCK_S, HAS_SEQ)
            dw = ct.zeros((BLOCK_S,), dtype=ct.float32)
            for ip in range(p_tiles):
                # dSB = B dSᵀ, the state gradient read back by each position's B
                dsb = ct.zeros((BLOCK_S, BLOCK_P), dtype=ct.float32)
                for jn in range(n_tiles):
                    bt = ct.load(B, index=(ib, row, ig, jn), shape=(1, BLOCK_S, 1, BLOCK_N),
                                 padding_mode=ZERO).reshape((BLOCK_S, BLOCK_N))
                    ds = state_tile(dstates, ib, ic, ih, ip, jn, BLOCK_P, BLOCK_N, B.dtype)
                    dsb = ct.mma(bt, ct.transpose(ds), dsb)  # [S, P], fp32 accumulation
                xt = ct.load(x, index=(ib, row, ih, ip), shape=(1, BLOCK_S, 1, BLOCK_P),
                             padding_mode=ZERO).reshape((BLOCK_S, BLOCK_P)).astype(ct.float32)
                dxt = w[:, None] * dsb  # [S, P]
                if ACCUMULATE:  # x's other gradient, from its own array: read in place from
                    # dx, the kernel spilled 1.6 KB a thread on sm_90 (0.4 KB as it is, as without)
                    dxt = dxt + ct.load(dx_prior, index=(ib, row, ih, ip),
                                        shape=(1, BLOCK_S, 1, BLOCK_P),
                                        padding_mode=ZERO).reshape((BLOCK_S, BLOCK_P))
                ct.store(dx, index=(ib, row, ih, ip),
                         tile=dxt.reshape((1, BLOCK_S, 1, BLOCK_P)).astype(dx.dtype))
                dw = dw + ct.sum(xt * dsb, axis=1)  # [S]
            dexp = dw * w  # [S], the gradient of the exponent dA_cumsum[q-1] - dA_cumsum[s]
            total = total + ct.sum(dexp, axis=0, keepdims=True)
            # ks runs upwards, so the tile holding column q-1 comes last and total is complete
            col = ks * BLOCK_S + ct.arange(BLOCK_S, dtype=ct.int32)
            dda = ct.where(col == Q - 1, total, 0.0) - dexp
            ct.store(ddt_out, index=(ib, ih, ic, ks),
                     tile=(dw * decay).reshape((1, 1, 1, BLOCK_S)).astype(ddt_out.dtype))
            ct.store(ddA_cumsum, index=(ib, ih, ic, ks),
                     tile=dda.reshape((1, 1, 1, BLOCK_S)).astype(ddA_cumsum.dtype))
        for ks in range(s_end, s_per_chunk):  # row tiles wholly past the sequence end
            col = ks * BLOCK_S + ct.arange(BLOCK_S, dtype=ct.int32)
            dda = ct.where(col == Q - 1, total, 0.0)
            ct.store(ddt_out, index=(ib, ih, ic, ks),
                     tile=ct.zeros((1, 1, 1, BLOCK_S), dtype=ddt_out.dtype))
            ct.store(ddA_cumsum, index=(ib, ih, ic, ks),
                     tile=dda.reshape((1, 1, 1, BLOCK_S)).astype(ddA_cumsum.dtype))

    return chunk_state_backward_dx_kernel


@functools.lru_cache(maxsize=None)
def build_db_kernel(index_dtype=ct.int32, occupancy=None):
    """dB, summed over each group's heads, for arrays indexed by ``index_dtype``, with the
    compiler's occupancy hint (None: its own choice)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def chunk_state_backward_dB_kernel(
        dstates: Array,     # (b, c, h, p, n) any float dtype
        x: Array,           # (b, l, h, p)
        dt_out: Array,      # (b, h, c, q)
        dA_cumsum: Array,   # (b, h, c, q)
        seq_idx: Array,     # (b, l) int32 (ignored unless HAS_SEQ)
        dB: Array,          # (b, l, g * head_splits, n) out: each run's sum
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        head_splits: int,
        p_tiles: int,       # cdiv(p, BLOCK_P)
        Q: ConstInt,
        BLOCK_S: ConstInt,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        HAS_SEQ: ConstBool,
    ):
        """Grid: (b * c, g * head_splits, cdiv(n, BLOCK_N)); one block walks one chunk for one run
        of a group's heads and one state tile."""
        ib = ct.bid(0) // nchunks
        ic = ct.bid(0) % nchunks
        ig, first, heads = head_run(ct.bid(1), heads_per_group, head_splits)
        jn = ct.bid(2)
        s_per_chunk = Q // BLOCK_S
        seq_end = sequence_end(seq_idx, ib, ic, seqlen, Q, HAS_SEQ)
        s_end = ct.cdiv(ct.minimum(Q, seqlen - ic * Q), BLOCK_S)
        for ks in range(s_end):  # row tiles wholly past the end are never stored: skipped
            row = ic * s_per_chunk + ks
            acc = ct.zeros((BLOCK_S, BLOCK_N), dtype=ct.float32)
            for ih in range(first, first + heads):
                last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_S).astype(ct.float32)
                _, w = row_weights(dt_out, dA_cumsum, seq_idx, last, seq_end, ib, ih, ic, ks,
                                   row, BLOCK_S, HAS_SEQ)
                for ip in range(p_tiles):
                    # dB_s += (w_s x_s) dS: the head's channels are the MMA's K
                    xt = ct.load(x, index=(ib, row, ih, ip), shape=(1, BLOCK_S, 1, BLOCK_P),
                                 padding_mode=ZERO).reshape((BLOCK_S, BLOCK_P)).astype(ct.float32)
                    ds = state_tile(dstates, ib, ic, ih, ip, jn, BLOCK_P, BLOCK_N, x.dtype)
                    # the weight folded into x in fp32, rounded once to the MMA's dtype
                    acc = ct.mma((xt * w[:, None]).astype(x.dtype), ds, acc)  # [S, N]
            ct.store(dB, index=(ib, row, ct.bid(1), jn),
                     tile=acc.reshape((1, BLOCK_S, 1, BLOCK_N)).astype(dB.dtype))

    return chunk_state_backward_dB_kernel


def chunk_state_backward_cutile(dstates, B, x, dt_out, dA_cumsum, seq_idx=None, *, dx_prior=None,
                                dx_dtype=None,
                                config: StateBackwardConfig = StateBackwardConfig()):
    """The backward of chunk_state in cuTile: the arguments and result of
    :func:`ssd.backward.chunk_state_backward_torch`, plus the tiles (``config``).

    Args:
        dstates: (b, c, h, p, n) fp32 / bf16 / fp16 gradient of states.
        B: (b, l, g, n), x: (b, l, h, p), fp32 / bf16 / fp16, h a multiple of g.
        dt_out, dA_cumsum: (b, h, c, q), the forward's stage-1 outputs, c = ceil(l / q).
        seq_idx: optional (b, l) int32 / int64.
        dx_prior: optional contiguous (b, l, h, p) tensor in the compute dtype, x's other gradient
            (chunk_scan's): the kernel adds it to this stage's dx (it is only read), so that no
            sum pass follows.
        dx_dtype: dx's dtype (None: the compute dtype), e.g. x's where dx is the final gradient,
            so that no cast pass follows.
    Returns:
        dict with dB (b, l, g, n), dx (b, l, h, p), ddt_out and ddA_cumsum (b, h, c, q), this
        stage's contributions (dx: plus dx_prior, in dx_dtype), in the compute dtype, fp32
        (dstates may come in x's dtype, which its MMAs take it in).
    Raises:
        ValueError naming an argument of the wrong shape or dtype.
    """
    import torch

    floats = tuple(getattr(torch, d) for d in FLOATS)
    b, l, h, p = check_array("x", x, tuple("blhp"), floats)
    g, n = check_array("B", B, (b, l, "g", "n"), floats)[2:]
    if h % g:
        raise ValueError(f"B: its {g} groups do not divide x's {h} heads")
    q = check_array("dt_out", dt_out, (b, h, "c", "q"), floats)[-1]
    c = -(-l // q)
    if q & (q - 1) or dt_out.shape[2] != c:
        raise ValueError(f"dt_out: expected (b, h, ceil(l / q), q) with q a power of two, got "
                         f"{tuple(dt_out.shape)} for l = {l}")
    check_array("dA_cumsum", dA_cumsum, (b, h, c, q), floats)
    check_array("dstates", dstates, (b, c, h, p, n), floats)
    if seq_idx is not None:
        check_array("seq_idx", seq_idx, (b, l), (torch.int32, torch.int64))
    dev, f = dstates.device, torch.float32
    dstates, B, x, dt_out, dA_cumsum = (t.contiguous() for t in (dstates, B, x, dt_out, dA_cumsum))
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    if dx_prior is not None:
        check_array("dx_prior", dx_prior, (b, l, h, p), (f,))
        if not dx_prior.is_contiguous() or dx_prior.device != dev:
            raise ValueError(f"dx_prior: must be contiguous and on {dev}, got {dx_prior.device}, "
                             f"strides {dx_prior.stride()}")
    dx = torch.empty((b, l, h, p), device=dev, dtype=dx_dtype or f)
    dB = torch.empty((b, l, g, n), device=dev, dtype=f)
    ddt_out = torch.empty((b, h, c, q), device=dev, dtype=f)
    ddA = torch.empty((b, h, c, q), device=dev, dtype=f)
    block_s = min(config.block_s, q)
    block_p = min(config.block_p, next_pow2(p))
    block_n = min(config.block_n, next_pow2(n))
    p_tiles, n_tiles = -(-p // block_p), -(-n // block_n)
    shared = dict(dstates=dstates, dt_out=dt_out, dA_cumsum=dA_cumsum, x=x,
                  seq_idx=optional(seq, 2, torch.int32, dev), seqlen=l, nchunks=c,
                  heads_per_group=h // g, p_tiles=p_tiles, Q=q, BLOCK_S=block_s,
                  BLOCK_P=block_p, BLOCK_N=block_n, HAS_SEQ=seq is not None)
    index = index_dtype_for(dstates, B, x, dx)
    launch(build_dx_kernel(index, config.occupancy), (b * c, h), dict(
        shared, B=B, dx_prior=optional(dx_prior, 4, f, dev), dx=dx, ddt_out=ddt_out,
        ddA_cumsum=ddA, n_tiles=n_tiles, ACCUMULATE=dx_prior is not None), device=dev)
    splits = head_splits(b * c * g * n_tiles, h // g, gpu_facts(dev)[1], config.head_splits)
    dB_runs = dB if splits == 1 else torch.empty((b, l, g * splits, n), device=dev, dtype=f)
    launch(build_db_kernel(index, config.occupancy), (b * c, g * splits, n_tiles),
           dict(shared, dB=dB_runs, head_splits=splits), device=dev)
    if splits > 1:  # the runs' parts, added in a fixed order
        torch.sum(dB_runs.view(b, l, g, splits, n), 3, out=dB)
    return {"dB": dB, "dx": dx, "ddt_out": ddt_out, "ddA_cumsum": ddA}
