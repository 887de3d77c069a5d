"""Stage 2b, state_passing: the state entering every chunk, sequential over chunks.

    prev_states[0] = initial_states (or 0)
    prev_states[c+1] = exp(dA_cumsum[c, last]) * prev_states[c] + states[c]

With packed sequences the carry is dropped (factor 0) where the sequence at the end of chunk c
differs from the one at the end of chunk c-1 (a virtual seq_idx of 0 precedes the first chunk,
so initial states only feed a batch row whose first sequence has id 0, as in mamba_ssm).

One kernel, two modes (the ``FUSED`` constant):

* split (:func:`state_passing`): scans the per-chunk states written by :mod:`ssd.kernels.chunk_state`.
* fused (:func:`chunk_state_passing`): each block walks its chunks in order, decays its
  running state and accumulates every chunk's MMAs straight into it on chip
  (:func:`ssd.kernels.tiles.chunk_state_tile` with the decayed state as its accumulator), so the
  per-chunk states never go to memory.

Either way a block owns a ``BLOCK_P`` x ``BLOCK_N`` slice of one head's state, so the
parallelism is b * h * cdiv(p, BLOCK_P) * cdiv(n, BLOCK_N) blocks, each walking all chunks:
the trade-off against chunk_state's b * c * h * ... blocks is measured in the Performance
chapter.

For few sequences the fused walk can cut the chunks into ``StateConfig.groups`` runs walked at
once (:func:`grouped_chunk_state_passing`), G times the blocks, each from a zero state. Passing
the state is linear in it, so the state entering chunk c of group g is the group's own walk up to
c plus the state entering the group carried over the group's chunks before c: a second small
kernel forms the groups' entering states in order, and chunk_scan adds that part as it loads each
stored state (:class:`Groups`).
"""
import functools
from typing import NamedTuple

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import StateConfig
from .tiles import ConstInt, ConstBool, ZERO, LOG2E, DECAY_ROW, chunk_end_decay, chunk_state_tile


def carry_factor(dA_cumsum, seq_last, prev_seq, ib, ih, ic, Q, BLOCK_K, HAS_SEQ):
    """Tile code: the [1, 1] factor that carries the running state across chunk ``ic``, and
    the sequence id at the chunk's end (the next chunk's ``prev_seq``)."""
    last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, BLOCK_K).reshape((1, 1))
    factor = ct.exp2(last * LOG2E)  # [1, 1], decay of the whole chunk
    seq_end = prev_seq
    if HAS_SEQ:
        seq_end = ct.load(seq_last, index=(ib, ic), shape=(1, 1))
        factor = ct.where(seq_end == prev_seq, factor, 0.0)
    return factor, seq_end


def walk_chunk(state, ic, prev_seq, x, B, dt_out, dA_cumsum, states, seq_idx, seq_last,
               prev_states, seqlen, heads_per_group, ib, ih, ip, jn, Q, BLOCK_K, BLOCK_P, BLOCK_N,
               FUSED, HAS_SEQ, FULL, latency, transposed):
    """Tile code: store the running state as chunk ``ic``'s entering state, then carry it over
    the chunk. Returns the state after the chunk, the sequence id at the chunk's end and the
    carry factor [1, 1] (0 where a sequence began)."""
    store_state(prev_states, state.astype(prev_states.dtype), ib, ic, ih, ip, jn, BLOCK_P, BLOCK_N,
                transposed)
    factor, prev_seq = carry_factor(dA_cumsum, seq_last, prev_seq, ib, ih, ic, Q, BLOCK_K, HAS_SEQ)
    if FUSED:
        state = chunk_state_tile(state * factor, x, B, dt_out, dA_cumsum, seq_idx, seq_last,
                                 seqlen, ib, ic, ih, ih // heads_per_group, ip, jn, Q, BLOCK_K,
                                 BLOCK_P, BLOCK_N, HAS_SEQ, latency, transposed, FULL)
    else:
        new = ct.load(states, index=(ib, ic, ih, ip, jn),
                      shape=(1, 1, 1, BLOCK_P, BLOCK_N)).reshape((BLOCK_P, BLOCK_N))
        state = state * factor + new
    return state, prev_seq, factor


