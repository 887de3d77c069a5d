"""Stages 2 and 3 in one kernel: the walk over a sequence's chunks also writes their output rows.

The shipped stage 2 walks each (batch, head, state slice) over its chunks with the running state
in registers and stores every chunk's entering state for chunk_scan to read back (on 2.7b about
168 MB each way in bf16). Here the walking block computes the chunk's output rows itself, for its
head and ``block_p`` channels, from the entering state it holds:

    y_c = 2^(a_t) C_c stateᵀ + (C_c B_cᵀ ∘ 2^(a_t - a_s) dt_s, s <= t) x_c + D x_c  [* silu(z_c)]
    state <- 2^(a_last) state + (x_c ∘ 2^(a_last - a_s) dt_s)ᵀ B_c

(a: dA_cumsum in log2 units). Only the last line chains one chunk to the next; the three MMAs of
the output rows hang off it, so the compiler can overlap them with the next chunk's loads. No
entering state is stored, and chunk_scan's launch and its second reads of x, B and C go.

The price is parallelism: the grid is (b, h, cdiv(p, block_p)), each block walks all of its
sequence's chunks, and ``block_p`` cannot shrink without recomputing C Bᵀ per slice. So it pays
where that grid fills the GPU's resident blocks (:func:`ssd.config.default_config` decides).

Covers: any length (a partial last chunk loads zeros past the end, where dt' is 0, and its rows
past the end are not stored), any head dim and state width (tiles padded to powers of two),
groups, D per head or channel, z, initial states. Not seq_idx: packed sequences take the
three-stage path (:func:`ssd.api.takes_fused_scan`).
"""

import functools

import cuda.tile as ct

from ..launch import array_type, index_dtype_for, launch, optional
from ..config import FusedScanConfig, next_pow2
from .tiles import ConstInt, ConstBool, ZERO, LOG2E, chunk_end_decay, head_rows, head_weights, finish_rows


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None):
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def fused_scan_kernel(
        x: Array,               # (b, l, h, p)
        B: Array,               # (b, l, g, n)
        C: Array,               # (b, l, g, n)
        dt_out: Array,          # (b, h, c, q) fp32
        dA_cumsum: Array,       # (b, h, c, q) fp32
        D: Array,               # (h,) or (h, p) (ignored unless HAS_D)
        z: Array,               # (b, l, h, p) (ignored unless HAS_Z)
        initial_states: Array,  # (b, h, p, n) (ignored unless HAS_INIT)
        y: Array,               # (b, l, h, p) out
        final_states: Array,    # (b, h, p, n) fp32 out
        nchunks: int,
        heads_per_group: int,
        Q: ConstInt,
        BLOCK_P: ConstInt,
        N_PAD: ConstInt,
        HAS_D: ConstBool,
        D_PER_HEAD: ConstBool,
        HAS_Z: ConstBool,
        HAS_INIT: ConstBool,
    ):
        """Grid: (b, h, cdiv(p, BLOCK_P)); each block walks every chunk of its sequence."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2)
        ig = ih // heads_per_group
        if HAS_INIT:
            state = ct.load(initial_states, index=(ib, ih, ip, 0), shape=(1, 1, BLOCK_P, N_PAD),
                            padding_mode=ZERO).reshape((BLOCK_P, N_PAD)).astype(ct.float32)
        else:
            state = ct.zeros((BLOCK_P, N_PAD), dtype=ct.float32)
        trow = ct.arange(Q, dtype=ct.int32)
        keep = trow[:, None] >= trow[None, :]  # [Q, Q] causal
        for ic in range(nchunks):
            c_t = ct.load(C, index=(ib, ic, ig, 0), shape=(1, Q, 1, N_PAD),
                          padding_mode=ZERO).reshape((Q, N_PAD)).astype(x.dtype)
            b_t = ct.load(B, index=(ib, ic, ig, 0), shape=(1, Q, 1, N_PAD),
                          padding_mode=ZERO).reshape((Q, N_PAD)).astype(x.dtype)
            x_t = head_rows(x, ib, ic, ih, ip, Q, BLOCK_P)  # [Q, P]
            a_t = ct.load(dA_cumsum, index=(ib, ih, ic, 0), shape=(1, 1, 1, Q)).reshape((Q,)) * LOG2E
            # the entering state's part of the rows, then the chunk's own (the diagonal block)
            acc = ct.mma(c_t, ct.transpose(state.astype(x.dtype)),
                         ct.zeros((Q, BLOCK_P), dtype=ct.float32))
            acc = acc * ct.exp2(a_t)[:, None]
            cb = ct.mma(c_t, ct.transpose(b_t), ct.zeros((Q, Q), dtype=ct.float32))
            w = head_weights(cb, a_t, keep, True, dt_out, dA_cumsum, ib, ih, ic, 0, Q)
            acc = ct.mma(w.astype(x.dtype), x_t, acc)
            finish_rows(acc, x_t, z, D, y, ib, ic, ih, ip, Q, BLOCK_P, HAS_D, D_PER_HEAD, HAS_Z)
            # carry the state over the chunk (past a partial chunk's end dt' is 0: no change)
            last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, Q).reshape((1, 1)) * LOG2E
            dt_t = ct.load(dt_out, index=(ib, ih, ic, 0), shape=(1, 1, 1, Q)).reshape((Q,))
            wts = ct.exp2(last.reshape((1,)) - a_t) * dt_t  # [Q]
            xw = (x_t.astype(ct.float32) * wts[:, None]).astype(x.dtype)  # [Q, P]
            state = ct.mma(ct.transpose(xw), b_t, state * ct.exp2(last))
        ct.store(final_states, index=(ib, ih, ip, 0), tile=state.reshape((1, 1, BLOCK_P, N_PAD)))

    return fused_scan_kernel


def fused_scan(B, C, x, dt_out, dA_cumsum, D=None, z=None, initial_states=None,
               config: FusedScanConfig = FusedScanConfig(), out=None):
    """Launch stages 2 and 3 as one kernel (after chunk_cumsum).

    Args:
        B, C: (b, l, g, n); x: (b, l, h, p); dt_out, dA_cumsum: (b, h, c, q) fp32 from
        chunk_cumsum; D: optional (h,) or (h, p); z: optional (b, l, h, p);
        initial_states: optional (b, h, p, n).
        out: optional preallocated pair (y (b, l, h, p) of x's dtype, final_states (b, h, p, n)
            fp32).
    Returns:
        (y, final_states).
    """
    import torch

    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _, _, nchunks, q = dt_out.shape
    dev = x.device
    y, final = out if out is not None else (
        torch.empty_like(x), torch.empty((b, h, p, n), device=dev, dtype=torch.float32))
    kernel = build_kernel(index_dtype_for(x, z, y), config.occupancy)
    launch(kernel, (b, h, -(-p // config.block_p)), dict(
        x=x, B=B, C=C, dt_out=dt_out, dA_cumsum=dA_cumsum, D=optional(D, 2, torch.float32, dev),
        z=optional(z, 4, x.dtype, dev),
        initial_states=optional(initial_states, 4, torch.float32, dev), y=y, final_states=final,
        nchunks=nchunks, heads_per_group=h // g, Q=q, BLOCK_P=config.block_p, N_PAD=next_pow2(n),
        HAS_D=D is not None, D_PER_HEAD=D is not None and D.dim() == 1, HAS_Z=z is not None,
        HAS_INIT=initial_states is not None), device=dev)
    return y, final
