"""Stage 2a, chunk_state: the state each chunk contributes on its own.

For chunk c of head h (its group's B), with q running over the chunk and ``last`` its final
valid position::

    states[c] = sum_q  exp(dA_cumsum[last] - dA_cumsum[q]) * dt'[q] * x[q] (outer) B[q]
              = x_c^T  @  (w * B_c)          x_c: [Q, P], B_c: [Q, N], w: [Q]   ->  [P, N]

which is one tensor-core matmul per (chunk, head, slice of P). With packed sequences
(seq_idx), positions that belong to an earlier sequence than ``last`` get w = 0: their
contribution was reset before the chunk ends.

:func:`chunk_state_tile` is shared by the split kernel below and by the fused stage-2 kernel
in :mod:`ssd.kernels.state_passing`.
"""
import functools

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import StateConfig
from .tiles import ConstInt, ConstBool, chunk_state_tile


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
        seq_idx: optional (b, l) int32; seq_last: (b, c) int32
            (see :func:`ssd.launch.chunk_seq_last`).
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
    launch(kernel, grid, dict(
        x=x, B=B, dt_out=dt_out, dA_cumsum=dA_cumsum, seq_idx=seq_idx, seq_last=seq_last,
        states=out, seqlen=l, nchunks=nchunks, heads_per_group=h // g, n_tiles=n_tiles, Q=q,
        BLOCK_K=min(config.block_k, q), BLOCK_P=config.block_p, BLOCK_N=block_n,
        HAS_SEQ=has_seq), device=x.device)
    return out
