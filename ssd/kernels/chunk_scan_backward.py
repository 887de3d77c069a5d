"""The backward of stage 4, chunk_scan: the gradients of its output's SSM part, in cuTile.

For chunk c of head h (its group's B and C), rows t and columns s of the chunk, a = dA_cumsum
and P_c = prev_states[c], the forward (:mod:`ssd.kernels.chunk_scan`) computes::

    y[t]    = sum_{s <= t} W[t, s] x[s]  +  e^{a[t]} C[t] . P_c
    W[t, s] = (C[t] . B[s]) e^{a[t] - a[s]} dt'[s]       0 outside causal, same-sequence pairs

With dW[t, s] = dy[t] . x[s] and dM[t, s] = dW[t, s] e^{a[t] - a[s]} dt'[s] (the derivation is
``ssd.reference_backward``'s; :func:`ssd.backward.chunk_scan_backward_torch` is the same in
PyTorch, and the contract this module keeps)::

    dx[s]   = sum_t W[t, s] dy[t]                        the transposed (anti-causal) product
    dB[s]   = sum_t dM[t, s] C[t]                        summed over the group's heads
    dC[t]   = sum_s dM[t, s] B[s] + e^{a[t]} dy[t] P_c   summed over the group's heads
    ddt'[s] = sum_t dW[t, s] (C[t] . B[s]) e^{a[t] - a[s]}
    da[k]   = sum_s dW[k, s] W[k, s] - sum_t dW[t, k] W[t, k] + e^{a[k]} dy[k] . (P_c C[k])
    dP_c    = sum_t e^{a[t]} dy[t]ᵀ C[t]                 a chunk_state of (dy, C), decays from
                                                         the chunk's start

Three kernels, each with one job:

1. ``columns``: a block owns one ``block_q`` column block s of one chunk and walks the row
   blocks t >= s (the diagonal tile and those below it): dx, ddt_out, dB and the column part of
   ddA_cumsum (- sum_t dW W), which it stores.
2. ``rows`` (after ``columns``): a block owns one row block t and walks the column blocks
   s <= t: dC (both terms) and the row and entering-state parts of ddA_cumsum, added to the
   column part ``columns`` stored; with z it also rebuilds y's SSM part (one more MMA a tile),
   which the gate's gradient needs.
3. ``states``: dprev_states, one (chunk, head, ``block_n`` state columns) per block. Only where
   ``ScanBackwardConfig.dprev_in_walk`` is off: by default state_passing's backward walk forms
   each chunk's dprev_states from (dy, C) where it consumes it, and the (b, c, h, p, n) fp32
   tensor never reaches memory (the backward's mirror of the forward's fused stage 2).

A (column or row) block walks a run of its group's heads in order (all of them, or one of
``head_splits`` equal runs) and keeps dB (dC) in registers across them, so the sum over a group's
heads needs no atomics: every output element is written by one block, in a fixed order, and the
runs' partial sums are added after the kernels in a fixed order too, so reruns are bitwise
identical. Splitting trades a (b, l, g * head_splits, n) buffer for blocks: with one group and
few chunks, one run a group leaves most SMs idle (:func:`ssd.config.head_splits`).
The tiles C Bᵀ, dW and the decays live only in registers, as in the forward: no (q x q) matrix
reaches memory. MMA operands are rounded to x's dtype (as the forward rounds its weights),
accumulation and the elementwise gradients (ddt_out, ddA_cumsum) are fp32.

Padded tails (l % q != 0): loads past the sequence read zeros (dy = x = 0 there, so every
term vanishes), tiles wholly past it are skipped, and ``columns`` writes ddt_out and ddA_cumsum
of such tiles as zeros: every element of every output is written.

The skip connection's gradients are elementwise over the positions a ``columns`` block owns, so
that block adds them where it is given D (``HAS_D``): dx_s += D dy_s, and its part of
dD = sum_s dy_s x_s, one row of a (b, c * q / BLOCK_Q, h, p) buffer that the host sums (a fixed
order). The gate (z) stays in PyTorch around the kernels
(:func:`ssd.backward.chunk_scan_backward_cutile`, the drop-in for
``chunk_scan_backward_torch``): dy silu(z) before them, dz after.
"""
import functools

import cuda.tile as ct

from ..config import ScanBackwardConfig, head_splits, next_pow2
from ..launch import (array_type, chunk_seq_last, gpu_facts, index_dtype_for, launch,
                      on_launch_device, optional)
from .tiles import (ConstBool, ConstInt, LOG2E, ZERO, chunk_end_decay, chunk_row,
                    entering_gradient, entering_sequence, head_run, rows_of, sequence_ids)

#: The kernels hold a whole head's channels in one tile (and the state's width, up to
#: ``ssd.api.MAX_DSTATE``).
MAX_HEADDIM = 256


# --------------------------------------------------------------------------------------------
# Tile code shared by the kernels
# --------------------------------------------------------------------------------------------


def positions(j, BLOCK_Q):
    """Tile code: [BLOCK_Q] positions in the chunk of its block ``j``."""
    return j * BLOCK_Q + ct.arange(BLOCK_Q, dtype=ct.int32)


