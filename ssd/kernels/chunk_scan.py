"""Stage 3, chunk_scan: the outputs.

For a position t of chunk c (head h, its group's B and C)::

    y[t] = sum_{s <= t in chunk c} (C[t] . B[s]) exp(dA_cumsum[t] - dA_cumsum[s]) dt'[s] x[s]   (diagonal block)
         + exp(dA_cumsum[t]) C[t] . prev_states[c]                                             (entering state)
         + D x[t]
    y[t] *= silu(z[t])                                                                          (if z)

A block owns ``BLOCK_M`` rows of one chunk and ``BLOCK_P`` channels of ``BLOCK_H`` heads of
one group. It walks the causal prefix of its rows ``BLOCK_S`` columns at a time, like causal
flash attention: the [BLOCK_M, BLOCK_S] tile of C Bᵀ, its decay and mask live only in
registers and are consumed by the next MMA; the chunk x chunk matrix is never written to
memory. C Bᵀ depends on the group, not the head, so the block's heads share one C Bᵀ tile:
with one group (the Mamba-2 models) ``BLOCK_H`` heads cost one C Bᵀ MMA instead of
``BLOCK_H``. The column blocks before a block's first row lie wholly below the diagonal and
walk without the causal mask; the diagonal comes last, and when it is one tile its x rows also
give the skip connection D x. Every tile is 2-D (per-head tiles are tuples of BLOCK_H) and so
is every MMA, which sm_90 runs as a warpgroup MMA (wgmma); a leading head axis would make an
MMA batched, which the compiler lowers to warp-level mma.sync instead. Packed sequences (seq_idx)
mask the diagonal block to pairs in the same sequence and drop the entering state for rows
whose sequence started inside the chunk.

A whole-chunk tile of full chunks (:func:`scan_chunk`, ``ScanConfig.shared``) takes its heads
one after another instead and loads each of its tiles once: no row block reloads what another
already loaded (chapter 9 measures it, fig-scan-tiles).
"""
import functools

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import ScanConfig, next_pow2
from .tiles import (ConstInt, ConstBool, ZERO, LOG2E, DECAY_ROW, entering_sequence, finish_rows,
                    head_rows, head_weights)