def store_state(arr, state, ib, i1, ih, ip, jn, BLOCK_P, BLOCK_N, transposed):
    """Tile code: store a running state [P, N] (transposed: [N, P]) as [i1, ih] of a
    (b, ., h, p, n) array of the state's dtype."""
    if transposed:
        ct.store(arr, index=(ib, i1, ih, jn, ip), order=(0, 1, 2, 4, 3),
                 tile=state.reshape((1, 1, 1, BLOCK_N, BLOCK_P)))
    else:
        ct.store(arr, index=(ib, i1, ih, ip, jn), tile=state.reshape((1, 1, 1, BLOCK_P, BLOCK_N)))


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None, latency=None, warps=None, transposed=False):
    """The kernel for one index width and one set of compiler hints (see StateConfig), the
    running state transposed or not (``transposed``, fused walk only)."""
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy, num_worker_warps=warps)
    def state_passing_kernel(
        x: Array,               # (b, l, h, p) (fused only)
        B: Array,               # (b, l, g, n) (fused only)
        dt_out: Array,          # (b, h, c, q) fp32 (fused only)
        dA_cumsum: Array,       # (b, h, c, q) fp32
        states: Array,          # (b, c, h, p, n) fp32 from chunk_state (split only)
        initial_states: Array,  # (b, h, p, n) (ignored unless HAS_INIT)
        seq_idx: Array,         # (b, l) int32 (fused with HAS_SEQ only)
        seq_last: Array,        # (b, c) int32 (ignored unless HAS_SEQ)
        prev_states: Array,     # (b, c, h, p, n) out: state entering each chunk (GROUPED: from
                                # the group's start, a zero state there)
        final_states: Array,    # (b, h, p, n) fp32 out (unless GROUPED)
        chunk_decay: Array,     # (b, h, c, DECAY_ROW) fp32 out (GROUPED): carry from the group's
                                # start to each chunk's start, repeated along the row
        group_end: Array,       # (b, G, h, p, n) fp32 out (GROUPED): each group's state after
                                # its last chunk, from a zero state
        group_decay: Array,     # (b, h, G) fp32 out (GROUPED): carry over each whole group
        seqlen: int,
        nchunks: int,
        heads_per_group: int,
        n_tiles: int,           # cdiv(n, BLOCK_N)
        slices: int,            # blocks per (batch, head, group): cdiv(p, BLOCK_P) * n_tiles
        chunks_per_group: int,  # GROUPED only
        Q: ConstInt,
        BLOCK_K: ConstInt,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        FUSED: ConstBool,
        HAS_INIT: ConstBool,
        HAS_SEQ: ConstBool,
        FULL: ConstBool,        # every chunk full (fused only): the K loop unrolled
        GROUPED: ConstBool,     # the chunks walked in groups (fused only)
    ):
        """Grid: (b, h, slices), or GROUPED (b, h, groups * slices); each block walks all chunks,
        or GROUPED the chunks of its group."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        sl = ct.bid(2)  # the block's state slice
        if GROUPED:
            sl = ct.bid(2) % slices
        ip = sl // n_tiles
        jn = sl % n_tiles
        # transposed: the running state is [BLOCK_N, BLOCK_P], read and written through a
        # permuted view of the (.., p, n) arrays (``order``), so memory layouts do not change.
        if transposed:
            state = ct.zeros((BLOCK_N, BLOCK_P), dtype=ct.float32)
            if HAS_INIT and not GROUPED:
                state = ct.load(initial_states, index=(ib, ih, jn, ip), shape=(1, 1, BLOCK_N, BLOCK_P),
                                order=(0, 1, 3, 2), padding_mode=ZERO)
                state = state.reshape((BLOCK_N, BLOCK_P)).astype(ct.float32)
        else:
            state = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
            if HAS_INIT and not GROUPED:
                state = ct.load(initial_states, index=(ib, ih, ip, jn), shape=(1, 1, BLOCK_P, BLOCK_N),
                                padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
        walk = (x, B, dt_out, dA_cumsum, states, seq_idx, seq_last, prev_states, seqlen,
                heads_per_group, ib, ih, ip, jn, Q, BLOCK_K, BLOCK_P, BLOCK_N, FUSED, HAS_SEQ,
                FULL, latency, transposed)
        if GROUPED:
            # Each group starts from a zero state; the carry over the chunks walked so far
            # (``decay``) is what chunk_scan scales the group's entering state by (state passing
            # is linear in the state).
            grp = ct.bid(2) // slices
            c0 = grp * chunks_per_group
            prev_seq = ct.zeros((1, 1), dtype=ct.int32)  # the virtual sequence id before chunk 0
            if HAS_SEQ:
                last = ct.load(seq_last, index=(ib, ct.maximum(c0 - 1, 0)), shape=(1, 1))
                prev_seq = ct.where(c0 > 0, last, prev_seq)
            decay = ct.full((1, 1), 1.0, dtype=ct.float32)
            for ic in range(c0, ct.minimum(c0 + chunks_per_group, nchunks)):
                ct.store(chunk_decay, index=(ib, ih, ic, 0), tile=decay.reshape((1, 1, 1, 1))
                         * ct.full((1, 1, 1, DECAY_ROW), 1.0, dtype=ct.float32))
                state, prev_seq, factor = walk_chunk(state, ic, prev_seq, *walk)
                decay = decay * factor
            store_state(group_end, state, ib, grp, ih, ip, jn, BLOCK_P, BLOCK_N, transposed)
            ct.store(group_decay, index=(ib, ih, grp), tile=decay.reshape((1, 1, 1)))
        else:
            prev_seq = ct.zeros((1, 1), dtype=ct.int32)  # the virtual sequence id before chunk 0
            for ic in range(nchunks):
                state, prev_seq, factor = walk_chunk(state, ic, prev_seq, *walk)
            if transposed:
                ct.store(final_states, index=(ib, ih, jn, ip), order=(0, 1, 3, 2),
                         tile=state.reshape((1, 1, BLOCK_N, BLOCK_P)))
            else:
                ct.store(final_states, index=(ib, ih, ip, jn),
                         tile=state.reshape((1, 1, BLOCK_P, BLOCK_N)))

    return state_passing_kernel


@functools.lru_cache(maxsize=None)
def build_group_kernel(index_dtype=ct.int32):
    """The kernel that carries the state from chunk group to chunk group (GROUPED walks)."""
    Array = array_type(index_dtype)

    @ct.kernel
    def group_passing_kernel(
        group_end: Array,       # (b, G, h, p, n) fp32: each group's state from a zero state
        group_decay: Array,     # (b, h, G) fp32: carry over each whole group
        initial_states: Array,  # (b, h, p, n) (ignored unless HAS_INIT)
        group_enter: Array,     # (b, G, h, p, n) out: the state entering each group
        final_states: Array,    # (b, h, p, n) fp32 out
        groups: int,
        n_tiles: int,
        BLOCK_P: ConstInt,
        BLOCK_N: ConstInt,
        HAS_INIT: ConstBool,
    ):
        """Grid: (b, h, slices); each block passes its state slice over the groups in order:
        enter[g + 1] = decay[g] enter[g] + end[g], enter[0] = initial_states (or 0)."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2) // n_tiles
        jn = ct.bid(2) % n_tiles
        state = ct.zeros((BLOCK_P, BLOCK_N), dtype=ct.float32)
        if HAS_INIT:
            state = ct.load(initial_states, index=(ib, ih, ip, jn), shape=(1, 1, BLOCK_P, BLOCK_N),
                            padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N)).astype(ct.float32)
        for grp in range(groups):
            ct.store(group_enter, index=(ib, grp, ih, ip, jn),
                     tile=state.reshape((1, 1, 1, BLOCK_P, BLOCK_N)).astype(group_enter.dtype))
            d = ct.load(group_decay, index=(ib, ih, grp), shape=(1, 1, 1)).reshape((1, 1))
            end = ct.load(group_end, index=(ib, grp, ih, ip, jn), shape=(1, 1, 1, BLOCK_P, BLOCK_N),
                          padding_mode=ZERO).reshape((BLOCK_P, BLOCK_N))
            state = state * d + end
        ct.store(final_states, index=(ib, ih, ip, jn), tile=state.reshape((1, 1, BLOCK_P, BLOCK_N)))

    return group_passing_kernel