def pair_keep(t_pos, s_pos, seq_t, seq_s, HAS_SEQ):
    """Tile code: True where row t takes column s: s <= t and, with HAS_SEQ, one sequence.
    Positions and sequence ids come shaped to broadcast ([T, 1] and [1, S], or the transpose),
    so that one function serves both orientations. The causal part only bites on the diagonal
    tile; it is applied to every tile for one code path."""
    keep = t_pos >= s_pos
    if HAS_SEQ:
        keep = keep & (seq_t == seq_s)
    return keep


def masked_decay(seg, keep):
    """Tile code: e^seg (``seg`` = a_t - a_s) where ``keep``, exactly 0 elsewhere. The difference
    is taken before the scaling to log2 units, so that its rounding is relative to the difference
    and not to dA_cumsum, which grows along the chunk. The exponent is masked, not the product:
    above the diagonal a_t - a_s > 0 and its exp2 could overflow to inf, and inf * 0 = NaN.
    Decays below 2^-126 flush to zero (invisible in the fp32 sums, as in the forward)."""
    return ct.exp2(ct.where(keep, seg * LOG2E, -float("inf")), flush_to_zero=True)


# --------------------------------------------------------------------------------------------
# 1. columns: dx, ddt_out, dB and the column part of ddA_cumsum
# --------------------------------------------------------------------------------------------


def fold_state(dstates, dA_cumsum, ib, ic, ih, js, b_s, x_s, a_s, dt_s, seq_s, seq_end, dxs, db,
               ddt, dda, Q, BLOCK_Q, P_PAD, N_PAD, HAS_SEQ):
    """Tile code: chunk_state's backward (:mod:`.chunk_state_backward`) for the positions s of
    column block ``js``, head ``ih``, added to the column block's gradients: with dS = dstates of
    the chunk [P, N], w_s = e^{a_last - a_s} dt'_s (0 for an earlier sequence than the chunk's
    last valid position's) and dSB_s = dS B_s, dx_s += w_s dSB_s, dB_s += w_s dSᵀ x_s,
    ddt_out[s] += dw_s e^{a_last - a_s} and ddA_cumsum[s] -= dw_s w_s, dw_s = x_s . dSB_s.
    Returns (dxs, db, ddt, dda, total): the first four with their parts added, ``total`` [1] the
    block's sum of dw_s w_s, which ddA_cumsum[q-1] takes (the rows kernel adds it there)."""
    last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_Q).astype(ct.float32)  # [1]
    decay = ct.exp2((last - a_s) * LOG2E)  # [S], <= 1: the log-decay only falls along the chunk
    if HAS_SEQ:
        decay = ct.where(seq_s == seq_end, decay, 0.0)
    w = decay * dt_s  # [S]
    ds = ct.load(dstates, index=(ib, ic, ih, 0, 0), shape=(1, 1, 1, P_PAD, N_PAD),
                 padding_mode=ZERO).reshape((P_PAD, N_PAD)).astype(x_s.dtype)  # [P, N]
    dsb = ct.mma(b_s, ct.transpose(ds), ct.zeros((BLOCK_Q, P_PAD), dtype=ct.float32))  # [S, P]
    xf = x_s.astype(ct.float32)  # [S, P]
    dw = ct.sum(xf * dsb, axis=1)  # [S]
    # the weight folded into x in fp32, rounded once to the MMA's dtype, as chunk_state's does
    db = ct.mma((xf * w[:, None]).astype(x_s.dtype), ds, db)  # [S, N]
    dexp = dw * w  # [S], the gradient of the exponent a_last - a_s
    return (dxs + w[:, None] * dsb, db, ddt + dw * decay, dda - dexp,
            ct.sum(dexp, axis=0, keepdims=True))


