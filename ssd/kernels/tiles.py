"""Tile code the stage kernels share: decays in log2 units, the per-chunk state product, and the
row loads, weights and epilogue of the outputs.

Every function here runs inside a kernel (cuTile inlines it); none is launched on its own. The
kernels of :mod:`ssd.kernels` are siblings that import from this module, never from each other.
"""
import cuda.tile as ct

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634  # decays are exp(a) = exp2(a * log2(e)): exp2 is the native unit

# chunk_decay's last axis: the carry repeated over a row of 32 bytes, so that chunk_scan loads it
# as a row by TMA and takes one element out (ct.extract), as chunk_end_decay does with
# dA_cumsum; a one-element tile is a cp.async the consumer warps issue and wait out themselves.
DECAY_ROW = 8


def softplus(d):
    """Tile code: softplus(d) = log1p(e^d) where d <= 20, d above (fp32 tiles, any shape), as
    chunk_cumsum computes it in its own body (chapter 05 lists that kernel and explains it there).

    Above 20 softplus equals d to fp32 precision and e^d would only risk overflow, so d passes
    through there (the threshold mamba_ssm uses). There is no log1p tile op, and log(1 + e)
    loses e's low bits when e is small (typical dt' ~ 1e-3 would keep only ~4 significant
    digits). Goldberg's identity log1p(e) = log(u) * e / (u - 1), u = fl(1 + e), cancels that
    rounding."""
    e = ct.exp(ct.minimum(d, 20.0))
    u = 1.0 + e
    log1p = ct.where(u == 1.0, e, ct.log(u) * e / (u - 1.0))
    return ct.where(d <= 20.0, log1p, d)


def k_step(acc, kk, x, B, dt_out, dA_cumsum, seq_idx, last, seq_end, ib, ic, ih, ig, ip, jn, Q,
           BLOCK_K, BLOCK_P, BLOCK_N, HAS_SEQ, LATENCY, TRANSPOSED):
    """Tile code: ``acc`` plus K block ``kk`` of chunk ``ic`` (see :func:`chunk_state_tile`)."""
    k_per_chunk = Q // BLOCK_K
    row = ic * k_per_chunk + kk  # tile index along l in units of BLOCK_K
    xk = ct.load(x, index=(ib, row, ih, ip), shape=(1, BLOCK_K, 1, BLOCK_P), padding_mode=ZERO,
                 latency=LATENCY)
    xk = xk.reshape((BLOCK_K, BLOCK_P))  # [K, P]
    dacs = ct.load(dA_cumsum, index=(ib, ih, ic, kk), shape=(1, 1, 1, BLOCK_K)).reshape((BLOCK_K,))
    dtk = ct.load(dt_out, index=(ib, ih, ic, kk), shape=(1, 1, 1, BLOCK_K)).reshape((BLOCK_K,))
    # last - dacs <= 0 because the cumulative log-decay only falls: exp2 never overflows.
    w = ct.exp2((last - dacs) * LOG2E) * dtk  # [K]
    if HAS_SEQ:
        seq = ct.load(seq_idx, index=(ib, row), shape=(1, BLOCK_K), padding_mode=ZERO)
        w = ct.where(seq.reshape((BLOCK_K,)) == seq_end, w, 0.0)
    # Fold the per-position weight into B in fp32, round once to x's dtype for the MMA.
    if TRANSPOSED:
        bt = ct.load(B, index=(ib, jn, ig, row), shape=(1, BLOCK_N, 1, BLOCK_K), order=(0, 3, 2, 1),
                     padding_mode=ZERO, latency=LATENCY)
        bt = bt.reshape((BLOCK_N, BLOCK_K)).astype(ct.float32)  # [N, K]
        acc = ct.mma((bt * w[None, :]).astype(xk.dtype), xk, acc)  # [N, P], fp32 accumulation
    else:
        bk = ct.load(B, index=(ib, row, ig, jn), shape=(1, BLOCK_K, 1, BLOCK_N), padding_mode=ZERO,
                     latency=LATENCY)
        bk = bk.reshape((BLOCK_K, BLOCK_N)).astype(ct.float32)  # [K, N]
        bw = (bk * w[:, None]).astype(xk.dtype)  # [K, N]
        acc = ct.mma(ct.transpose(xk), bw, acc)  # [P, N], fp32 accumulation
    return acc


def head_run(part, heads_per_group, head_splits):
    """Tile code: (group, first head, heads) of grid index ``part`` along a backward grid's
    (group, split) axis: split ``part % head_splits`` of group ``part // head_splits``, whose
    heads one block walks, summing the group's gradients (dB, dC) over them
    (:func:`ssd.config.head_splits`)."""
    ig = part // head_splits
    heads = heads_per_group // head_splits
    return ig, ig * heads_per_group + (part % head_splits) * heads, heads


