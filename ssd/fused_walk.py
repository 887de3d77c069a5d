"""Prototype (branch next/fused, stop 40; not on main): stages 2 and 3 in one kernel.

The fused walk already holds each chunk's entering state in registers; the shipped forward stores
it (bf16) for chunk_scan to read back, which on 2.7b is about 168 MB each way. Here the walk's
block computes the chunk's output rows itself, for its head and channel slice:

    y_c = 2^(a_t) C_c stateᵀ + (C_c B_cᵀ ∘ 2^(a_t - a_s) dt_s, s <= t) x_c + D x_c
    state <- 2^(a_last) state + (x_c ∘ 2^(a_last - a_s) dt_s)ᵀ B_c

(a: dA_cumsum in log2 units). Only the last line is a chain from chunk to chunk; the three MMAs
of the output rows hang off it, so the compiler may overlap them with the next chunk's loads.
Scope of the prototype: every chunk full, no seq_idx, no initial states, no z, one p slice of the
whole state n per block; it exists to be timed against the shipped forward (screen script
results/h200/screening/stop40/fused.py on the next device session).
"""

import functools

import cuda.tile as ct

from ._launch import array_type, index_dtype_for, launch, optional
from .chunk_scan import finish_rows, head_rows, head_weights
from .chunk_state import LOG2E, chunk_end_decay
from .config import next_pow2

ConstInt = ct.Constant[int]
ConstBool = ct.Constant[bool]
ZERO = ct.PaddingMode.ZERO


@functools.lru_cache(maxsize=None)
def build_kernel(index_dtype=ct.int32, occupancy=None):
    Array = array_type(index_dtype)

    @ct.kernel(occupancy=occupancy)
    def fused_walk_kernel(
        x: Array,             # (b, l, h, p)
        B: Array,             # (b, l, g, n)
        C: Array,             # (b, l, g, n)
        dt_out: Array,        # (b, h, c, q) fp32
        dA_cumsum: Array,     # (b, h, c, q) fp32
        D: Array,             # (h,) or (h, p) (ignored unless HAS_D)
        y: Array,             # (b, l, h, p) out
        final_states: Array,  # (b, h, p, n) fp32 out
        nchunks: int,
        heads_per_group: int,
        Q: ConstInt,
        BLOCK_P: ConstInt,
        N: ConstInt,
        HAS_D: ConstBool,
        D_PER_HEAD: ConstBool,
    ):
        """Grid: (b, h, cdiv(p, BLOCK_P)); each block walks every chunk of its sequence."""
        ib = ct.bid(0)
        ih = ct.bid(1)
        ip = ct.bid(2)
        ig = ih // heads_per_group
        state = ct.zeros((BLOCK_P, N), dtype=ct.float32)
        trow = ct.arange(Q, dtype=ct.int32)
        keep = trow[:, None] >= trow[None, :]  # [Q, Q] causal
        for ic in range(nchunks):
            c_t = ct.load(C, index=(ib, ic, ig, 0), shape=(1, Q, 1, N),
                          padding_mode=ZERO).reshape((Q, N)).astype(x.dtype)
            b_t = ct.load(B, index=(ib, ic, ig, 0), shape=(1, Q, 1, N),
                          padding_mode=ZERO).reshape((Q, N)).astype(x.dtype)
            x_t = head_rows(x, ib, ic, ih, ip, Q, BLOCK_P)  # [Q, P]
            a_t = ct.load(dA_cumsum, index=(ib, ih, ic, 0), shape=(1, 1, 1, Q)).reshape((Q,)) * LOG2E
            # the entering state's part of the rows, then the chunk's own (the diagonal block)
            acc = ct.mma(c_t, ct.transpose(state.astype(x.dtype)),
                         ct.zeros((Q, BLOCK_P), dtype=ct.float32))
            acc = acc * ct.exp2(a_t)[:, None]
            cb = ct.mma(c_t, ct.transpose(b_t), ct.zeros((Q, Q), dtype=ct.float32))
            w = head_weights(cb, a_t, keep, True, dt_out, dA_cumsum, ib, ih, ic, 0, Q)
            acc = ct.mma(w.astype(x.dtype), x_t, acc)
            finish_rows(acc, x_t, x, D, y, ib, ic, ih, ip, Q, BLOCK_P, HAS_D, D_PER_HEAD, False)
            # carry the state over the chunk
            last = chunk_end_decay(dA_cumsum, ib, ih, ic, Q, Q).reshape((1, 1)) * LOG2E
            dt_t = ct.load(dt_out, index=(ib, ih, ic, 0), shape=(1, 1, 1, Q)).reshape((Q,))
            wts = ct.exp2(last.reshape((1,)) - a_t) * dt_t  # [Q]
            xw = (x_t.astype(ct.float32) * wts[:, None]).astype(x.dtype)  # [Q, P]
            state = ct.mma(ct.transpose(xw), b_t, state * ct.exp2(last))
        ct.store(final_states, index=(ib, ih, ip, 0), tile=state.reshape((1, 1, BLOCK_P, N)))

    return fused_walk_kernel


def fused_walk(B, C, x, dt_out, dA_cumsum, D=None, block_p=64, occupancy=None, out=None):
    """Stages 2 and 3 in one launch (the prototype's scope: see the module docstring).

    Args: B, C (b, l, g, n); x (b, l, h, p); dt_out, dA_cumsum (b, h, c, q) fp32; D optional
    (h,) or (h, p). Returns y (b, l, h, p) in x's dtype and final_states (b, h, p, n) fp32."""
    import torch

    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    _, _, nchunks, q = dt_out.shape
    if l % q or n != next_pow2(n) or p % block_p:
        raise ValueError("fused_walk: full chunks, a power-of-two state and block_p dividing p only")
    y = torch.empty_like(x) if out is None else out
    final = torch.empty((b, h, p, n), device=x.device, dtype=torch.float32)
    kernel = build_kernel(index_dtype_for(x, y), occupancy)
    launch(kernel, (b, h, p // block_p), (
        x, B, C, dt_out, dA_cumsum, optional(D, 2, torch.float32, x.device), y, final, nchunks,
        h // g, q, block_p, n, D is not None, D is not None and D.dim() == 1), device=x.device)
    return y, final
