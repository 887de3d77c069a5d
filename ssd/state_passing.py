"""Stage 2b, state_passing: the state entering every chunk, sequential over chunks.

    prev_states[0] = initial_states (or 0)
    prev_states[c+1] = exp(dA_cumsum[c, last]) * prev_states[c] + states[c]

With packed sequences the carry is dropped (factor 0) where the sequence at the end of chunk c
differs from the one at the end of chunk c-1 (a virtual seq_idx of 0 precedes the first chunk,
so initial states only feed a batch row whose first sequence has id 0, as in mamba_ssm).

Two kernels:

* :func:`state_passing` scans the per-chunk states written by :mod:`ssd.chunk_state` (split).
* :func:`chunk_state_passing` is the fused stage 2: each block walks its chunks in order,
  computes every chunk's state on chip with :func:`ssd.chunk_state.chunk_state_tile` and adds
  it to the running state in registers, so the per-chunk states never go to memory. Its
  parallelism is b * h * cdiv(p, block_p) blocks instead of b * c * h * ..., which is the
  trade-off measured in the Performance chapter.
"""
import functools

import cuda.tile as ct

from ._launch import array_type, index_dtype_for, launch, optional
from .chunk_state import LOG2E, chunk_state_tile, next_pow2
from .config import StateConfig

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


def carry_factor(dA_cumsum, seq_last, prev_seq, ib, ih, ic, Q, HAS_SEQ):
    """Tile code: the [1, 1] factor that carries the running state across chunk ``ic``, and
    the sequence id at the chunk's end (the next chunk's ``prev_seq``)."""
    last = ct.load(dA_cumsum, index=(ib, ih, ic, Q - 1), shape=(1, 1, 1, 1)).reshape((1, 1))
    factor = ct.exp2(last * LOG2E)  # [1, 1], decay of the whole chunk
    seq_end = prev_seq
    if HAS_SEQ:
        seq_end = ct.load(seq_last, index=(ib, ic), shape=(1, 1))
        factor = ct.where(seq_end == prev_seq, factor, 0.0)
    return factor, seq_end


def load_initial(initial_states, ib, ih, ip, BLOCK_P, N_PAD, HAS_INIT):
    """Tile code: the [BLOCK_P, N_PAD] fp32 state before the first chunk."""
    if HAS_INIT:
        init = ct.load(initial_states, index=(ib, ih, ip, 0), shape=(1, 1, BLOCK_P, N_PAD),
                       padding_mode=ZERO)
        return init.reshape((BLOCK_P, N_PAD)).astype(ct.float32)
    return ct.zeros((BLOCK_P, N_PAD), dtype=ct.float32)


@functools.lru_cache(maxsize=None)
def build_split_kernel(index_dtype=ct.int32):
    Array = array_type(index_dtype)

    @ct.kernel
    def state_passing_kernel(
        states: Array,          # (b, c, h, p, n) fp32, from chunk_state
        dA_cumsum: Array,       # (b, h, c, q) fp32
        initial_states: Array,  # (b, h, p, n) (ignored unless HAS_INIT)
        seq_last: Array,        # (b, c) int32 (ignored unless HAS_SEQ)
        prev_states: Array,     # (b, c, h, p, n) out: state entering each chunk
        final_states: Array,    # (b, h, p, n) fp32 out
        nchunks: int,
        Q: ConstInt,
        BLOCK_P: ConstInt,
        N_PAD: ConstInt,
        HAS_INIT: ConstBool,
        HAS_SEQ: ConstBool,
    ):
        """Grid: (b, h, cdiv(p, BLOCK_P)); each block scans all chunks in order."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2)
        state = load_initial(initial_states, ib, ih, ip, BLOCK_P, N_PAD, HAS_INIT)  # [P, N]
        prev_seq = ct.zeros((1, 1), dtype=ct.int32)
        for ic in range(nchunks):
            ct.store(prev_states, index=(ib, ic, ih, ip, 0),
                     tile=state.reshape((1, 1, 1, BLOCK_P, N_PAD)).astype(prev_states.dtype))
            factor, prev_seq = carry_factor(dA_cumsum, seq_last, prev_seq, ib, ih, ic, Q, HAS_SEQ)
            new = ct.load(states, index=(ib, ic, ih, ip, 0), shape=(1, 1, 1, BLOCK_P, N_PAD))
            state = state * factor + new.reshape((BLOCK_P, N_PAD))
        ct.store(final_states, index=(ib, ih, ip, 0), tile=state.reshape((1, 1, BLOCK_P, N_PAD)))

    return state_passing_kernel


@functools.lru_cache(maxsize=None)
def build_fused_kernel(index_dtype=ct.int32):
    Array = array_type(index_dtype)

    @ct.kernel
    def chunk_state_passing_kernel(
        x: Array,               # (b, l, h, p)
        B: Array,               # (b, l, g, n)
        dt_out: Array,          # (b, h, c, q) fp32
        dA_cumsum: Array,       # (b, h, c, q) fp32
        initial_states: Array,  # (b, h, p, n) (ignored unless HAS_INIT)
        seq_idx: Array,         # (b, l) int32 (ignored unless HAS_SEQ)
        seq_last: Array,        # (b, c) int32 (ignored unless HAS_SEQ)
        prev_states: Array,     # (b, c, h, p, n) out
        final_states: Array,    # (b, h, p, n) fp32 out
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        Q: ConstInt,
        BLOCK_K: ConstInt,
        BLOCK_P: ConstInt,
        N_PAD: ConstInt,
        HAS_INIT: ConstBool,
        HAS_SEQ: ConstBool,
    ):
        """Grid: (b, h, cdiv(p, BLOCK_P)); chunk states computed and consumed on chip."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2)
        ig = ih // heads_per_group
        state = load_initial(initial_states, ib, ih, ip, BLOCK_P, N_PAD, HAS_INIT)  # [P, N]
        prev_seq = ct.zeros((1, 1), dtype=ct.int32)
        for ic in range(nchunks):
            ct.store(prev_states, index=(ib, ic, ih, ip, 0),
                     tile=state.reshape((1, 1, 1, BLOCK_P, N_PAD)).astype(prev_states.dtype))
            factor, prev_seq = carry_factor(dA_cumsum, seq_last, prev_seq, ib, ih, ic, Q, HAS_SEQ)
            new = chunk_state_tile(x, B, dt_out, dA_cumsum, seq_idx, seq_last, seqlen, ib, ic, ih,
                                   ig, ip, Q, BLOCK_K, BLOCK_P, N_PAD, HAS_SEQ)  # [P, N]
            state = state * factor + new
        ct.store(final_states, index=(ib, ih, ip, 0), tile=state.reshape((1, 1, BLOCK_P, N_PAD)))

    return chunk_state_passing_kernel