def rows_of(arr, ib, l_tile, i2, i3, BLOCK, WIDTH, dtype):
    """Tile code: rows ``l_tile*BLOCK ...`` of entry ``i2`` (a head or a group) of a (b, l, *, w)
    array, columns ``i3*WIDTH ...``, [BLOCK, WIDTH] in ``dtype``; zeros past the array's ends."""
    t = ct.load(arr, index=(ib, l_tile, i2, i3), shape=(1, BLOCK, 1, WIDTH), padding_mode=ZERO)
    return t.reshape((BLOCK, WIDTH)).astype(dtype)


def chunk_row(arr, ib, ih, ic, j, BLOCK):
    """Tile code: positions ``j*BLOCK ...`` of chunk ``ic``, head ``ih`` of a (b, h, c, q) fp32
    array, [BLOCK]."""
    return ct.load(arr, index=(ib, ih, ic, j), shape=(1, 1, 1, BLOCK)).reshape((BLOCK,))


def sequence_ids(seq_idx, ib, l_tile, BLOCK):
    """Tile code: [BLOCK] seq_idx of rows ``l_tile*BLOCK ...`` (0 past the sequence end, where
    dy and x are 0 and the mask decides nothing)."""
    return ct.load(seq_idx, index=(ib, l_tile), shape=(1, BLOCK),
                   padding_mode=ZERO).reshape((BLOCK,))


def entering_sequence(seq_last, ib, ic):
    """Tile code: [1] the sequence running when chunk ``ic`` starts, whose state enters it (0
    before the first chunk; ``seq_last``: (b, c) seq_idx at each chunk's last valid position)."""
    prev = ct.load(seq_last, index=(ib, ct.maximum(ic - 1, 0)), shape=(1, 1))
    return ct.where(ic > 0, prev.reshape((1,)), 0)


def entering_gradient(dy, C, dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih, ig, ip, jn, Q,
                      BLOCK_K, BLOCK_P, BLOCK_N, HAS_SEQ):
    """Tile code: the [BLOCK_P, BLOCK_N] fp32 gradient of the state entering chunk ``ic``
    (dprev_states) for head ``ih`` (group ``ig``), channels ``ip*BLOCK_P ...``, state entries
    ``jn*BLOCK_N ...``: sum_t e^{a_t} dy_tᵀ C_t over the rows t that continue the entering
    sequence, ``BLOCK_K`` rows a step (the K loop of one MMA): a chunk_state of (dy, C) with
    decays from the chunk's start. chunk_scan's backward stores it; state_passing's backward
    walk can form it where it is consumed instead."""
    prev_seq = ct.zeros((1,), dtype=ct.int32)  # unread without HAS_SEQ
    if HAS_SEQ:
        prev_seq = entering_sequence(seq_last, ib, ic)
    k_tiles = Q // BLOCK_K
    acc = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)  # [P, N]
    for kk in range(ct.cdiv(ct.minimum(Q, seqlen - ic * Q), BLOCK_K)):  # K blocks in the sequence
        rows = ic * k_tiles + kk
        dy_k = rows_of(dy, ib, rows, ih, ip, BLOCK_K, BLOCK_P, C.dtype)  # [K, P]
        c_k = rows_of(C, ib, rows, ig, jn, BLOCK_K, BLOCK_N, ct.float32)  # [K, N]
        w = ct.exp2(chunk_row(dA_cumsum, ib, ih, ic, kk, BLOCK_K) * LOG2E)  # [K], <= 1
        if HAS_SEQ:
            w = ct.where(sequence_ids(seq_idx, ib, rows, BLOCK_K) == prev_seq, w, 0.0)
        # Fold the decay into C in fp32, round once to the MMA's dtype.
        acc = ct.mma(ct.transpose(dy_k), (c_k * w[:, None]).astype(C.dtype), acc)  # [P, N]
    return acc


def chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_K):
    """Tile code: the [1] cumulative log-decay at the chunk's last position, dA_cumsum[..., Q-1].

    Taken out of the chunk's last BLOCK_K row, not loaded as one element: a one-element tile is
    a cp.async that the consumer warps issue and wait out themselves at every chunk of the
    walk, where a row is a TMA load the producer issues ahead (and the same row the last K
    step reads)."""
    tail = ct.load(dA_cumsum, index=(ib, ih, ic, Q // BLOCK_K - 1), shape=(1, 1, 1, BLOCK_K))
    return ct.extract(tail.reshape((BLOCK_K,)), index=(BLOCK_K - 1,), shape=(1,))


def chunk_state_tile(acc, x, B, dt_out, dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih, ig, ip,
                     jn, Q, BLOCK_K, BLOCK_P, BLOCK_N, HAS_SEQ, LATENCY, TRANSPOSED=False,
                     FULL=False):
    """Tile code: ``acc`` plus the [BLOCK_P, BLOCK_N] fp32 state of chunk ``ic`` for head
    ``ih`` (group ``ig``), channels ``ip*BLOCK_P ...``, state entries ``jn*BLOCK_N ...``. The
    chunk's MMAs accumulate into ``acc`` itself (zeros for the chunk's own state, the decayed
    running state in the fused scan), so no second fp32 tile is live beside it.

    The chunk is consumed BLOCK_K positions at a time (the MMA's K loop): a whole 256-long
    chunk of x and B would not fit in registers next to the accumulator. K blocks that lie
    entirely past the sequence end are skipped (a tile fully out of bounds is undefined);
    partial ones load zeros and carry dt' = 0. ``LATENCY`` is the load hint for x and B
    (:attr:`ssd.config.StateConfig.latency`).
    ``TRANSPOSED``: ``acc`` is the state transposed, [BLOCK_N, BLOCK_P], and the MMA is
    (w B)ᵀ x with B loaded as [BLOCK_N, BLOCK_K] (StateConfig.transposed).
    ``FULL``: every chunk of the sequence is full (seqlen % Q == 0), so the K loop has a
    constant trip count and is unrolled. The fused walk then has a straight-line body per chunk,
    which runs faster than the counted loop.
    """
    last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_K)
    seq_end = ct.zeros((1,), dtype=ct.int32)  # unread without HAS_SEQ
    if HAS_SEQ:
        seq_end = ct.load(seq_last, index=(ib, ic), shape=(1, 1)).reshape((1,))
    k_per_chunk = Q // BLOCK_K
    k_end = ct.cdiv(ct.minimum(Q, seqlen - ic * Q), BLOCK_K)
    step = (x, B, dt_out, dA_cumsum, seq_idx, last, seq_end, ib, ic, ih, ig, ip, jn, Q, BLOCK_K,
            BLOCK_P, BLOCK_N, HAS_SEQ, LATENCY, TRANSPOSED)
    if FULL:
        for kk in ct.static_iter(range(k_per_chunk)):
            acc = k_step(acc, kk, *step)
    else:
        for kk in range(k_end):
            acc = k_step(acc, kk, *step)
    return acc


def skip_factor(D, ih, ip, BLOCK_P, D_PER_HEAD):
    """Tile code: D of head ``ih`` (and the block's channels) as an fp32 factor of x [M, P]."""
    if D_PER_HEAD:  # D (h,) as the layer holds it: no per-call expansion on the host
        return ct.load(D, index=(ih,), shape=(1,)).astype(ct.float32).reshape((1, 1))
    d = ct.load(D, index=(ih, ip), shape=(1, BLOCK_P), padding_mode=ZERO)
    return d.astype(ct.float32)  # [1, P]


def head_rows(arr, ib, l_tile, ih, ip, BLOCK_T, BLOCK_P, LATENCY=None):
    """Tile code: rows ``l_tile*BLOCK_T ...`` of one head of a (b, l, h, p) array, [T, P]."""
    t = ct.load(arr, index=(ib, l_tile, ih, ip), shape=(1, BLOCK_T, 1, BLOCK_P),
                padding_mode=ZERO, latency=LATENCY)
    return t.reshape((BLOCK_T, BLOCK_P))


def head_weights(cb, a_t, keep, masked, dt_out, dA_cumsum, ib, ih, ic, js, BLOCK_S):
    """Tile code: one head's fp32 weights [M, S] = C Bᵀ 2^(a_t - a_s) dt_s of column block
    ``js`` (``cb``: C Bᵀ [M, S]; ``a_t``: the rows' decays [M], log2 units), zero where not
    ``keep`` when ``masked``."""
    a_s = ct.load(dA_cumsum, index=(ib, ih, ic, js), shape=(1, 1, 1, BLOCK_S))
    a_s = a_s.reshape((BLOCK_S,)) * LOG2E  # [S]
    dt_s = ct.load(dt_out, index=(ib, ih, ic, js), shape=(1, 1, 1, BLOCK_S)).reshape((BLOCK_S,))
    seg = a_t[:, None] - a_s[None, :]  # [M, S]
    if masked:
        # Mask the exponent, not the product: above the diagonal a_t - a_s is positive and its
        # exp2 could overflow to inf, and inf * 0 = NaN.
        seg = ct.where(keep, seg, -float("inf"))
    # flush_to_zero: a weight below 2^-126 is invisible beside the others in an fp32 sum that
    # ends in bf16, and without it every exp2 carries a compare and two multiplies that scale
    # subnormal results.
    return cb * ct.exp2(seg, flush_to_zero=True) * dt_s[None, :]


def finish_rows(acc, x_t, z, D, y, ib, rows, ih, ip, BLOCK_M, BLOCK_P, HAS_D, D_PER_HEAD,
                HAS_Z):
    """Tile code: the skip connection (``x_t``: the rows' x [M, P]) and the gate, in fp32, then
    the store of one head's rows ``rows`` of y."""
    if HAS_D:
        acc = acc + x_t.astype(ct.float32) * skip_factor(D, ih, ip, BLOCK_P, D_PER_HEAD)
    if HAS_Z:
        z_t = head_rows(z, ib, rows, ih, ip, BLOCK_M, BLOCK_P).astype(ct.float32)
        acc = acc * z_t / (1.0 + ct.exp(-z_t))  # y * silu(z)
    ct.store(y, index=(ib, rows, ih, ip),
             tile=acc.reshape((1, BLOCK_M, 1, BLOCK_P)).astype(y.dtype))
