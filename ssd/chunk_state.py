"""Stage 2a, chunk_state: the state each chunk contributes on its own.

For chunk c of head h (its group's B), with q running over the chunk and ``last`` its final
valid position::

    states[c] = sum_q  exp(dA_cumsum[last] - dA_cumsum[q]) * dt'[q] * x[q] (outer) B[q]
              = x_c^T  @  (w * B_c)          x_c: [Q, P], B_c: [Q, N], w: [Q]   ->  [P, N]

which is one tensor-core matmul per (chunk, head, slice of P). With packed sequences
(seq_idx), positions that belong to an earlier sequence than ``last`` get w = 0: their
contribution was reset before the chunk ends.

:func:`chunk_state_tile` is shared by the split kernel below and by the fused stage-2 kernel
in :mod:`ssd.state_passing`.
"""
import functools

import cuda.tile as ct

from ._launch import array_type, index_dtype_for, launch, optional
from .config import StateConfig

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634  # decays are exp(a) = exp2(a * log2(e)): exp2 is the native unit


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


def chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_K):
    """Tile code: the [1] cumulative log-decay at the chunk's last position, dA_cumsum[..., Q-1].

    Taken out of the chunk's last BLOCK_K row, not loaded as one element: a one-element tile is
    a cp.async that the consumer warps issue and wait out themselves at every chunk of the
    walk, where a row is a TMA load the producer issues ahead (and the same row the last K
    step reads). On the H200 this took 18-24 % off the fused stage 2 at chunk 128
    (results/h200/screening/stop21/tail-row.json; the peers chapter, 10, has the numbers)."""
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
    which the H200 ran faster per forward than the counted loop on every model shape
    (results/h200/screening/stop17/flat-walk*.json; the peers chapter, 10, has the numbers).
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


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None, latency=None, warps=None):
    """The kernel for one index width and one set of compiler hints (see StateConfig)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def chunk_state_kernel(
        x: Array,          # (b, l, h, p)
        B: Array,          # (b, l, g, n)
        dt_out: Array,     # (b, h, c, q) fp32
        dA_cumsum: Array,  # (b, h, c, q) fp32
        seq_idx: Array,    # (b, l) int32 (ignored unless HAS_SEQ)
        seq_last: Array,   # (b, c) int32: seq_idx at each chunk's last valid position
        states: Array,     # (b, c, h, p, n) out
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        n_tiles: int,      # cdiv(n, BLOCK_N)
        Q: ConstInt,
        BLOCK_K: ConstInt,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        HAS_SEQ: ConstBool,
    ):
        """Grid: (b * c, h, cdiv(p, BLOCK_P) * cdiv(n, BLOCK_N)); every chunk independently."""
        ib = ct.bid(0) // nchunks
        ic = ct.bid(0) % nchunks
        ih = ct.bid(1)
        ip = ct.bid(2) // n_tiles
        jn = ct.bid(2) % n_tiles
        st = chunk_state_tile(ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32), x, B, dt_out,
                              dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih,
                              ih // heads_per_group, ip, jn, Q, BLOCK_K, BLOCK_P, BLOCK_N, HAS_SEQ,
                              latency)
        ct.store(states, index=(ib, ic, ih, ip, jn),
                 tile=st.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(states.dtype))

    return chunk_state_kernel


def chunk_state(B, x, dt_out, dA_cumsum, seq_idx=None, seq_last=None,
                config: StateConfig = StateConfig(), out=None):
    """Launch stage 2a (split variant).

    Args:
        B: (b, l, g, n); x: (b, l, h, p); dt_out, dA_cumsum: (b, h, c, q) fp32 from chunk_cumsum.
        seq_idx: optional (b, l) int32; seq_last: (b, c) int32 (see :func:`ssd.api.chunk_seq_last`).
        out: optional preallocated (b, c, h, p, n) fp32 tensor.
    Returns:
        states (b, c, h, p, n) fp32.
    """
    import torch

    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _, _, nchunks, q = dt_out.shape
    if out is None:
        out = torch.empty((b, nchunks, h, p, n), device=x.device, dtype=torch.float32)
    has_seq = seq_idx is not None
    seq_idx = optional(seq_idx, 2, torch.int32, x.device)
    seq_last = optional(seq_last, 2, torch.int32, x.device)
    kernel = build_kernel(index_dtype_for(x, B, out), config.occupancy, config.latency,
                          config.warps)
    block_n, n_tiles, slices = config.slices(p, n)
    grid = (b * nchunks, h, slices)
    launch(kernel, grid, (x, B, dt_out, dA_cumsum, seq_idx, seq_last, out, l, nchunks, h // g,
                          n_tiles, q, min(config.block_k, q), config.block_p, block_n, has_seq),
           device=x.device)
    return out