def column_block(ib, ic, part, js, x, B, C, dy, dt_out, dA_cumsum, seq_idx, D, dstates, seq_last,
                 dx, dB, ddt_out, ddA_cumsum, dD_parts, state_total, seqlen, heads_per_group,
                 head_splits, Q, BLOCK_Q, P_PAD, N_PAD, HAS_SEQ, HAS_D, FOLD):
    """Tile code: column block ``js`` of chunk ``ic`` (batch row ``ib``) for the run of heads
    ``part`` (:func:`.tiles.head_run`): stores dx [S, P] and ddt_out, ddA_cumsum (its column
    part) [S] per head and dB [S, N] summed over the run's heads, at ``part`` of dB's third
    axis; HAS_D, dx with the skip's D dy and, per head, the block's part of dD [P]; FOLD, each
    with chunk_state's backward added (:func:`fold_state`) and the block's sum of dw_s w_s,
    which belongs to the chunk's last column, stored at ``state_total[ib, ih, ic, js]``."""
    ig, first, heads = head_run(part, heads_per_group, head_splits)
    q_tiles = Q // BLOCK_Q
    cols = ic * q_tiles + js  # the column block, in BLOCK_Q tiles of the sequence
    if ic * Q + js * BLOCK_Q < seqlen:
        b_s = rows_of(B, ib, cols, ig, 0, BLOCK_Q, N_PAD, x.dtype)  # [S, N]
        seq_s = ct.zeros((BLOCK_Q,), dtype=ct.int32)  # unread without HAS_SEQ
        if HAS_SEQ:
            seq_s = sequence_ids(seq_idx, ib, cols, BLOCK_Q)
        # row blocks up to the last one holding a position of the sequence (a tile wholly past
        # its end is undefined for load)
        t_end = ct.cdiv(ct.minimum(Q, seqlen - ic * Q), BLOCK_Q)
        db = ct.zeros((BLOCK_Q, N_PAD), dtype=ct.float32)  # [S, N], the run's heads summed
        seq_end = ct.zeros((1,), dtype=ct.int32)  # unread without FOLD and HAS_SEQ
        if FOLD and HAS_SEQ:  # the sequence of the chunk's last valid position: its state's
            seq_end = ct.load(seq_last, index=(ib, ic), shape=(1, 1)).reshape((1,))
        for ih in range(first, first + heads):
            a_s = chunk_row(dA_cumsum, ib, ih, ic, js, BLOCK_Q)  # [S]
            dt_s = chunk_row(dt_out, ib, ih, ic, js, BLOCK_Q)  # [S]
            x_s = rows_of(x, ib, cols, ih, 0, BLOCK_Q, P_PAD, x.dtype)  # [S, P]
            dxs = ct.zeros((BLOCK_Q, P_PAD), dtype=ct.float32)  # [S, P]
            ddt = ct.zeros((BLOCK_Q,), dtype=ct.float32)  # [S]
            dda = ct.zeros((BLOCK_Q,), dtype=ct.float32)  # [S]
            if HAS_D:  # the skip y += D x: dx_s += D dy_s, dD += sum_s dy_s x_s
                dy_s = rows_of(dy, ib, cols, ih, 0, BLOCK_Q, P_PAD, ct.float32)  # [S, P]
                d = ct.load(D, index=(ih, 0), shape=(1, P_PAD), padding_mode=ZERO)  # [1, P]
                dxs = dxs + dy_s * d
                dd = ct.sum(dy_s * x_s.astype(ct.float32), axis=0)  # [P]
                ct.store(dD_parts, index=(ib, cols, ih, 0), tile=dd.reshape((1, 1, 1, P_PAD)))
            for it in range(js, t_end):  # rows t >= s: the diagonal tile, then those below it
                rows = ic * q_tiles + it
                c_t = rows_of(C, ib, rows, ig, 0, BLOCK_Q, N_PAD, x.dtype)  # [T, N]
                dy_t = rows_of(dy, ib, rows, ih, 0, BLOCK_Q, P_PAD, x.dtype)  # [T, P]
                a_t = chunk_row(dA_cumsum, ib, ih, ic, it, BLOCK_Q)  # [T]
                seq_t = seq_s
                if HAS_SEQ:
                    seq_t = sequence_ids(seq_idx, ib, rows, BLOCK_Q)
                # Tiles [S, T], columns of the chunk first: the MMAs below then take them as
                # they are, where the [T, S] tiles would need a transpose in registers.
                keep = pair_keep(positions(it, BLOCK_Q)[None, :], positions(js, BLOCK_Q)[:, None],
                                 seq_t[None, :], seq_s[:, None], HAS_SEQ)
                decay = masked_decay(a_t[None, :] - a_s[:, None], keep)  # [S, T]
                zero = ct.zeros((BLOCK_Q, BLOCK_Q), dtype=ct.float32)
                cbl = ct.mma(b_s, ct.transpose(c_t), zero) * decay  # [S, T] (C_t . B_s) L
                dw = ct.mma(x_s, ct.transpose(dy_t), zero)  # [S, T] dW = dy_t . x_s
                w = cbl * dt_s[:, None]  # [S, T] the forward's weights
                dxs = ct.mma(w.astype(x.dtype), dy_t, dxs)  # [S, P] += Wᵀ dy
                ddt = ddt + ct.sum(dw * cbl, axis=1)  # [S]
                # the exponent a_t - a_s: dW W goes to column s with a minus sign
                dda = dda - ct.sum(dw * w, axis=1)  # [S]
                dm = dw * decay * dt_s[:, None]  # [S, T] dM of this head
                db = ct.mma(dm.astype(x.dtype), c_t, db)  # [S, N] += dMᵀ C
            if FOLD:
                dxs, db, ddt, dda, total = fold_state(
                    dstates, dA_cumsum, ib, ic, ih, js, b_s, x_s, a_s, dt_s, seq_s, seq_end, dxs,
                    db, ddt, dda, Q, BLOCK_Q, P_PAD, N_PAD, HAS_SEQ)
                ct.store(state_total, index=(ib, ih, ic, js), tile=total.reshape((1, 1, 1, 1)))
            ct.store(dx, index=(ib, cols, ih, 0),
                     tile=dxs.reshape((1, BLOCK_Q, 1, P_PAD)).astype(dx.dtype))
            ct.store(ddt_out, index=(ib, ih, ic, js), tile=ddt.reshape((1, 1, 1, BLOCK_Q)))
            ct.store(ddA_cumsum, index=(ib, ih, ic, js), tile=dda.reshape((1, 1, 1, BLOCK_Q)))
        ct.store(dB, index=(ib, cols, part, 0), tile=db.reshape((1, BLOCK_Q, 1, N_PAD)))
    else:  # wholly past the sequence end: the (b, h, c, q) gradients and dD's parts are 0 there
        nothing = ct.zeros((1, 1, 1, BLOCK_Q), dtype=ct.float32)
        for ih in range(first, first + heads):
            ct.store(ddt_out, index=(ib, ih, ic, js), tile=nothing)
            ct.store(ddA_cumsum, index=(ib, ih, ic, js), tile=nothing)
            if HAS_D:
                ct.store(dD_parts, index=(ib, cols, ih, 0),
                         tile=ct.zeros((1, 1, 1, P_PAD), dtype=ct.float32))
            if FOLD:
                ct.store(state_total, index=(ib, ih, ic, js),
                         tile=ct.zeros((1, 1, 1, 1), dtype=ct.float32))


