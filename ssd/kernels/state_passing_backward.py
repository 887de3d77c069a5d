"""The backward of state_passing: the scan over chunks run from the last chunk to the first.

The forward (:mod:`ssd.kernels.state_passing`) carries the state over each chunk,
P[0] = initial_states (or 0), P[c+1] = d_c P[c] + states[c], final_states = P[C], with
d_c = exp(dA_cumsum[c, q-1]), 0 where a sequence starts inside chunk c (seq_idx). Its adjoint
runs the same recurrence backwards with the same decays; R is the gradient reaching the state
after chunk c::

    R = dfinal_states (or 0)
    for c = C-1 .. 0:
        dstates[c] = R
        ddA_cumsum[c, q-1] = d_c <R, P[c]>      (d d_c / d dA_cumsum[c, q-1] = d_c; <,> sums p, n)
        R = dprev_states[c] + d_c R
    dinitial_states = R

(``ssd.backward.state_passing_backward_torch`` is the specification, line for line.)

A block owns a ``BLOCK_P`` x ``BLOCK_N`` slice of one head's state gradient, R in fp32
registers, and walks the chunks in reverse: b * h * slices blocks, as the forward's walk. The
inner product <R, P[c]> runs over the whole state, across the slices' blocks: each block
stores its slice's part, (b, h, c, slices), and a second small kernel sums each chunk's parts in
a fixed order and writes the rows of ddA_cumsum (zero but the last column). Deterministic: no
atomics, the same sums in the same order on every run.

dprev_states, the gradient chunk_scan sends to the entering states, is a chunk_state of
(dy, C) with decays from each chunk's start. It comes as a tensor, or unformed
(``ssd.backward.EnteringGradient``: chunk_scan's dy and C): then the walk forms each chunk's
slice itself where it adds it to R (``FORM_DPREV``, :func:`ssd.kernels.tiles.entering_gradient`),
one MMA (a K loop) a chunk, and the (b, c, h, p, n) fp32 tensor is never written nor read back.
"""
import functools

import cuda.tile as ct

from ..config import SCAN_BACKWARD_FP32_TILE, PassingBackwardConfig, next_pow2
from ..launch import array_type, check_array, chunk_seq_last, index_dtype_for, launch, optional
from .tiles import ConstBool, ConstInt, LOG2E, ZERO, chunk_end_decay, entering_gradient

FLOATS = ("float32", "bfloat16", "float16")