def _outputs(b, nchunks, h, p, n, device, config, input_dtype, out):
    import torch

    if out is not None:
        return out.prev_states, out.final_states
    if input_dtype is None and config.state_dtype == "input":
        raise ValueError("state_passing on its own does not see the input dtype: pass a "
                         "StateConfig whose state_dtype is a dtype name, not 'input'")
    state_dtype = getattr(torch, config.storage_dtype(input_dtype))
    return (torch.empty((b, nchunks, h, p, n), device=device, dtype=state_dtype),
            torch.empty((b, h, p, n), device=device, dtype=torch.float32))


def chunks_per_group(nchunks: int, groups: int) -> int:
    """Chunks a group of the GROUPED walk covers (the last group may be shorter or empty)."""
    return -(-nchunks // groups)


class Groups(NamedTuple):
    """What chunk_scan needs from a grouped walk besides the states it stored:
    chunk_decay (b, h, c, DECAY_ROW) fp32, the carry from each chunk's group start to the chunk
    (repeated along the last axis);
    group_enter (b, G, h, p, n) in the states' dtype, the state entering each group; and
    chunks_per_group. The state entering chunk c is
    prev_states[c] + chunk_decay[c, 0] group_enter[c // chunks_per_group]."""

    chunk_decay: object
    group_enter: object
    chunks_per_group: int


class StageTwo(NamedTuple):
    """Stage 2's outputs, or (passed as ``out``) preallocated buffers for them:
    prev_states (b, c, h, p, n), the state entering each chunk (a grouped walk: from its group's
    start); final_states (b, h, p, n) fp32; groups, a grouped walk's :class:`Groups` (None
    otherwise; as ``out``, its buffers, or None to allocate them)."""

    prev_states: object
    final_states: object
    groups: Groups | None = None


def _launch(x, B, dt_out, dA_cumsum, states, initial_states, seq_idx, seq_last, config, out):
    """Launch the stage-2 scan: fused when ``states`` is None, else over the given states.
    ``out``: a :class:`StageTwo` of buffers, or None. Returns a :class:`StageTwo`."""
    import torch

    fused = states is None
    b, _, nchunks, q = dA_cumsum.shape
    h, p, n = (x.shape[2], x.shape[3], B.shape[3]) if fused else states.shape[2:]
    dev = dA_cumsum.device
    grouped = fused and config.groups > 1
    prev_states, final_states = _outputs(b, nchunks, h, p, n, dev, config,
                                         x.dtype if fused else None, out)
    buffers = out.groups if out is not None else None
    block_n, n_tiles, slices = config.slices(p, n)
    G = config.groups if grouped else 1
    cpg = chunks_per_group(nchunks, G)
    if grouped:
        f32 = dict(device=dev, dtype=torch.float32)
        chunk_decay = (buffers.chunk_decay if buffers is not None
                       else torch.empty((b, h, nchunks, DECAY_ROW), **f32))
        group_end = torch.empty((b, G, h, p, n), **f32)
        group_decay = torch.empty((b, h, G), **f32)
    else:
        chunk_decay = group_end = group_decay = None
    # FULL unrolls the walk's K loop where every chunk is full, and only up to two K blocks a
    # chunk: at four (q=256) the unrolled walk compiles to 255 registers and 228 KB of shared
    # memory for sm_90, against 64 and 54 KB counted.
    kernel = build_kernel(index_dtype_for(x, B, states, prev_states), config.occupancy,
                          config.latency, config.warps, config.transposed and fused)
    launch(kernel, (b, h, slices * G), dict(
        x=optional(x, 4, torch.bfloat16, dev), B=optional(B, 4, torch.bfloat16, dev),
        dt_out=optional(dt_out, 4, torch.float32, dev), dA_cumsum=dA_cumsum,
        states=optional(states, 5, torch.float32, dev),
        initial_states=optional(initial_states, 4, torch.float32, dev),
        seq_idx=optional(seq_idx, 2, torch.int32, dev),
        seq_last=optional(seq_last, 2, torch.int32, dev), prev_states=prev_states,
        final_states=final_states, chunk_decay=optional(chunk_decay, 4, torch.float32, dev),
        group_end=optional(group_end, 5, torch.float32, dev),
        group_decay=optional(group_decay, 3, torch.float32, dev),
        seqlen=x.shape[1] if fused else 0, nchunks=nchunks,
        heads_per_group=h // B.shape[2] if fused else 1, n_tiles=n_tiles, slices=slices,
        chunks_per_group=cpg, Q=q, BLOCK_K=min(config.block_k, q), BLOCK_P=config.block_p,
        BLOCK_N=block_n, FUSED=fused, HAS_INIT=initial_states is not None,
        HAS_SEQ=seq_last is not None,
        FULL=fused and x.shape[1] % q == 0 and q <= 2 * config.block_k, GROUPED=grouped),
        device=dev)
    if not grouped:
        return StageTwo(prev_states, final_states)
    group_enter = (buffers.group_enter if buffers is not None
                   else torch.empty((b, G, h, p, n), device=dev, dtype=prev_states.dtype))
    # The state between groups: [block_p, block_n] slices as the walk's (untransposed here).
    launch(build_group_kernel(index_dtype_for(group_end, group_enter)), (b, h, slices), dict(
        group_end=group_end, group_decay=group_decay,
        initial_states=optional(initial_states, 4, torch.float32, dev), group_enter=group_enter,
        final_states=final_states, groups=G, n_tiles=n_tiles, BLOCK_P=config.block_p,
        BLOCK_N=block_n, HAS_INIT=initial_states is not None), device=dev)
    return StageTwo(prev_states, final_states, Groups(chunk_decay, group_enter, cpg))


def state_passing(states, dA_cumsum, initial_states=None, seq_last=None,
                  config: StateConfig = StateConfig(), out=None):
    """Launch stage 2b (split variant).

    Args:
        states: (b, c, h, p, n) fp32 from :func:`ssd.kernels.chunk_state.chunk_state`.
        dA_cumsum: (b, h, c, q) fp32.
        initial_states: optional (b, h, p, n).
        seq_last: optional (b, c) int32, seq_idx at each chunk's last valid position.
        out: optional :class:`StageTwo` of buffers.
    Returns:
        :class:`StageTwo`: prev_states (b, c, h, p, n) in ``config.state_dtype`` (which must name
        a dtype here), final_states (b, h, p, n) fp32.
    """
    return _launch(None, None, None, dA_cumsum, states, initial_states, None, seq_last, config,
                   out)


def chunk_state_passing(B, x, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                        seq_last=None, config: StateConfig = StateConfig(), out=None):
    """Launch the fused stage 2 (chunk_state + state_passing in one kernel).

    Args:
        B: (b, l, g, n); x: (b, l, h, p); dt_out, dA_cumsum: (b, h, c, q) fp32.
        initial_states: optional (b, h, p, n); seq_idx: optional (b, l) int32 with
        seq_last (b, c) int32.
        out: optional :class:`StageTwo` of buffers.
    Returns:
        :class:`StageTwo`: prev_states (b, c, h, p, n) in ``config.storage_dtype(x's dtype)``,
        final_states (b, h, p, n) fp32. With ``config.groups > 1`` the states are each group's walk from a
        zero state: see :func:`grouped_chunk_state_passing`.
    """
    if config.groups > 1:
        raise ValueError("chunk_state_passing: config.groups > 1 stores states that need their "
                         "groups' entering states: call grouped_chunk_state_passing")
    return _launch(x, B, dt_out, dA_cumsum, None, initial_states, seq_idx, seq_last, config,
                   out)


def grouped_chunk_state_passing(B, x, dt_out, dA_cumsum, initial_states=None, seq_idx=None,
                                seq_last=None, config: StateConfig = StateConfig(), out=None):
    """The fused stage 2 over ``config.groups`` groups of chunks (arguments as for
    :func:`chunk_state_passing`; ``out.groups`` may hold chunk_decay and group_enter buffers).

    Returns:
        :class:`StageTwo`: prev_states (b, c, h, p, n), each chunk's entering state from its
        group's start (a zero state there); final_states (b, h, p, n) fp32 (the true one); groups,
        the :class:`Groups` with which chunk_scan completes the entering states.
    """
    return _launch(x, B, dt_out, dA_cumsum, None, initial_states, seq_idx, seq_last, config, out)