# --------------------------------------------------------------------------------------------
# 2. rows: dC, the row and entering-state parts of ddA_cumsum, y's SSM part with z
# --------------------------------------------------------------------------------------------


def row_block(ib, ic, part, it, x, B, C, dy, dt_out, dA_cumsum, prev_states, seq_idx, seq_last,
              state_total, dC, ddA_cumsum, y_ssm, seqlen, heads_per_group, head_splits, Q,
              BLOCK_Q, P_PAD, N_PAD, COLUMN_TILES, HAS_SEQ, REBUILD_Y, FOLD):
    """Tile code: row block ``it`` of chunk ``ic`` (batch row ``ib``) for the run of heads
    ``part`` (:func:`.tiles.head_run`): adds the row and entering-state parts of ddA_cumsum [T]
    to the column part stored by ``columns``, per head; stores dC [T, N] summed over the run's
    heads, at ``part`` of dC's third axis, and, REBUILD_Y, y_ssm [T, P] per head. FOLD, the last
    row block also adds the ``COLUMN_TILES`` column blocks' sums of dw_s w_s (``state_total``) to
    the chunk's last column. A tile wholly past the sequence end is left alone (``columns``
    wrote its ddA_cumsum: zeros; :func:`chunk_scan_backward` adds a last column's sum there: a
    branch for it here would raise every block's shared memory and spills)."""
    ig, first, heads = head_run(part, heads_per_group, head_splits)
    q_tiles = Q // BLOCK_Q
    rows = ic * q_tiles + it  # the row block, in BLOCK_Q tiles of the sequence
    if ic * Q + it * BLOCK_Q < seqlen:
        c_t = rows_of(C, ib, rows, ig, 0, BLOCK_Q, N_PAD, x.dtype)  # [T, N]
        seq_t = ct.zeros((BLOCK_Q,), dtype=ct.int32)  # unread without HAS_SEQ
        if HAS_SEQ:
            seq_t = sequence_ids(seq_idx, ib, rows, BLOCK_Q)
            enters = seq_t == entering_sequence(seq_last, ib, ic)  # [T] t continues the
            # sequence whose state enters the chunk
        dc = ct.zeros((BLOCK_Q, N_PAD), dtype=ct.float32)  # [T, N], the run's heads summed
        for ih in range(first, first + heads):
            a_t = chunk_row(dA_cumsum, ib, ih, ic, it, BLOCK_Q)  # [T]
            dy_f = rows_of(dy, ib, rows, ih, 0, BLOCK_Q, P_PAD, ct.float32)  # [T, P]
            dy_t = dy_f.astype(x.dtype)  # the MMA operand

            # The entering state's term e^{a_t} C_t . P_c: dC_t += e^{a_t} dy_t P_c and
            # da_t += e^{a_t} dy_t . (C_t P_cᵀ)
            decay_in = ct.exp2(a_t * LOG2E)  # [T], <= 1 (a_t <= 0)
            if HAS_SEQ:
                decay_in = ct.where(enters, decay_in, 0.0)
            prev = ct.load(prev_states, index=(ib, ic, ih, 0, 0), shape=(1, 1, 1, P_PAD, N_PAD),
                           padding_mode=ZERO).reshape((P_PAD, N_PAD)).astype(x.dtype)  # [P, N]
            cp = ct.mma(c_t, ct.transpose(prev), ct.zeros((BLOCK_Q, P_PAD), dtype=ct.float32))
            dda = decay_in * ct.sum(dy_f * cp, axis=1)  # [T]
            dy_in = (dy_f * decay_in[:, None]).astype(x.dtype)  # [T, P]
            dc = ct.mma(dy_in, prev, dc)  # [T, N]
            if REBUILD_Y:
                y = cp * decay_in[:, None]  # [T, P] y's entering-state part

            # The diagonal block: column blocks up to the row block's own (all in the sequence)
            for js in range(it + 1):
                cols = ic * q_tiles + js
                b_s = rows_of(B, ib, cols, ig, 0, BLOCK_Q, N_PAD, x.dtype)  # [S, N]
                x_s = rows_of(x, ib, cols, ih, 0, BLOCK_Q, P_PAD, x.dtype)  # [S, P]
                a_s = chunk_row(dA_cumsum, ib, ih, ic, js, BLOCK_Q)  # [S]
                dt_s = chunk_row(dt_out, ib, ih, ic, js, BLOCK_Q)  # [S]
                seq_s = seq_t
                if HAS_SEQ:
                    seq_s = sequence_ids(seq_idx, ib, cols, BLOCK_Q)
                keep = pair_keep(positions(it, BLOCK_Q)[:, None], positions(js, BLOCK_Q)[None, :],
                                 seq_t[:, None], seq_s[None, :], HAS_SEQ)
                decay = masked_decay(a_t[:, None] - a_s[None, :], keep)  # [T, S]
                zero = ct.zeros((BLOCK_Q, BLOCK_Q), dtype=ct.float32)
                cb = ct.mma(c_t, ct.transpose(b_s), zero)  # [T, S] C_t . B_s
                dw = ct.mma(dy_t, ct.transpose(x_s), zero)  # [T, S] dW = dy_t . x_s
                ldt = decay * dt_s[None, :]  # [T, S]
                dm = dw * ldt  # [T, S] dM of this head
                # the exponent a_t - a_s: dW W = dM (C Bᵀ) goes to row t with a plus sign
                dda = dda + ct.sum(dm * cb, axis=1)  # [T]
                dc = ct.mma(dm.astype(x.dtype), b_s, dc)  # [T, N] += dM B
                if REBUILD_Y:
                    y = ct.mma((cb * ldt).astype(x.dtype), x_s, y)  # [T, P] += W x

            col = chunk_row(ddA_cumsum, ib, ih, ic, it, BLOCK_Q)  # [T] the column part
            if FOLD:
                if it == q_tiles - 1:  # the row block that holds the last column
                    dda = dda + state_sum(state_total, ib, ih, ic, it, BLOCK_Q, Q, COLUMN_TILES)
            ct.store(ddA_cumsum, index=(ib, ih, ic, it),
                     tile=(col + dda).reshape((1, 1, 1, BLOCK_Q)))
            if REBUILD_Y:
                ct.store(y_ssm, index=(ib, rows, ih, 0), tile=y.reshape((1, BLOCK_Q, 1, P_PAD)))
        ct.store(dC, index=(ib, rows, part, 0), tile=dc.reshape((1, BLOCK_Q, 1, N_PAD)))


