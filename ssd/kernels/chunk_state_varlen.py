"""chunk_state_varlen: the final state of every packed sequence (mamba_ssm's varlen states).

Sequence i of a batch of one row ends at e = cu_seqlens[i + 1] - 1, in chunk c = e // q, at
k = e - c q. Its state there is the state entering chunk c, decayed to e, plus what the chunk
writes from the sequence's first token in it up to e::

    varlen_states[i] = exp(dA_cumsum[c, k]) prev_states[c]            (if it ran into chunk c)
                     + sum_{s in c, s <= e, seq_idx[s] = seq_idx[e]}
                           exp(dA_cumsum[c, k] - dA_cumsum[c, s]) dt'[s] x[s] (outer) B[s]

Stage 2 already stored prev_states[c] (= h_{cq-1}), so only the chunk where each sequence ends is
read: no pass over the whole input. The entering state counts where the sequence is the one
running before the chunk (seq_idx before it, a virtual 0 before chunk 0, is its own, as
chunk_scan decides for y); otherwise the sequence began inside the chunk, and the mask on
seq_idx drops the chunk's positions before its start (and after its end). The second term is
chunk_state's product (:func:`ssd.kernels.tiles.k_step`) with the decay taken to e instead of
the chunk's end, over the K blocks from the sequence's first token in the chunk to e.

A block owns one ``BLOCK_P`` x ``BLOCK_N`` slice of one head's state of one sequence: grid
(num_sequences, h, slices), each block one chunk's K blocks at most.
"""
import functools

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import StateConfig
from .tiles import ConstInt, ConstBool, ZERO, LOG2E, DECAY_ROW, k_step


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32):
    """The kernel for one index width."""
    Array = array_type(index_dtype)

    @ct.kernel
    def chunk_state_varlen_kernel(
        x: Array,              # (1, l, h, p)
        B: Array,              # (1, l, g, n)
        dt_out: Array,         # (1, h, c, q) fp32
        dA_cumsum: Array,      # (1, h, c, q) fp32
        prev_states: Array,    # (1, c, h, p, n) state entering each chunk (GROUPED: from its
                               # group's start)
        chunk_decay: Array,    # (1, h, c, DECAY_ROW) fp32, carry from the chunk's group start
                               # (GROUPED only)
        group_enter: Array,    # (1, G, h, p, n) state entering each group (GROUPED only)
        seq_idx: Array,        # (1, l) int32
        seq_last: Array,       # (1, c) int32: seq_idx at each chunk's last valid position
        cu_seqlens: Array,     # (S + 1,) int32
        varlen_states: Array,  # (S, h, p, n) fp32 out
        heads_per_group: int,
        n_tiles: int,          # cdiv(n, BLOCK_N)
        chunks_per_group: int,  # GROUPED only
        Q: ConstInt,
        BLOCK_K: ConstInt,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        GROUPED: ConstBool,    # stage 2 walked its chunks in groups (state_passing.Groups)
    ):
        """Grid: (S, h, cdiv(p, BLOCK_P) * n_tiles); one sequence's state slice per block."""
        i = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2) // n_tiles
        jn = ct.bid(2) % n_tiles
        start = ct.load(cu_seqlens, index=(i,), shape=(1,)).item()
        end = ct.load(cu_seqlens, index=(i + 1,), shape=(1,)).item()
        ic = (end - 1) // Q  # the chunk where the sequence ends
        last = ct.load(dA_cumsum, index=(0, ih, ic, end - 1 - ic * Q),
                       shape=(1, 1, 1, 1)).reshape((1,))  # [1], cumulative decay at the end
        seq_end = ct.load(seq_idx, index=(0, end - 1), shape=(1, 1)).reshape((1,))  # [1]
        # The sequence before the chunk: at the previous chunk's end, a virtual 0 before chunk 0.
        before = ct.load(seq_last, index=(0, ct.maximum(ic - 1, 0)), shape=(1, 1)).reshape((1,))
        before = ct.where(ic > 0, before, 0)
        # The entering state decayed to the end; 0 where the sequence began inside the chunk.
        # dA_cumsum <= 0, so the exp2 is at most 1.
        factor = ct.where(seq_end == before, ct.exp2(last * LOG2E), 0.0).reshape((1, 1))
        enter = ct.load(prev_states, index=(0, ic, ih, ip, jn), shape=(1, 1, 1, BLOCK_P, BLOCK_N),
                        padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
        if GROUPED:
            # the group's part: its entering state carried from the group start to the chunk
            group = ct.load(group_enter, index=(0, ic // chunks_per_group, ih, ip, jn),
                            shape=(1, 1, 1, BLOCK_P, BLOCK_N), padding_mode=ZERO)
            row = ct.load(chunk_decay, index=(0, ih, ic, 0), shape=(1, 1, 1, DECAY_ROW))
            carry = ct.extract(row.reshape((DECAY_ROW,)), index=(0,), shape=(1,)).reshape((1, 1))
            enter = enter + carry * group.reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
        state = enter * factor  # [P, N] fp32
        # The chunk's writes up to the end: K blocks from the one holding the sequence's first
        # token in the chunk. k_step weights position s by 2^(last - dA_cumsum[s]) dt'[s] where
        # seq_idx[s] == seq_end, 0 elsewhere (positions past the end, of a later sequence, would
        # have a positive exponent: the mask selects, so their inf never enters the sum).
        k_begin = ct.maximum(start - ic * Q, 0) // BLOCK_K
        k_end = (end - 1 - ic * Q) // BLOCK_K + 1
        for kk in range(k_begin, k_end):
            state = k_step(state, kk, x, B, dt_out, dA_cumsum, seq_idx, last, seq_end, 0, ic, ih,
                           ih // heads_per_group, ip, jn, Q, BLOCK_K, BLOCK_P, BLOCK_N, True, None,
                           False)
        ct.store(varlen_states, index=(i, ih, ip, jn),
                 tile=state.reshape((1, 1, BLOCK_P, BLOCK_N)))

    return chunk_state_varlen_kernel


def chunk_state_varlen(B, x, dt_out, dA_cumsum, prev_states, cu_seqlens, seq_idx, seq_last,
                       config: StateConfig = StateConfig(), out=None, groups=None):
    """Launch chunk_state_varlen after stage 2.

    Args:
        B: (1, l, g, n); x: (1, l, h, p); dt_out, dA_cumsum: (1, h, c, q) fp32.
        prev_states: (1, c, h, p, n) from stage 2 (any state dtype).
        cu_seqlens: (S + 1,) int32, 0 first, l last, strictly increasing.
        seq_idx: (1, l) int32 changing exactly at cu_seqlens' offsets; seq_last: (1, c) int32
            (see :func:`ssd.launch.chunk_seq_last`).
        config: the stage-2 config; its block_p, block_n and block_k tile the state and the chunk.
        out: optional preallocated (S, h, p, n) fp32 tensor.
        groups: the :class:`ssd.kernels.state_passing.Groups` of a grouped stage 2, whose
            prev_states start from zero at each group.
    Returns:
        varlen_states (S, h, p, n) fp32.
    """
    import torch

    _, _, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    q = dA_cumsum.shape[3]
    S = cu_seqlens.shape[0] - 1
    dev = x.device
    if out is None:
        out = torch.empty((S, h, p, n), device=dev, dtype=torch.float32)
    block_n, n_tiles, slices = config.slices(p, n)
    kernel = build_kernel(index_dtype_for(x, B, prev_states, out))
    launch(kernel, (S, h, slices), dict(
        x=x, B=B, dt_out=dt_out, dA_cumsum=dA_cumsum, prev_states=prev_states,
        chunk_decay=optional(groups and groups.chunk_decay, 4, torch.float32, dev),
        group_enter=optional(groups and groups.group_enter, 5, prev_states.dtype, dev),
        seq_idx=seq_idx, seq_last=seq_last, cu_seqlens=cu_seqlens, varlen_states=out,
        heads_per_group=h // g, n_tiles=n_tiles,
        chunks_per_group=groups.chunks_per_group if groups else dA_cumsum.shape[2], Q=q,
        BLOCK_K=min(config.block_k, q), BLOCK_P=config.block_p, BLOCK_N=block_n,
        GROUPED=groups is not None), device=dev)
    return out