def seq_at(seq_idx, ib, pos):
    """Tile code: seq_idx[ib, pos] as a [1, 1] int32 tile (``pos`` a scalar position)."""
    return ct.load(seq_idx, index=(ib, pos), shape=(1, 1))


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None):
    """The reverse walk for arrays indexed by ``index_dtype`` (int64 only for huge inputs), with
    the compiler's occupancy hint (None: its own choice)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def state_passing_backward_kernel(
        dprev_states: Array,     # (b, c, h, p, n) any float dtype (ignored if FORM_DPREV)
        prev_states: Array,      # (b, c, h, p, n) any float dtype: the forward's entering states
        dA_cumsum: Array,        # (b, h, c, q) fp32
        dfinal_states: Array,    # (b, h, p, n) (ignored unless HAS_DFINAL)
        seq_idx: Array,          # (b, l) int32 (ignored unless HAS_SEQ)
        dstates: Array,          # (b, c, h, p, n) out
        dinitial_states: Array,  # (b, h, p, n) out (HAS_INIT only)
        ddecay_parts: Array,     # (b, h, c, slices) fp32 out: each slice's part of ddA[c, q-1]
        dy: Array,               # (b, l, h, p) chunk_scan's dy (FORM_DPREV only)
        C: Array,                # (b, l, g, n), dy's MMA dtype (FORM_DPREV only)
        seq_last: Array,         # (b, c) int32 (FORM_DPREV and HAS_SEQ only)
        seqlen: int,
        nchunks: int,
        n_tiles: int,            # cdiv(n, BLOCK_N)
        heads_per_group: int,
        Q: ConstInt,
        BLOCK_K: ConstInt,       # the row length chunk_end_decay reads dA_cumsum's last column in
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        HAS_DFINAL: ConstBool,
        HAS_INIT: ConstBool,
        HAS_SEQ: ConstBool,
        FORM_DPREV: ConstBool,   # form each chunk's dprev_states from (dy, C) instead of loading it
    ):
        """Grid: (b, h, slices); each block walks every chunk of its slice, last to first."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        sl = ct.bid(2)
        ip = sl // n_tiles
        jn = sl % n_tiles
        tile = (1, 1, 1, BLOCK_P, BLOCK_N)
        R = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)  # d loss / d (state after chunk c)
        if HAS_DFINAL:
            R = ct.load(dfinal_states, index=(ib, ih, ip, jn), shape=(1, 1, BLOCK_P, BLOCK_N),
                        padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
        for k in range(nchunks):
            ic = nchunks - 1 - k
            ct.store(dstates, index=(ib, ic, ih, ip, jn),
                     tile=R.reshape(tile).astype(dstates.dtype))
            # d_c, the forward's carry over chunk c: exp of the chunk's whole log-decay (<= 0,
            # so exp2 never overflows), 0 where the sequence at the chunk's last valid position
            # is not the one the previous chunk ended with (a virtual id 0 before chunk 0)
            last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_K).reshape((1, 1))
            decay = ct.exp2(last.astype(ct.float32) * LOG2E)  # [1, 1]
            if HAS_SEQ:
                seq_end = seq_at(seq_idx, ib, ct.minimum(ic * Q + Q - 1, seqlen - 1))
                before = seq_at(seq_idx, ib, ct.maximum(ic * Q - 1, 0))  # chunk c-1's last
                before = ct.where(ic > 0, before, ct.zeros((1, 1), dtype=ct.int32))
                decay = ct.where(seq_end == before, decay, 0.0)
            # this slice's part of <R, P[c]> d_c; the padded rows and columns load as 0
            prev = ct.load(prev_states, index=(ib, ic, ih, ip, jn), shape=tile,
                           padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
            part = ct.sum(ct.sum(R * prev, axis=1, keepdims=True), axis=0, keepdims=True)  # [1, 1]
            ct.store(ddecay_parts, index=(ib, ih, ic, sl), tile=(part * decay).reshape((1, 1, 1, 1)))
            if FORM_DPREV:  # chunk_scan's entering-state gradient, formed where it is consumed
                dprev = entering_gradient(dy, C, dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih,
                                          ih // heads_per_group, ip, jn, Q, BLOCK_K, BLOCK_P,
                                          BLOCK_N, HAS_SEQ)
            else:
                dprev = ct.load(dprev_states, index=(ib, ic, ih, ip, jn), shape=tile,
                                padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
            R = dprev + decay * R  # [P, N], fp32 carry
        if HAS_INIT:
            ct.store(dinitial_states, index=(ib, ih, ip, jn),
                     tile=R.reshape((1, 1, BLOCK_P, BLOCK_N)).astype(dinitial_states.dtype))

    return state_passing_backward_kernel


@functools.lru_cache(maxsize=None)
def build_rows_kernel(index_dtype=ct.int32):
    """The second pass: each chunk's slice parts summed into its row of ddA_cumsum."""
    Array = array_type(index_dtype)

    @ct.kernel
    def state_passing_backward_rows_kernel(
        ddecay_parts: Array,  # (b, h, c, slices) fp32
        ddA_cumsum: Array,    # (b, h, c, q) out
        Q: ConstInt,
        SLICES: ConstInt,     # slices rounded up to a power of two (the tail loads as 0)
    ):
        """Grid: (b, h, c); one block writes one row."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ic = ct.bid(2)
        parts = ct.load(ddecay_parts, index=(ib, ih, ic, 0), shape=(1, 1, 1, SLICES),
                        padding_mode=ZERO).reshape((SLICES,))
        total = ct.sum(parts, axis=0, keepdims=True)  # [1], one tree in one order: deterministic
        col = ct.arange(Q, dtype=ct.int32)
        # only the chunk's whole decay depends on dA_cumsum[c, q-1]; the other columns get 0
        row = ct.where(col == Q - 1, total, 0.0)  # [Q]
        ct.store(ddA_cumsum, index=(ib, ih, ic, 0),
                 tile=row.reshape((1, 1, 1, Q)).astype(ddA_cumsum.dtype))

    return state_passing_backward_rows_kernel


def state_passing_backward_cutile(dprev_states, prev_states, dA_cumsum, initial_states=None,
                                  seq_idx=None, *, dfinal_states=None, dstates_dtype=None,
                                  config: PassingBackwardConfig = PassingBackwardConfig()):
    """The backward of state_passing in cuTile: the arguments and result of
    :func:`ssd.backward.state_passing_backward_torch`, plus the tiles (``config``).

    Args:
        dprev_states: (b, c, h, p, n) fp32 / bf16 / fp16 gradient of prev_states, or an
            ``ssd.backward.EnteringGradient`` that the walk forms it from: dy (b, l, h, p), C
            (b, l, g, n) (the MMA's dtype: dy is rounded to it), seq_last (b, c) int32 or None.
        prev_states: (b, c, h, p, n) fp32 / bf16 / fp16, the forward's entering states.
        dA_cumsum: (b, h, c, q) fp32 / bf16 / fp16; initial_states: the forward's (only
            whether it was given matters); seq_idx: optional (b, l) int32 / int64, l > (c-1) q.
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
        dstates_dtype: dstates' dtype (None: that of the results below); the walk rounds R once
            as it stores it.
    Returns:
        dict with dstates (b, c, h, p, n; in dstates_dtype where given), ddA_cumsum
        (b, h, c, q) (non-zero in the last column only) and, with initial_states,
        dinitial_states (b, h, p, n); in dprev_states' dtype (fp32 where the walk forms it),
        computed in fp32.
    Raises:
        ValueError naming an argument of the wrong shape or dtype.
    """
    import torch

    floats = tuple(getattr(torch, d) for d in FLOATS)
    form = not isinstance(dprev_states, torch.Tensor)  # unformed: the walk forms it from (dy, C)
    dims = tuple("bchpn") if form else check_array("dprev_states", dprev_states, tuple("bchpn"),
                                                   floats)
    b, c, h, p, n = check_array("prev_states", prev_states, dims, floats)
    q = check_array("dA_cumsum", dA_cumsum, (b, h, c, "q"), floats)[-1]
    if q & (q - 1):
        raise ValueError(f"dA_cumsum: its last axis is the chunk size q, a power of two; got {q}")

    def length(name, l):  # a (b, l, ...) argument's l must make the c chunks of q
        if not (c - 1) * q < l <= c * q:
            raise ValueError(f"{name}: its length {l} does not make {c} chunks of {q}")
        return l

    if form:
        dy, C, seq_last = dprev_states
        l = length("dprev_states.dy",
                   check_array("dprev_states.dy", dy, (b, "l", h, p), floats)[1])
        g = check_array("dprev_states.C", C, (b, l, "g", n), floats)[2]  # the MMA's dtype
        if h % g:
            raise ValueError(f"dprev_states.C: its {g} groups do not divide the {h} heads")
    if initial_states is not None:  # never read: only whether it was given matters
        check_array("initial_states", initial_states, (b, h, p, n), floats + (torch.float64,))
    if dfinal_states is not None:
        check_array("dfinal_states", dfinal_states, (b, h, p, n), floats)
    if dstates_dtype not in (None, *floats):
        raise ValueError(f"dstates_dtype: expected one of {', '.join(FLOATS)}, got {dstates_dtype}")
    if seq_idx is not None:
        l = length("seq_idx", check_array("seq_idx", seq_idx, (b, l if form else "l"),
                                          (torch.int32, torch.int64))[1])
    dev = prev_states.device
    f = torch.float32 if form else dprev_states.dtype
    prev_states, dA_cumsum = prev_states.contiguous(), dA_cumsum.contiguous()
    seq = None if seq_idx is None else seq_idx.to(torch.int32).contiguous()
    if form:
        dy, C = dy.contiguous(), C.contiguous()
        if seq is not None and seq_last is None:
            seq_last = chunk_seq_last(seq, q)
        dprev_states = None
    else:
        dy = C = seq_last = None
        dprev_states = dprev_states.contiguous()
    block_p = min(config.block_p, next_pow2(p))
    block_n = min(config.block_n, next_pow2(n))
    block_k = min(64, q)  # the rows a step of the MMA that forms dprev_states (and the decay row)
    if form and C.dtype == torch.float32:  # fp32 MMA operands take twice the registers: on sm_90
        # at 64 x 64 state tiles and 64-row steps the walk spills 3.9 KB a thread, at 32s none
        block_p, block_n, block_k = (min(v, SCAN_BACKWARD_FP32_TILE)
                                     for v in (block_p, block_n, block_k))
    n_tiles = -(-n // block_n)
    slices = -(-p // block_p) * n_tiles
    dstates = torch.empty((b, c, h, p, n), device=dev, dtype=dstates_dtype or f)
    dinitial = torch.empty((b, h, p, n), device=dev, dtype=f) if initial_states is not None else None
    parts = torch.empty((b, h, c, slices), device=dev, dtype=torch.float32)
    ddA = torch.empty((b, h, c, q), device=dev, dtype=f)
    dfinal = None if dfinal_states is None else dfinal_states.contiguous()
    kernel = build_kernel(index_dtype_for(dprev_states, prev_states, dstates, dy, C),
                          config.occupancy)
    launch(kernel, (b, h, slices), dict(
        dprev_states=optional(dprev_states, 5, torch.float32, dev), prev_states=prev_states,
        dA_cumsum=dA_cumsum, dfinal_states=optional(dfinal, 4, torch.float32, dev),
        seq_idx=optional(seq, 2, torch.int32, dev), dstates=dstates,
        dinitial_states=optional(dinitial, 4, torch.float32, dev), ddecay_parts=parts,
        dy=optional(dy, 4, torch.float32, dev), C=optional(C, 4, torch.float32, dev),
        seq_last=optional(seq_last, 2, torch.int32, dev),
        seqlen=l if form or seq is not None else 0,
        nchunks=c, n_tiles=n_tiles, heads_per_group=h // g if form else 1, Q=q,
        BLOCK_K=block_k, BLOCK_P=block_p, BLOCK_N=block_n, HAS_DFINAL=dfinal is not None,
        HAS_INIT=dinitial is not None, HAS_SEQ=seq is not None, FORM_DPREV=form), device=dev)
    launch(build_rows_kernel(index_dtype_for(ddA)), (b, h, c), dict(
        ddecay_parts=parts, ddA_cumsum=ddA, Q=q, SLICES=next_pow2(slices)), device=dev)
    out = {"dstates": dstates, "ddA_cumsum": ddA}
    if dinitial is not None:
        out["dinitial_states"] = dinitial
    return out