def state_sum(state_total, ib, ih, ic, it, BLOCK_Q, Q, COLUMN_TILES):
    """Tile code: [T] row block ``it``'s part of chunk_state's ddA_cumsum for chunk ``ic`` of
    head ``ih``: at the chunk's last column the sum of dw_s w_s over the chunk (its column
    blocks' parts, added in a fixed order), 0 elsewhere."""
    parts = ct.load(state_total, index=(ib, ih, ic, 0), shape=(1, 1, 1, COLUMN_TILES))
    total = ct.sum(parts.reshape((COLUMN_TILES,)), axis=0, keepdims=True)  # [1]
    return ct.where(positions(it, BLOCK_Q) == Q - 1, total, 0.0)


# 3. states: dprev_states, a chunk_state of (dy, C) with decays from the chunk's start
#    (:func:`ssd.kernels.tiles.entering_gradient`; state_passing's backward forms it instead
#    where ScanBackwardConfig.dprev_in_walk)


@functools.lru_cache(maxsize=None)
def build_kernels(index_dtype=ct.int32, occupancy=None, warps=None):
    """The three kernels (columns, rows, states) for one index width and set of hints."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def chunk_scan_backward_columns_kernel(
        x: Array,           # (b, l, h, p)
        B: Array,           # (b, l, g, n), x's dtype
        C: Array,           # (b, l, g, n), x's dtype
        dy: Array,          # (b, l, h, p) gradient of y's SSM part, any float dtype
        dt_out: Array,      # (b, h, c, q) fp32
        dA_cumsum: Array,   # (b, h, c, q) fp32
        seq_idx: Array,     # (b, l) int32 (ignored unless HAS_SEQ)
        D: Array,           # (h, p) fp32 (ignored unless HAS_D)
        dstates: Array,     # (b, c, h, p, n) any float dtype (ignored unless FOLD)
        seq_last: Array,    # (b, c) int32 (read only with FOLD and HAS_SEQ)
        dx: Array,          # (b, l, h, p) out, any float dtype
        dB: Array,          # (b, l, g * head_splits, n) fp32 out: each run's sum
        ddt_out: Array,     # (b, h, c, q) fp32 out
        ddA_cumsum: Array,  # (b, h, c, q) fp32 out: the column part
        dD_parts: Array,    # (b, c * q / BLOCK_Q, h, p) fp32 out: dD per column block (HAS_D)
        state_total: Array,  # (b, h, c, q / BLOCK_Q) fp32 out (FOLD): sum_s dw_s w_s a block
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        head_splits: int,
        Q: ConstInt,
        BLOCK_Q: ConstInt,
        P_PAD: ConstInt,
        N_PAD: ConstInt,
        HAS_SEQ: ConstBool,
        HAS_D: ConstBool,
        FOLD: ConstBool,
    ):
        """Grid: (b * c, g * head_splits, q / BLOCK_Q), one column block of one chunk and run
        of heads a block."""
        column_block(ct.bid(0) // nchunks, ct.bid(0) % nchunks, ct.bid(1), ct.bid(2), x, B, C, dy,
                     dt_out, dA_cumsum, seq_idx, D, dstates, seq_last, dx, dB, ddt_out,
                     ddA_cumsum, dD_parts, state_total, seqlen, heads_per_group, head_splits, Q,
                     BLOCK_Q, P_PAD, N_PAD, HAS_SEQ, HAS_D, FOLD)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def chunk_scan_backward_rows_kernel(
        x: Array,            # (b, l, h, p)
        B: Array,            # (b, l, g, n), x's dtype
        C: Array,            # (b, l, g, n), x's dtype
        dy: Array,           # (b, l, h, p) gradient of y's SSM part, any float dtype
        dt_out: Array,       # (b, h, c, q) fp32
        dA_cumsum: Array,    # (b, h, c, q) fp32
        prev_states: Array,  # (b, c, h, p, n) the entering states, any float dtype
        seq_idx: Array,      # (b, l) int32 (ignored unless HAS_SEQ)
        seq_last: Array,     # (b, c) int32: seq_idx at each chunk's last valid position
        state_total: Array,  # (b, h, c, COLUMN_TILES) fp32 (ignored unless FOLD)
        dC: Array,           # (b, l, g * head_splits, n) fp32 out: each run's sum
        ddA_cumsum: Array,   # (b, h, c, q) fp32 in: the column part; out: the whole
        y_ssm: Array,        # (b, l, h, p) fp32 out (ignored unless REBUILD_Y)
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        head_splits: int,
        Q: ConstInt,
        BLOCK_Q: ConstInt,
        P_PAD: ConstInt,
        N_PAD: ConstInt,
        COLUMN_TILES: ConstInt,  # q / the columns kernel's BLOCK_Q
        HAS_SEQ: ConstBool,
        REBUILD_Y: ConstBool,
        FOLD: ConstBool,
    ):
        """Grid: (b * c, g * head_splits, q / BLOCK_Q), one row block of one chunk and run of
        heads a block; after the columns kernel, whose ddA_cumsum it completes."""
        row_block(ct.bid(0) // nchunks, ct.bid(0) % nchunks, ct.bid(1), ct.bid(2), x, B, C, dy,
                  dt_out, dA_cumsum, prev_states, seq_idx, seq_last, state_total, dC, ddA_cumsum,
                  y_ssm, seqlen, heads_per_group, head_splits, Q, BLOCK_Q, P_PAD, N_PAD,
                  COLUMN_TILES, HAS_SEQ, REBUILD_Y, FOLD)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def chunk_scan_backward_states_kernel(
        dy: Array,            # (b, l, h, p) gradient of y's SSM part, any float dtype
        C: Array,             # (b, l, g, n), x's dtype (the MMA's)
        dA_cumsum: Array,     # (b, h, c, q) fp32
        seq_idx: Array,       # (b, l) int32 (ignored unless HAS_SEQ)
        seq_last: Array,      # (b, c) int32
        dprev_states: Array,  # (b, c, h, p, n) fp32 out
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        Q: ConstInt,
        BLOCK_K: ConstInt,
        P_PAD: ConstInt,
        BLOCK_N: ConstInt,
        HAS_SEQ: ConstBool,
    ):
        """Grid: (b * c, h, cdiv(n, BLOCK_N)), one chunk, head and slice of the state a block."""
        ib, ic, ih, jn = ct.bid(0) // nchunks, ct.bid(0) % nchunks, ct.bid(1), ct.bid(2)
        acc = entering_gradient(dy, C, dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih,
                                ih // heads_per_group, 0, jn, Q, BLOCK_K, P_PAD, BLOCK_N, HAS_SEQ)
        ct.store(dprev_states, index=(ib, ic, ih, 0, jn),
                 tile=acc.reshape((1, 1, 1, P_PAD, BLOCK_N)))

    return (chunk_scan_backward_columns_kernel, chunk_scan_backward_rows_kernel,
            chunk_scan_backward_states_kernel)


# --------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------


def launch_splits(config: ScanBackwardConfig, b, nchunks, h, g, q, device) -> int:
    """The head splits a launch of ``config`` (fitted to the problem) takes:
    :func:`ssd.config.head_splits` for the columns kernel's grid before splitting, on
    ``device``'s GPU (ValueError where config.head_splits does not divide the heads per
    group)."""
    return head_splits(b * nchunks * g * (q // config.block_q), h // g, gpu_facts(device)[1],
                       config.head_splits)


def chunk_scan_backward(dy, B, C, x, dt_out, dA_cumsum, prev_states, seq_idx=None, seq_last=None,
                        config: ScanBackwardConfig = ScanBackwardConfig(), rebuild_y=False,
                        D=None, dstates=None, dx_dtype=None):
    """Launch the kernels: the gradients of chunk_scan's SSM part and, with D, of the skip
    connection y += D x (no z: ``dy`` is the gradient after the gate). The states kernel only
    where ``config.dprev_in_walk`` is off. Given ``dstates``, chunk_scan's and chunk_state's
    backward in one pass (:func:`fold_state`).

    Args:
        dy: (b, l, h, p) gradient of y's SSM part, fp32, bf16 or fp16.
        B, C: (b, l, g, n) in x's dtype; x: (b, l, h, p) fp32, bf16 or fp16.
        dt_out, dA_cumsum: (b, h, c, q) fp32; prev_states: (b, c, h, p, n), fp32, bf16 or fp16.
        seq_idx: optional (b, l) int32; seq_last: its (b, c) int32 value at each chunk's last
            valid position (:func:`ssd.launch.chunk_seq_last`; None computes it).
        config: the tiles, fitted to the problem and x's dtype here
            (:meth:`ScanBackwardConfig.for_problem`), and the splits of a group's heads (None:
            :func:`ssd.config.head_splits` for x's GPU).
        rebuild_y: also return y's SSM part, y_ssm (b, l, h, p) fp32 (the gate's gradient reads
            it).
        D: optional (h,) or (h, p) skip weights: dx then holds D dy too, and dD is returned.
        dstates: optional (b, c, h, p, n) gradient of chunk_state's per-chunk states (state
            passing's backward's), fp32, bf16 or fp16, read in x's dtype: dx, dB, ddt_out and
            ddA_cumsum then hold chunk_state's parts too.
        dx_dtype: dx's dtype (None: fp32), x's where it is the final gradient.
    Returns:
        dict of fp32 tensors (dx: dx_dtype): dB and dC (b, l, g, n), dx (b, l, h, p), ddt_out
        and ddA_cumsum (b, h, c, q), dprev_states (b, c, h, p, n; None where
        config.dprev_in_walk), with D dD (D's shape), and with rebuild_y y_ssm (b, l, h, p).
    Raises:
        ValueError: config.head_splits does not divide the heads per group.
    """
    import torch

    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _, _, nchunks, q = dt_out.shape
    dev, f = x.device, torch.float32
    config = config.for_problem(q, n, x.dtype)
    splits = launch_splits(config, b, nchunks, h, g, q, dev)
    grid = (b * nchunks, g * splits, q // config.block_q)
    out = dict(dB=torch.empty((b, l, g * splits, n), dtype=f, device=dev),
               dC=torch.empty((b, l, g * splits, n), dtype=f, device=dev),
               dx=torch.empty((b, l, h, p), dtype=dx_dtype or f, device=dev),
               ddt_out=torch.empty((b, h, nchunks, q), dtype=f, device=dev),
               ddA_cumsum=torch.empty((b, h, nchunks, q), dtype=f, device=dev),
               dprev_states=None if config.dprev_in_walk else
               torch.empty((b, nchunks, h, p, n), dtype=f, device=dev))
    y_ssm = torch.empty((b, l, h, p), dtype=f, device=dev) if rebuild_y else None
    # D as (h, p) fp32 (a per-head D broadcast over the channels); each column block's dD
    D_hp = None if D is None else D.to(f).reshape(h, -1).expand(h, p).contiguous()
    dD_parts = None if D is None else torch.empty((b, nchunks * (q // config.block_q), h, p),
                                                  dtype=f, device=dev)
    fold = dstates is not None
    # each column block's sum of chunk_state's dw_s w_s, which the rows kernel adds up
    state_total = (torch.empty((b, h, nchunks, q // config.block_q), dtype=f, device=dev)
                   if fold else None)
    has_seq = seq_idx is not None
    if has_seq and seq_last is None:
        seq_last = chunk_seq_last(seq_idx, q)
    seq_idx = optional(seq_idx, 2, torch.int32, dev)
    seq_last = optional(seq_last, 2, torch.int32, dev)
    columns, rows, states = build_kernels(
        index_dtype_for(x, dy, B, C, prev_states, dstates, *out.values()), config.occupancy,
        config.warps)
    sizes = dict(seqlen=l, nchunks=nchunks, heads_per_group=h // g, Q=q, P_PAD=next_pow2(p),
                 HAS_SEQ=has_seq)
    diagonal = dict(x=x, B=B, C=C, dy=dy, dt_out=dt_out, dA_cumsum=dA_cumsum, seq_idx=seq_idx,
                    ddA_cumsum=out["ddA_cumsum"], BLOCK_Q=config.block_q, N_PAD=next_pow2(n),
                    head_splits=splits, **sizes)
    state_total_arg = optional(state_total, 4, f, dev)
    launch(columns, grid, dict(dx=out["dx"], dB=out["dB"], ddt_out=out["ddt_out"],
                               D=optional(D_hp, 2, f, dev), dD_parts=optional(dD_parts, 4, f, dev),
                               dstates=optional(dstates, 5, x.dtype, dev), seq_last=seq_last,
                               state_total=state_total_arg, HAS_D=D is not None, FOLD=fold,
                               **diagonal), device=dev)
    # after columns, on the same stream: rows adds to the ddA_cumsum columns stored, position by
    # position, so its tiles may differ from theirs
    launch(rows, (grid[0], grid[1], q // config.rows_block_q), dict(
        diagonal, prev_states=prev_states, seq_last=seq_last, dC=out["dC"],
        y_ssm=optional(y_ssm, 4, f, dev), REBUILD_Y=rebuild_y, BLOCK_Q=config.rows_block_q,
        state_total=state_total_arg, COLUMN_TILES=q // config.block_q, FOLD=fold), device=dev)
    if fold and nchunks * q - config.rows_block_q >= l:
        # the last chunk's last row block lies wholly past the sequence end: rows skipped it,
        # and its last column takes chunk_state's sum over the chunk here
        out["ddA_cumsum"][:, :, -1, -1] += state_total[:, :, -1].sum(-1)
    if not config.dprev_in_walk:
        launch(states, (b * nchunks, h, -(-n // config.block_n)), dict(
            dy=dy, C=C, dA_cumsum=dA_cumsum, seq_idx=seq_idx, seq_last=seq_last,
            dprev_states=out["dprev_states"], BLOCK_K=config.block_k, BLOCK_N=config.block_n,
            **sizes), device=dev)
    if splits > 1:  # the runs' partial sums, added in a fixed order
        for k in ("dB", "dC"):
            out[k] = out[k].view(b, l, g, splits, n).sum(3)
    if D is not None:  # the column blocks' parts, summed in a fixed order
        dD = dD_parts.sum((0, 1))  # (h, p)
        out["dD"] = dD.sum(-1) if D.dim() == 1 else dD
    if rebuild_y:
        out["y_ssm"] = y_ssm
    return out


def check_inputs(dy, B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None, seq_idx=None):
    """Check the arguments of :func:`ssd.backward.chunk_scan_backward_cutile`; return the sizes
    (b, l, h, p, n, g, c, q). Raises ValueError naming the argument and what it expected."""
    import torch

    from ..config import CHUNK_SIZES, MAX_DSTATE
    from ..reference import check_shapes

    floats = (torch.float32, torch.bfloat16, torch.float16)
    tensors = dict(dy=dy, B=B, C=C, x=x, dt_out=dt_out, dA_cumsum=dA_cumsum,
                   prev_states=prev_states, D=D, z=z, seq_idx=seq_idx)
    for name, t in tensors.items():
        if t is None and name not in ("D", "z", "seq_idx"):
            raise ValueError(f"{name}: expected a torch.Tensor, got None")
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != x.device:
            raise ValueError(f"{name}: on {t.device}, but x is on {x.device}; all inputs must "
                             "share one CUDA device")
        allowed = (torch.int32, torch.int64) if name == "seq_idx" else floats
        if name in ("dt_out", "dA_cumsum"):
            allowed = (torch.float32,)  # stage 1's outputs, as the forward stores them
        if t.dtype not in allowed:
            hint = (" (float64 is the PyTorch backward's: ssd.backward.chunk_scan_backward_torch)"
                    if t.dtype == torch.float64 and name not in ("dt_out", "dA_cumsum") else "")
            raise ValueError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                             f"{', '.join(str(d) for d in allowed)}{hint}")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"dy: expected x's shape (b, l, h, p) = {tuple(x.shape)}, "
                         f"got {tuple(dy.shape)}")
    if dA_cumsum.dim() != 4 or dA_cumsum.shape[-1] not in CHUNK_SIZES:
        raise ValueError(f"dA_cumsum: expected (b, h, c, q) with q a power of two in "
                         f"{CHUNK_SIZES}, got {tuple(dA_cumsum.shape)}")
    dims = check_shapes(chunk_size=int(dA_cumsum.shape[-1]), **{
        name: None if t is None else tuple(t.shape)
        for name, t in (("x", x), ("B", B), ("C", C), ("D", D), ("z", z), ("seq_idx", seq_idx),
                        ("dt_out", dt_out), ("dA_cumsum", dA_cumsum),
                        ("prev_states", prev_states))})
    if dims["l"] < 1:
        raise ValueError("x: expected a sequence of at least one position, got l = 0")
    if dims["p"] > MAX_HEADDIM:
        raise ValueError(f"x: headdim p={dims['p']} is larger than the {MAX_HEADDIM} the "
                         "kernels hold in one tile")
    if dims["n"] > MAX_DSTATE:
        raise ValueError(f"B: dstate n={dims['n']} is larger than the {MAX_DSTATE} the kernels "
                         "hold in one tile")
    # The device last, so that every other error reads the same on any machine.
    if not on_launch_device(x):
        raise ValueError(f"x: must be a CUDA tensor (got device {x.device}); on the CPU use "
                         "ssd.backward.chunk_scan_backward_torch")
    return dims