def _outputs(b, nchunks, h, p, n, device, config, out):
    import torch

    if out is not None:
        return out
    state_dtype = getattr(torch, config.state_dtype)
    return (torch.empty((b, nchunks, h, p, n), device=device, dtype=state_dtype),
            torch.empty((b, h, p, n), device=device, dtype=torch.float32))


def state_passing(states, dA_cumsum, initial_states=None, seq_last=None,
                  config: StateConfig = StateConfig(), out=None):
    """Launch stage 2b (split variant).

    Args:
        states: (b, c, h, p, n) fp32 from :func:`ssd.chunk_state.chunk_state`.
        dA_cumsum: (b, h, c, q) fp32.
        initial_states: optional (b, h, p, n).
        seq_last: optional (b, c) int32, seq_idx at each chunk's last valid position.
        out: optional pair (prev_states (b, c, h, p, n), final_states (b, h, p, n) fp32).
    Returns:
        prev_states (b, c, h, p, n) in ``config.state_dtype``, final_states (b, h, p, n) fp32.
    """
    import torch

    b, nchunks, h, p, n = states.shape
    prev_states, final_states = _outputs(b, nchunks, h, p, n, states.device, config, out)
    kernel = build_split_kernel(index_dtype_for(states, prev_states))
    grid = (b, h, -(-p // config.block_p))
    launch(kernel, grid, (states, dA_cumsum,
                          optional(initial_states, 4, torch.float32, states.device),
                          optional(seq_last, 2, torch.int32, states.device),
                          prev_states, final_states, nchunks, dA_cumsum.shape[-1], config.block_p,
                          next_pow2(n), initial_states is not None, seq_last is not None),
           device=states.device)
    return prev_states, final_states


def chunk_state_passing(B, x, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                        seq_last=None, config: StateConfig = StateConfig(), out=None):
    """Launch the fused stage 2 (chunk_state + state_passing in one kernel).

    Args:
        B: (b, l, g, n); x: (b, l, h, p); dt_out, dA_cumsum: (b, h, c, q) fp32.
        initial_states: optional (b, h, p, n); seq_idx: optional (b, l) int32 with
        seq_last (b, c) int32.
    Returns:
        prev_states (b, c, h, p, n) in ``config.state_dtype``, final_states (b, h, p, n) fp32.
    """
    import torch

    b, l, h, p = x.shape
    n = B.shape[3]
    _, _, nchunks, q = dt_out.shape
    prev_states, final_states = _outputs(b, nchunks, h, p, n, x.device, config, out)
    has_seq = seq_idx is not None
    kernel = build_fused_kernel(index_dtype_for(x, B, prev_states))
    grid = (b, h, -(-p // config.block_p))
    launch(kernel, grid, (x, B, dt_out, dA_cumsum,
                          optional(initial_states, 4, torch.float32, x.device),
                          optional(seq_idx, 2, torch.int32, x.device),
                          optional(seq_last, 2, torch.int32, x.device),
                          prev_states, final_states, l, nchunks, h // B.shape[2], q,
                          min(config.block_k, q), config.block_p, next_pow2(n), initial_states is not None, has_seq),
           device=x.device)
    return prev_states, final_states