def entering_state(prev_states, chunk_decay, group_enter, ib, ic, ih, ip, chunks_per_group,
                   BLOCK_P, N_PAD, GROUPED, dtype):
    """Tile code: the state entering chunk ``ic`` of head ``ih`` [P, N] in ``dtype`` (the MMA's),
    and, GROUPED, the group's part: its entering state [P, N] in ``dtype`` and the carry [1, 1]
    from the group start to the chunk (chunk_decay), else None. Grouped, stage 2 stored the state
    from the chunk's group start; :func:`entering_mma` completes it with the group's part."""
    prev = ct.load(prev_states, index=(ib, ic, ih, ip, 0), shape=(1, 1, 1, BLOCK_P, N_PAD),
                   padding_mode=ZERO).reshape((BLOCK_P, N_PAD))
    part = None
    if GROUPED:
        enter = ct.load(group_enter, index=(ib, ic // chunks_per_group, ih, ip, 0),
                        shape=(1, 1, 1, BLOCK_P, N_PAD), padding_mode=ZERO).reshape((BLOCK_P, N_PAD))
        row = ct.load(chunk_decay, index=(ib, ih, ic, 0), shape=(1, 1, 1, DECAY_ROW))
        d = ct.extract(row.reshape((DECAY_ROW,)), index=(0,), shape=(1,)).reshape((1, 1))
        part = (enter.astype(dtype), d)
    return prev.astype(dtype), part


def entering_mma(c_in, prev, part, BLOCK_M, BLOCK_P, GROUPED):
    """Tile code: C . H^T [M, P] fp32 for the entering state H of :func:`entering_state`.
    GROUPED, the group's part first, by an MMA of its own scaled by the carry, and the stored
    state's MMA accumulating onto it: both states stay MMA operands as loaded. Adding the two
    states before one MMA would take them through registers and back to shared memory."""
    acc = ct.zeros((BLOCK_M, BLOCK_P), dtype=ct.float32)
    if GROUPED:
        enter, d = part
        acc = ct.mma(c_in, ct.transpose(enter), acc) * d
    return ct.mma(c_in, ct.transpose(prev), acc)


def mma_heads(ws, xs, accs, BLOCK_H):
    """Tile code: acc_j += w_j x_j for each head j of the block: BLOCK_H 2-D MMAs."""
    out = ()
    for j in ct.static_iter(range(BLOCK_H)):
        out += (ct.mma(ws[j], xs[j], accs[j]),)
    return out


def same_sequence(seq_t, seq_idx, ib, ic, js, Q, BLOCK_S):
    """Tile code: [M, S] True where row t (sequence ids ``seq_t`` [M], loaded once per tile)
    and column s of the chunk belong to one sequence."""
    seq_s = ct.load(seq_idx, index=(ib, ic * (Q // BLOCK_S) + js), shape=(1, BLOCK_S),
                    padding_mode=ZERO).reshape((BLOCK_S,))
    return seq_t[:, None] == seq_s[None, :]


def entering_rows(c_t, seq_idx, ib, rows, prev_seq, BLOCK_M):
    """Tile code: the rows' sequence ids [M] (loaded once per row block: the column blocks
    compare with them too) and C [M, N] for the entering-state MMA, zero in the rows whose
    sequence began inside the chunk (a copy: the diagonal's C Bᵀ needs every row)."""
    seq_t = ct.load(seq_idx, index=(ib, rows), shape=(1, BLOCK_M),
                    padding_mode=ZERO).reshape((BLOCK_M,))
    return seq_t, ct.where((seq_t == prev_seq)[:, None], c_t, 0.0).astype(c_t.dtype)


def column_keep(causal, trow, js, seq_t, seq_idx, ib, ic, Q, BLOCK_M, BLOCK_S, HAS_SEQ):
    """Tile code: [M, S] True where row t (positions ``trow`` [M] in the chunk) takes column s
    of column block ``js``: s <= t when ``causal`` (the diagonal), one sequence when HAS_SEQ."""
    keep = ct.full((BLOCK_M, BLOCK_S), True, dtype=ct.bool_)
    if causal:
        scol = js * BLOCK_S + ct.arange(BLOCK_S, dtype=ct.int32)  # [S]
        keep = trow[:, None] >= scol[None, :]  # [M, S]
    if HAS_SEQ:
        keep = keep & same_sequence(seq_t, seq_idx, ib, ic, js, Q, BLOCK_S)
    return keep


def column_block(js, causal, ib, ic, jh, ig, ip, trow, a_ts, c_t, B, x, dt_out, dA_cumsum,
                 seq_t, seq_idx, Q, BLOCK_H, BLOCK_M, BLOCK_S, BLOCK_P, N_PAD, HAS_SEQ, LATENCY):
    """Tile code: column block ``js`` for each head j of the block (``a_ts``: the rows' decays
    [M] per head, log2 units): the weights w_j [M, S] = C Bᵀ 2^(a_t - a_s) dt_s, masked to
    s <= t when ``causal`` (the diagonal) and to one sequence when HAS_SEQ, in x's dtype, and
    the block's x_j [S, P]; two tuples of BLOCK_H tiles. C Bᵀ is computed once for them all."""
    s_per_chunk = Q // BLOCK_S
    b_s = ct.load(B, index=(ib, ic * s_per_chunk + js, ig, 0), shape=(1, BLOCK_S, 1, N_PAD),
                  padding_mode=ZERO, latency=LATENCY)
    b_s = b_s.reshape((BLOCK_S, N_PAD)).astype(x.dtype)  # [S, N]
    cb = ct.mma(c_t, ct.transpose(b_s), ct.zeros((BLOCK_M, BLOCK_S), dtype=ct.float32))  # [M, S]
    keep = column_keep(causal, trow, js, seq_t, seq_idx, ib, ic, Q, BLOCK_M, BLOCK_S, HAS_SEQ)
    ws, xs = (), ()
    for j in ct.static_iter(range(BLOCK_H)):
        ih = jh * BLOCK_H + j
        w = head_weights(cb, a_ts[j], keep, causal or HAS_SEQ, dt_out, dA_cumsum, ib, ih, ic, js,
                         BLOCK_S)
        ws += (w.astype(x.dtype),)
        xs += (head_rows(x, ib, ic * s_per_chunk + js, ih, ip, BLOCK_S, BLOCK_P, LATENCY),)
    return ws, xs


def scan_tile(bc, im, hp, x, B, C, dt_out, dA_cumsum, prev_states, chunk_decay, group_enter, D, z,
              seq_idx, seq_last, y, seqlen, nchunks, heads_per_group, p_tiles, chunks_per_group,
              Q, BLOCK_H, BLOCK_M, BLOCK_S, BLOCK_P, N_PAD, HAS_D, D_PER_HEAD, HAS_Z, HAS_SEQ,
              GROUPED, LATENCY, STATIC_ROWS=False):
    """Tile code: compute and store y for one output tile: rows ``im*BLOCK_M ...`` of chunk
    ``bc % nchunks`` of batch row ``bc // nchunks``, channels ``(hp % p_tiles)*BLOCK_P ...`` of
    the ``BLOCK_H`` heads of head block ``hp // p_tiles``. One tile per block in the default
    grid; a persistent block loops over many (see the kernel). Every tile is 2-D, one per head
    where it is per head (tuples of BLOCK_H tiles): 2-D MMAs run as wgmma on sm_90, where a
    leading head axis would make them batched mma.sync."""
    ib = bc // nchunks
    ic = bc % nchunks
    jh = hp // p_tiles  # head block: heads jh*BLOCK_H ... (jh+1)*BLOCK_H - 1
    ip = hp % p_tiles
    ig = (jh * BLOCK_H) // heads_per_group
    m_per_chunk = Q // BLOCK_M
    rows = ic * m_per_chunk + im  # the block's rows, in BLOCK_M tiles of the sequence
    # A tile entirely past the end of the sequence is undefined for load/store: skip it.
    if ic * Q + im * BLOCK_M < seqlen:
        trow = im * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)  # [M] position in chunk
        c_t = ct.load(C, index=(ib, rows, ig, 0), shape=(1, BLOCK_M, 1, N_PAD), padding_mode=ZERO)
        c_t = c_t.reshape((BLOCK_M, N_PAD)).astype(x.dtype)  # [M, N], also the diagonal's
        if HAS_SEQ:
            seq_t, c_in = entering_rows(c_t, seq_idx, ib, rows, entering_sequence(seq_last, ib, ic),
                                        BLOCK_M)
        else:
            seq_t = ct.zeros((BLOCK_M,), dtype=ct.int32)  # unread without HAS_SEQ
            c_in = c_t

        # 1. Entering state, per head: exp(dA_cumsum[t]) * C[t] . prev_states[c]   -> [M, P]
        a_ts, accs = (), ()
        for j in ct.static_iter(range(BLOCK_H)):
            ih = jh * BLOCK_H + j
            a_t = ct.load(dA_cumsum, index=(ib, ih, ic, im), shape=(1, 1, 1, BLOCK_M))
            a_t = a_t.reshape((BLOCK_M,)) * LOG2E  # [M], log2 units
            prev, part = entering_state(prev_states, chunk_decay, group_enter, ib, ic, ih, ip,
                                        chunks_per_group, BLOCK_P, N_PAD, GROUPED, x.dtype)  # MMA in input dtype
            acc = entering_mma(c_in, prev, part, BLOCK_M, BLOCK_P, GROUPED)
            a_ts += (a_t,)
            accs += (acc * ct.exp2(a_t)[:, None],)  # decay from the chunk start, <= 1

        # 2. Diagonal block, BLOCK_S columns at a time up to the block's last row. The column
        # blocks before the block's first row lie below the diagonal and need no causal mask;
        # the diagonal's comes last.
        cols = (ib, ic, jh, ig, ip, trow, a_ts, c_t, B, x, dt_out, dA_cumsum, seq_t, seq_idx, Q,
                BLOCK_H, BLOCK_M, BLOCK_S, BLOCK_P, N_PAD, HAS_SEQ, LATENCY)
        if STATIC_ROWS:  # im is a constant here: the walk's trip count too
            for js in ct.static_iter(range(im * (BLOCK_M // BLOCK_S))):
                ws, xs = column_block(js, False, *cols)
                accs = mma_heads(ws, xs, accs, BLOCK_H)
        else:
            for js in range(im * (BLOCK_M // BLOCK_S)):
                ws, xs = column_block(js, False, *cols)
                accs = mma_heads(ws, xs, accs, BLOCK_H)
        if BLOCK_S == BLOCK_M:
            # One diagonal tile, whose x rows are the skip connection's: D x[t] from it.
            ws, x_ts = column_block(im, True, *cols)
            accs = mma_heads(ws, x_ts, accs, BLOCK_H)
        else:  # several diagonal tiles, up to the last column in the sequence (a tile wholly
            # past its end is undefined), and D x[t] from a load of the block's own rows
            s_end = ct.cdiv(ct.minimum((im + 1) * BLOCK_M, seqlen - ic * Q), BLOCK_S)
            for js in range(im * (BLOCK_M // BLOCK_S), s_end):
                ws, xs = column_block(js, True, *cols)
                accs = mma_heads(ws, xs, accs, BLOCK_H)
            x_ts = ()
            if HAS_D:
                for j in ct.static_iter(range(BLOCK_H)):
                    x_ts += (head_rows(x, ib, rows, jh * BLOCK_H + j, ip, BLOCK_M, BLOCK_P),)

        # 3. The skip connection and the gate, in fp32; the store, per head.
        for j in ct.static_iter(range(BLOCK_H)):
            finish_rows(accs[j], x_ts[j] if HAS_D else None, z, D, y, ib, rows, jh * BLOCK_H + j,
                        ip, BLOCK_M, BLOCK_P, HAS_D, D_PER_HEAD, HAS_Z)


def scan_chunk(bc, hp, x, B, C, dt_out, dA_cumsum, prev_states, chunk_decay, group_enter, D, z,
               seq_idx, seq_last, y, seqlen, nchunks, heads_per_group, p_tiles, chunks_per_group,
               Q, BLOCK_H, BLOCK_M, BLOCK_S, BLOCK_P, N_PAD, HAS_D, D_PER_HEAD, HAS_Z, HAS_SEQ,
               GROUPED, LATENCY):
    """Tile code: y for every row of one full chunk, ``bc`` as in :func:`scan_tile`, for the
    ``BLOCK_H`` heads of head block ``hp // p_tiles`` one after another (a whole-chunk tile).

    Each tile of C, B, x and the entering states is loaded once: C's row blocks and B's column
    blocks once for all the heads (they share one group), each head's x column blocks and
    entering state once for all its row blocks, where :func:`scan_tile` per row block reloads
    the entering state and the x and B columns that earlier row blocks read too. Each tile is loaded where it is first
    needed, after the stores before it, so that the compiler keeps the row blocks in order
    rather than holding every tile of the chunk at once. The chunk must be full (no tile past
    the sequence end): the launcher sets SHARED only where every chunk is."""
    ib = bc // nchunks
    ic = bc % nchunks
    jh = hp // p_tiles
    ip = hp % p_tiles
    ig = (jh * BLOCK_H) // heads_per_group
    m_tiles = Q // BLOCK_M
    s_tiles = Q // BLOCK_S
    s_per_m = BLOCK_M // BLOCK_S
    prev_seq = ct.zeros((1,), dtype=ct.int32)  # unread without HAS_SEQ
    if HAS_SEQ:
        prev_seq = entering_sequence(seq_last, ib, ic)
    # C's row blocks [M, N] and B's column blocks [S, N], each loaded once by the first head
    # (in the static loops below, column block js is new where it is diagonal: js >= im * s_per_m)
    cs, bs = (), ()
    for j in ct.static_iter(range(BLOCK_H)):
        ih = jh * BLOCK_H + j
        prev, part = entering_state(prev_states, chunk_decay, group_enter, ib, ic, ih, ip,
                                    chunks_per_group, BLOCK_P, N_PAD, GROUPED, x.dtype)  # [P, N]
        xs = ()  # this head's x column blocks [S, P]
        for im in ct.static_iter(range(m_tiles)):
            if j == 0:
                c_t = ct.load(C, index=(ib, ic * m_tiles + im, ig, 0), shape=(1, BLOCK_M, 1, N_PAD),
                              padding_mode=ZERO)
                cs += (c_t.reshape((BLOCK_M, N_PAD)).astype(x.dtype),)
            rows = ic * m_tiles + im  # the row block, in BLOCK_M tiles of the sequence
            trow = im * BLOCK_M + ct.arange(BLOCK_M, dtype=ct.int32)  # [M] position in chunk
            seq_t = ct.zeros((BLOCK_M,), dtype=ct.int32)  # unread without HAS_SEQ
            c_in = cs[im]
            if HAS_SEQ:
                seq_t, c_in = entering_rows(c_in, seq_idx, ib, rows, prev_seq, BLOCK_M)
            a_t = ct.load(dA_cumsum, index=(ib, ih, ic, im), shape=(1, 1, 1, BLOCK_M))
            a_t = a_t.reshape((BLOCK_M,)) * LOG2E  # [M], log2 units
            acc = entering_mma(c_in, prev, part, BLOCK_M, BLOCK_P, GROUPED)
            acc = acc * ct.exp2(a_t)[:, None]  # entering state, decayed from the chunk start
            for js in ct.static_iter(range((im + 1) * s_per_m)):
                causal = js >= im * s_per_m  # a diagonal column block, first used here (static)
                if causal and j == 0:
                    b_s = ct.load(B, index=(ib, ic * s_tiles + js, ig, 0),
                                  shape=(1, BLOCK_S, 1, N_PAD), padding_mode=ZERO, latency=LATENCY)
                    bs += (b_s.reshape((BLOCK_S, N_PAD)).astype(x.dtype),)
                if causal:
                    xs += (head_rows(x, ib, ic * s_tiles + js, ih, ip, BLOCK_S, BLOCK_P, LATENCY),)
                cb = ct.mma(cs[im], ct.transpose(bs[js]), ct.zeros((BLOCK_M, BLOCK_S), dtype=ct.float32))
                keep = column_keep(causal, trow, js, seq_t, seq_idx, ib, ic, Q, BLOCK_M, BLOCK_S,
                                   HAS_SEQ)
                w = head_weights(cb, a_t, keep, causal or HAS_SEQ, dt_out, dA_cumsum, ib, ih, ic,
                                 js, BLOCK_S)
                acc = ct.mma(w.astype(x.dtype), xs[js], acc)
            x_t = None  # unread without HAS_D
            if HAS_D:
                if BLOCK_S == BLOCK_M:
                    x_t = xs[im]  # the diagonal column block is the row block's own x
                else:
                    x_t = head_rows(x, ib, rows, ih, ip, BLOCK_M, BLOCK_P)
            finish_rows(acc, x_t, z, D, y, ib, rows, ih, ip, BLOCK_M, BLOCK_P, HAS_D, D_PER_HEAD,
                        HAS_Z)


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None, latency=None, warps=None):
    """The kernel for one index width and one set of compiler hints (see ScanConfig)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def chunk_scan_kernel(
        x: Array,            # (b, l, h, p)
        B: Array,            # (b, l, g, n)
        C: Array,            # (b, l, g, n)
        dt_out: Array,       # (b, h, c, q) fp32
        dA_cumsum: Array,    # (b, h, c, q) fp32
        prev_states: Array,  # (b, c, h, p, n) state entering each chunk (GROUPED: from its group's start)
        chunk_decay: Array,  # (b, h, c, DECAY_ROW) fp32, carry from the chunk's group start (GROUPED only)
        group_enter: Array,  # (b, G, h, p, n) state entering each group (GROUPED only)
        D: Array,            # (h,) or (h, p) (ignored unless HAS_D)
        z: Array,            # (b, l, h, p) (ignored unless HAS_Z)
        seq_idx: Array,      # (b, l) int32 (ignored unless HAS_SEQ)
        seq_last: Array,     # (b, c) int32 (ignored unless HAS_SEQ)
        y: Array,            # (b, l, h, p) out, x's dtype
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        p_tiles: int,        # cdiv(p, BLOCK_P)
        batch: int,          # b (persistent grid only)
        head_tiles: int,     # h / BLOCK_H (persistent grid only)
        chunks_per_group: int,  # GROUPED only
        Q: ConstInt,
        BLOCK_H: ConstInt,
        BLOCK_M: ConstInt,
        BLOCK_S: ConstInt,
        BLOCK_P: ConstInt,
        N_PAD: ConstInt,
        HAS_D: ConstBool,
        D_PER_HEAD: ConstBool,
        HAS_Z: ConstBool,
        HAS_SEQ: ConstBool,
        PERSISTENT: ConstBool,
        WHOLE_CHUNK: ConstBool,  # persistent only: a tile is all row blocks of a chunk
        SHARED: ConstBool,       # whole-chunk tiles, every chunk full: scan_chunk
        GROUPED: ConstBool,      # stage 2 walked its chunks in groups (ssd.kernels.state_passing.Groups)
    ):
        """Grid: (b * c, cdiv(q, BLOCK_M), (h / BLOCK_H) * cdiv(p, BLOCK_P)), one output tile per
        block; or, PERSISTENT, a fixed number of blocks each looping over tiles, heads and
        channel slices fastest so that consecutive tiles share their chunk's B and C in L2.

        The block's heads (all in one group) share C, B and therefore the C Bᵀ tile, which is
        computed once per column block and used by BLOCK_H 2-D MMAs, one per head; per-head
        data (decays, dt', x, states, accumulators) are tuples of BLOCK_H 2-D tiles. SHARED
        whole-chunk tiles (every chunk full) walk their heads one after another instead,
        loading C and B once for them all (:func:`scan_chunk`).
        """
        args = (x, B, C, dt_out, dA_cumsum, prev_states, chunk_decay, group_enter, D, z, seq_idx,
                seq_last, y, seqlen, nchunks, heads_per_group, p_tiles, chunks_per_group, Q,
                BLOCK_H, BLOCK_M, BLOCK_S, BLOCK_P, N_PAD, HAS_D, D_PER_HEAD, HAS_Z, HAS_SEQ,
                GROUPED, latency)
        m_tiles = Q // BLOCK_M
        hp_tiles = head_tiles * p_tiles
        if PERSISTENT and WHOLE_CHUNK and SHARED:
            for t in range(ct.bid(0), batch * nchunks * hp_tiles, ct.num_blocks(0)):
                scan_chunk(t // hp_tiles, t % hp_tiles, *args)
        elif PERSISTENT and WHOLE_CHUNK:
            for t in range(ct.bid(0), batch * nchunks * hp_tiles, ct.num_blocks(0)):
                for im in ct.static_iter(range(m_tiles)):
                    scan_tile(t // hp_tiles, im, t % hp_tiles, *args, True)
        elif PERSISTENT:
            for t in range(ct.bid(0), batch * nchunks * m_tiles * hp_tiles, ct.num_blocks(0)):
                rest = t // hp_tiles
                scan_tile(rest // m_tiles, rest % m_tiles, t % hp_tiles, *args)
        else:
            scan_tile(ct.bid(0), ct.bid(1), ct.bid(2), *args)

    return chunk_scan_kernel


# The tuned build can take tileiras 10-13 s (the grouped walk with full chunks at 64), so until it
# is ready a first call runs a build with the occupancy hint at 1: one block a SM leaves tileiras
# no occupancy to search pipelines for, and it compiles in 1-3 s (it runs 1.1-1.4x as long, so
# only until the tuned build is ready). See ssd.launch.
QUICK_OCCUPANCY = 1


@functools.lru_cache(maxsize=None)
def quick_first(index_dtype, occupancy, latency, warps):
    """The :class:`ssd.launch.QuickFirst` of ``build_kernel(index_dtype, occupancy, latency,
    warps)``: the quick build that stands in for it and how a child process builds it; made once
    per tuned build, not at every launch."""
    # Imported here, not at the top: a line added above the tile code would move the source
    # locations its TileIR records, and so change every kernel's bytecode (SAME_KERNELS).
    from ..launch import QuickFirst, Rebuild

    return QuickFirst(build_kernel(index_dtype, QUICK_OCCUPANCY, latency, warps),
                      Rebuild("ssd.kernels.chunk_scan", "build_kernel",
                              (index_dtype, occupancy, latency, warps)))


def chunk_scan(B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None, seq_idx=None,
               seq_last=None, config: ScanConfig = ScanConfig(), out=None, groups=None):
    """Launch stage 3.

    Args:
        B, C: (b, l, g, n); x: (b, l, h, p); dt_out, dA_cumsum: (b, h, c, q) fp32;
        prev_states: (b, c, h, p, n) fp32 or bf16; D: optional (h,) or (h, p);
        z: optional (b, l, h, p); seq_idx: optional (b, l) int32 with seq_last (b, c) int32.
        out: optional preallocated (b, l, h, p) tensor of x's dtype.
        groups: the :class:`ssd.kernels.state_passing.Groups` of a grouped stage 2, whose prev_states
            start from zero at each group.
    Returns:
        y (b, l, h, p) in x's dtype.
    """
    import torch

    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _, _, nchunks, q = dt_out.shape
    if out is None:
        out = torch.empty_like(x)
    dev = x.device
    if (h // g) % config.block_h:
        raise ValueError(f"block_h={config.block_h} must divide the heads per group ({h // g}); "
                         "SSDConfig.for_problem picks one that does")
    index_dtype = index_dtype_for(x, z, out, prev_states)
    hints = (config.occupancy, config.latency, config.warps)
    kernel = build_kernel(index_dtype, *hints)
    quick = quick_first(index_dtype, *hints) if config.occupancy != QUICK_OCCUPANCY else None
    p_tiles = -(-p // config.block_p)
    n_pad = next_pow2(n)
    grid = (b * nchunks, q // config.block_m, (h // config.block_h) * p_tiles)
    if config.persistent:  # as many blocks as can be resident at once (any number compiles)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        tiles = grid[0] * grid[2] * (1 if config.whole_chunk else grid[1])
        grid = (min((config.occupancy or 1) * sms, tiles), 1, 1)
    launch(kernel, grid, dict(
        x=x, B=B, C=C, dt_out=dt_out, dA_cumsum=dA_cumsum, prev_states=prev_states,
        chunk_decay=optional(groups and groups.chunk_decay, 4, torch.float32, dev),
        group_enter=optional(groups and groups.group_enter, 5, prev_states.dtype, dev),
        D=optional(D, 2, torch.float32, dev), z=optional(z, 4, x.dtype, dev),
        seq_idx=optional(seq_idx, 2, torch.int32, dev),
        seq_last=optional(seq_last, 2, torch.int32, dev), y=out, seqlen=l, nchunks=nchunks,
        heads_per_group=h // g, p_tiles=p_tiles, batch=b, head_tiles=h // config.block_h,
        chunks_per_group=groups.chunks_per_group if groups else nchunks, Q=q,
        BLOCK_H=config.block_h, BLOCK_M=config.block_m, BLOCK_S=config.block_s,
        BLOCK_P=config.block_p, N_PAD=n_pad, HAS_D=D is not None,
        D_PER_HEAD=D is not None and D.dim() == 1, HAS_Z=z is not None,
        HAS_SEQ=seq_idx is not None, PERSISTENT=config.persistent,
        WHOLE_CHUNK=config.whole_chunk, SHARED=config.shared and l % q == 0,
        GROUPED=groups is not None), device=dev, quick=quick)
    return out
