r"""NumPy reference for the Mamba-2 SSD backward pass: the gradients, rung by rung.

Two rungs, the second checked against the first, the first against finite differences of
the forward reference (``ssd.reference``):

1. ``ssd_recurrence_backward`` -- the adjoint of the recurrence, a reverse-time scan;
2. ``ssd_chunked_backward``    -- the backward of each chunked stage, composed in reverse:
   ``chunk_scan_backward`` -> ``state_passing_backward`` -> ``chunk_state_backward`` ->
   ``chunk_cumsum_backward``.

Everything is float64. The upstream gradients are dy = dLoss/dy (b, l, h, p) and, if the
final states are used, dfinal_states = dLoss/dfinal_states (b, h, p, n). Every function
returns a dict that maps "d" + the name of each array argument it differentiates to that
gradient, in the argument's shape: the full rungs return dx, ddt, dA, dB, dC and, where the
input was given, dD ((h,) or (h, p)), dz, ddt_bias, dinitial_states; seq_idx has none.
Notation as in ``ssd.reference`` (legend b, l, h, p, n, g, c, q); dt' is the step after
bias, softplus and clamp; <U, V> is the sum of the elementwise product.

The derivation
--------------
**The output gate and skip.** The forward ends with y_t = (y^{ssm}_t + D x_t) silu(z_t).
With y^{pre}_t = y^{ssm}_t + D x_t and silu'(z) = \sigma(z) (1 + z (1 - \sigma(z))):
dz_t = dy_t y^{pre}_t silu'(z_t), dy^{pre}_t = dy_t silu(z_t), dD = \sum_{b,t} dy^{pre}_t x_t
(also summed over p for a per-head D), dx_t gets D dy^{pre}_t, and dy^{ssm} = dy^{pre}.
It needs y^{pre}, which is not the forward's output y: a kernel either saves it (what
mamba_ssm does, as ``out_x``) or recomputes the whole chunk_scan.

**The recurrence adjoint.** Per (b, h): h_t = a_t \bar h_{t-1} + dt'_t x_t B_t^T with
a_t = exp(dt'_t A), \bar h_{t-1} = h_{t-1} except 0 where seq_idx[t] starts a new sequence,
and y^{ssm}_t = h_t C_t. Let G_t = dLoss/dh_t, the total over every later use of h_t. It
obeys the transposed recurrence, run backwards from G_{l-1} = dfinal_states:

    G_t = dy_t C_t^T + a_{t+1} keep_{t+1} G_{t+1}        (keep = 0 where a sequence starts)

and every gradient is a local product with it: dC_t = h_t^T dy_t, dx_t = dt'_t G_t B_t,
dB_t = dt'_t G_t^T x_t, and, for the log-decay \ell_t = dt'_t A,
d\ell_t = a_t <G_t, \bar h_{t-1}>, so ddt'_t = <G_t, x_t B_t^T> + A d\ell_t and
dA = \sum_{b,t} dt'_t d\ell_t. d initial_states = a_0 keep_0 G_0. The scan needs every
h_{t-1}: this reference stores all l states. Running the recurrence backwards instead,
h_{t-1} = (h_t - dt'_t x_t B_t^T) / a_t, divides by decays <= 1 (the error grows like
1 / \prod a) and cannot cross a seq_idx reset, which is why the chunked backward rebuilds
states forward from chunk boundaries. B and C of a group collect the gradients of its
h / g heads.

**chunk_scan.** y^{ssm}_t = \sum_{s<=t} W_{ts} x_s + e^{\Lambda_t} C_t P_c^T with
W_{ts} = (C_t . B_s) e^{\Lambda_t - \Lambda_s} dt'_s (pairs in one chunk and one
sequence), \Lambda = dA_cumsum and P_c = prev_states of t's chunk. The diagonal block is
masked attention, so its backward is attention's: dx_s = \sum_{t>=s} W_{ts} dy_t (the
transposed, anti-causal product); dW_{ts} = dy_t . x_s; with
dM_{ts} = dW_{ts} e^{\Lambda_t - \Lambda_s} dt'_s, dC_t = \sum_s dM_{ts} B_s and
dB_s = \sum_t dM_{ts} C_t (two more (q x q) by (q x n) products a chunk);
ddt'_s = \sum_t dW_{ts} (C_t . B_s) e^{\Lambda_t - \Lambda_s}, and the exponent sends
dW_{ts} W_{ts} to d\Lambda_t with a plus sign and to d\Lambda_s with a minus. The
off-diagonal term gives dP_c = \sum_t e^{\Lambda_t} dy_t C_t^T -- a chunk_state of (dy, C)
with decays from the chunk start instead of to its end -- plus dC_t = e^{\Lambda_t} P_c^T dy_t
and d\Lambda_t += e^{\Lambda_t} dy_t . (P_c C_t). Needs: x, B, C, dt', \Lambda, prev_states
(the largest intermediate, b c h p n: saved by the forward or rebuilt by rerunning stage 2)
and y^{pre} for dz.

**state_passing.** P_{c+1} = d_c P_c + S_c with d_c = e^{\Lambda_{c,last}} (0 where a new
sequence starts inside chunk c) and P_C = final_states. Its adjoint is the same scan run from the last
chunk to the first with the same decays: with R_C = dfinal_states,
dS_c = R_{c+1} and R_c = dP_c + d_c R_{c+1}, and d initial_states = R_0 (the gradient
arriving at P_0). The decay's gradient is <R_{c+1}, P_c> d_c, into \Lambda_{c,last} only.
Needs the prev_states P_c (the same array chunk_scan's backward reads) and each chunk's
total decay; it is the only sequential step, over chunks, as in the forward.

**chunk_state.** S_c = \sum_s w_s x_s B_s^T with w_s = e^{\Lambda_{last} - \Lambda_s} dt'_s
(0 for positions of a sequence that ended before the chunk did). Given dS_c:
dx_s = w_s dS_c B_s -- the state read by B_s, as chunk_scan's off-diagonal term reads it by
C_t, with decays to the chunk's end -- dB_s = w_s dS_c^T x_s, and with
dw_s = x_s . (dS_c B_s): ddt'_s = dw_s e^{\Lambda_{last} - \Lambda_s}, and the exponent
sends dw_s w_s to \Lambda_{last} with a plus sign and to \Lambda_s with a minus. Needs only
the forward's inputs and \Lambda: nothing saved.

**chunk_cumsum.** \Lambda_t = \sum_{k<=t in chunk} dt'_k A, so the gradient of one step's
log-decay is the reverse (suffix) cumulative sum d\ell_k = \sum_{t>=k in chunk} d\Lambda_t,
collected from all three stages above; then ddt'_k = d(dt_out)_k + A d\ell_k and
dA = \sum dt'_k d\ell_k. The padded tail (l % q != 0) carries no gradient to the inputs, but
the padded last column of \Lambda does (chunk_state and state_passing read it, and it equals
the chunk's last valid value), and the suffix sum passes it to every valid step. Then back
through dt' = clamp(softplus(dt + dt_bias), lo, hi): the clamp passes the gradient where
lo <= softplus(...) <= hi and zeroes it strictly outside (at a boundary the forward returns
its input, so the derivative from inside is taken; mamba_ssm's ``clamp_mask`` and
torch.clamp do the same); softplus multiplies by \sigma(u) where u = dt + dt_bias <= 20 and
by 1 above (the forward's identity branch); ddt_bias = \sum_{b,l} ddt. Needs dt and dt_bias
to recompute u, the clamp mask and \sigma: elementwise, nothing saved.

**Saved versus recomputed.** Beyond the inputs, the backward reads two forward
intermediates that are costly to rebuild: prev_states (b, c, h, p, n; chunk_scan's and
state_passing's backward both read it; rebuilding it reruns chunk_state and the sequential
state_passing) and y^{pre} (b, l, h, p; only with z, for dz; rebuilding it reruns
chunk_scan). dt_out and dA_cumsum (b, h, c, q) are cheap to recompute from dt, and the
chunk states S_c are needed only to rebuild prev_states. This reference recomputes
everything; a kernel's choice trades that work against the memory of saving.
"""

from __future__ import annotations

import numpy as np

from ssd.reference import (
    INF,
    _check_chunk_size,
    _check_dt_limit,
    _chunk,
    _chunk_carry,
    _describe,
    _heads,
    _scan_masks,
    _state_keep,
    check_inputs,
    chunk_cumsum,
    chunk_scan,
    chunk_state,
    prepare_dt,
    recurrence_states,
    softplus,
    state_passing,
)

__all__ = [
    "prepare_dt_backward",
    "ssd_recurrence_backward",
    "chunk_cumsum_backward",
    "chunk_state_backward",
    "state_passing_backward",
    "chunk_scan_backward",
    "ssd_chunked_backward",
]


# --------------------------------------------------------------------------------------
# Small pieces shared by both rungs
# --------------------------------------------------------------------------------------


def _grad_array(name, value, layout, dims):
    """An upstream gradient as float64, its shape checked against the forward's sizes.

    Args:
        name: argument name for errors. layout: its axes, e.g. "blhp".
        dims: letter -> size from ``check_inputs``.
    Raises:
        ValueError naming the argument and the expected shape, or non-finite values.
    """
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"{name}: expected a real-valued array, got dtype {arr.dtype}")
    arr = arr.astype(np.float64)
    want = tuple(dims[d] for d in layout)
    if arr.shape != want:
        known = {d: (dims[d], "") for d in layout}
        raise ValueError(f"{name}: expected shape {_describe(layout, known)}, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name}: contains NaN or inf; gradients must be finite")
    return arr


def _sigmoid(v):
    """1 / (1 + exp(-v)) without overflow."""
    return np.exp(-softplus(-v))


def _unchunk(a, l):
    """(b, c, q, ...) -> (b, l, ...): the inverse of ``_chunk``, dropping the padded tail."""
    b, c, q = a.shape[:3]
    return a.reshape((b, c * q) + a.shape[3:])[:, :l]


def _group_sum(a, g):
    """Per-head gradients of B or C summed over each group: (..., h, n) -> (..., g, n).

    The adjoint of ``_heads``: head i read group i // (h // g), consecutive heads.
    """
    h, n = a.shape[-2:]
    return a.reshape(a.shape[:-2] + (g, h // g, n)).sum(-2)


def _skip_and_gate_backward(dy, y_ssm, x, D, z):
    """The backward of y = (y_ssm + D x) * silu(z), the last two lines of every rung.

    Args:
        dy, y_ssm, x: (b, l, h, p). D: None, (h,) or (h, p). z: None or (b, l, h, p).
    Returns:
        dy_ssm (b, l, h, p), dx_skip (b, l, h, p) or 0.0, dD (D's shape) or None,
        dz (b, l, h, p) or None.
    """
    Dhp = None if D is None else (D[:, None] if D.ndim == 1 else D)  # (h, 1) or (h, p)
    y_pre = y_ssm if D is None else y_ssm + Dhp * x  # the output before the gate
    dz = None
    if z is not None:
        sig = _sigmoid(z)
        dz = dy * y_pre * sig * (1.0 + z * (1.0 - sig))  # silu'(z) = sig (1 + z (1 - sig))
        dy = dy * z * sig  # through silu(z)
    if D is None:
        return dy, 0.0, None, dz
    dD = np.einsum("blhp,blhp->hp", dy, x)  # (h, p)
    return dy, Dhp * dy, (dD.sum(-1) if D.ndim == 1 else dD), dz


def prepare_dt_backward(ddt_prime, dt, dt_bias=None, dt_softplus=False,
                        dt_limit=(0.0, INF)):
    """The backward of ``prepare_dt``: dt' = clamp(softplus(dt + dt_bias), lo, hi).

    Convention at the clamp's edges: the gradient passes where lo <= s <= hi (s the value
    before the clamp), boundaries included, and is 0 strictly outside. At s == lo or hi the
    forward returns s itself, so the derivative from inside the interval is taken (as
    mamba_ssm's chunk_cumsum backward and torch.clamp). Softplus contributes sigmoid(u)
    where u = dt + dt_bias <= 20 and 1 above (the forward's identity branch).

    Args:
        ddt_prime: (b, l, h) gradient of dt'.
        dt, dt_bias, dt_softplus, dt_limit: as for ``prepare_dt``.
    Returns:
        dict with ddt (b, l, h) and, when dt_bias is given, ddt_bias (h,).
    """
    arrays, dims = check_inputs(dt=dt, dt_bias=dt_bias, dt_limit=dt_limit)
    lo, hi = _check_dt_limit(dt_limit)
    ddt_prime = _grad_array("ddt_prime", ddt_prime, "blh", dims)
    u = arrays["dt"] + arrays.get("dt_bias", 0.0)  # (b, l, h), before softplus
    s, slope = u, np.ones_like(u)
    if dt_softplus:
        soft = u <= 20.0
        s = np.where(soft, softplus(u), u)
        slope = np.where(soft, _sigmoid(u), 1.0)
    inside = (s >= lo) & (s <= hi)  # edges included: see the convention above
    ddt = np.where(inside, ddt_prime * slope, 0.0)  # (b, l, h)
    out = {"ddt": ddt}
    if dt_bias is not None:
        out["ddt_bias"] = ddt.sum(axis=(0, 1))  # (h,)
    return out


# --------------------------------------------------------------------------------------
# Rung 1: the adjoint of the recurrence
# --------------------------------------------------------------------------------------


def ssd_recurrence_backward(dy, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                            initial_states=None, seq_idx=None, dt_softplus=False,
                            dt_limit=(0.0, INF), *, dfinal_states=None):
    """Rung 1: the gradients of ``ssd_recurrence`` by a reverse-time scan.

        G_{l-1} = dfinal_states;  G_t += dy_t C_t^T;  ... ;  G_{t-1} = a_t keep_t G_t

    Args:
        dy: (b, l, h, p) gradient of y.
        x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit:
            the forward's arguments (see ``ssd_recurrence``).
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
    Returns:
        dict of float64 arrays: dx (b, l, h, p), ddt (b, l, h), dA (h,), dB and dC
        (b, l, g, n), and where given dD ((h,) or (h, p)), dz (b, l, h, p),
        ddt_bias (h,), dinitial_states (b, h, p, n).
    """
    arrays, dims = check_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_limit=dt_limit,
    )
    dy = _grad_array("dy", dy, "blhp", dims)
    x, A = arrays["x"], arrays["A"]
    b, l, h, p = x.shape
    n, g = dims["n"], dims["g"]
    G = (np.zeros((b, h, p, n)) if dfinal_states is None
         else _grad_array("dfinal_states", dfinal_states, "bhpn", dims).copy())
    dtp = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    Bh = _heads(arrays["B"], h)  # (b, l, h, n)
    Ch = _heads(arrays["C"], h)  # (b, l, h, n)
    h0 = arrays.get("initial_states", np.zeros((b, h, p, n)))  # (b, h, p, n)
    seq = arrays.get("seq_idx")

    # 1. the forward states h_t, all of them (the scan below reads h_{t-1} at every step).
    states = recurrence_states(x, dt, A, B, C, dt_bias, initial_states, seq_idx,
                               dt_softplus, dt_limit)  # (b, l, h, p, n)
    y_ssm = np.einsum("blhpn,blhn->blhp", states, Ch)  # (b, l, h, p)

    # 2. the gate and skip; what remains is the gradient of y_ssm = h_t C_t.
    dy, dx_skip, dD, dz = _skip_and_gate_backward(dy, y_ssm, x, arrays.get("D"),
                                                  arrays.get("z"))

    # 3. where a sequence starts, the forward used 0 instead of h_{t-1} (virtual seq 0).
    if seq is None:
        starts = np.zeros((b, l), dtype=bool)
    else:
        before = np.concatenate([np.zeros((b, 1), np.int64), seq[:, :-1]], axis=1)
        starts = seq != before

    # 4. the reverse-time scan: G is dLoss/dh_t, gathered from y_t and from h_{t+1}.
    dx = np.empty((b, l, h, p))
    dBh = np.empty((b, l, h, n))
    dCh = np.empty((b, l, h, n))
    ddtp = np.empty((b, l, h))
    dA = np.zeros(h)
    for t in range(l - 1, -1, -1):
        G = G + np.einsum("bhp,bhn->bhpn", dy[:, t], Ch[:, t])
        dCh[:, t] = np.einsum("bhpn,bhp->bhn", states[:, t], dy[:, t])
        dx[:, t] = dtp[:, t, :, None] * np.einsum("bhpn,bhn->bhp", G, Bh[:, t])
        dBh[:, t] = dtp[:, t, :, None] * np.einsum("bhpn,bhp->bhn", G, x[:, t])
        h_before = states[:, t - 1] if t > 0 else h0  # (b, h, p, n)
        h_before = np.where(starts[:, t, None, None, None], 0.0, h_before)
        decay = np.exp(dtp[:, t] * A)  # (b, h)
        dlog_decay = decay * np.einsum("bhpn,bhpn->bh", G, h_before)  # d(dt'_t A)
        ddtp[:, t] = (np.einsum("bhpn,bhp,bhn->bh", G, x[:, t], Bh[:, t])
                      + A * dlog_decay)
        dA += np.einsum("bh,bh->h", dtp[:, t], dlog_decay)
        G = np.where(starts[:, t, None, None, None], 0.0, decay[:, :, None, None] * G)

    # 5. back through the dt transform; group the per-head B and C gradients.
    out = {"dx": dx + dx_skip, "dA": dA, "dB": _group_sum(dBh, g),
           "dC": _group_sum(dCh, g)}
    dt_grads = prepare_dt_backward(ddtp, dt, dt_bias, dt_softplus, dt_limit)
    return _ordered(out, dt_grads, dD, dz, G if initial_states is not None else None)


def _ordered(core, dt_grads, dD, dz, dinitial_states):
    """The full rungs' dict in one order: dx, ddt, dA, dB, dC, then the optional ones."""
    out = {"dx": core["dx"], "ddt": dt_grads["ddt"], "dA": core["dA"], "dB": core["dB"],
           "dC": core["dC"]}
    for key, value in (("dD", dD), ("dz", dz), ("ddt_bias", dt_grads.get("ddt_bias")),
                       ("dinitial_states", dinitial_states)):
        if value is not None:
            out[key] = value
    return out


# --------------------------------------------------------------------------------------
# Rung 2: the backward of each chunked stage
# --------------------------------------------------------------------------------------


def chunk_cumsum_backward(ddt_out, ddA_cumsum, dt, A, chunk_size, dt_bias=None,
                          dt_softplus=False, dt_limit=(0.0, INF)):
    """The backward of stage 1, ``chunk_cumsum``.

    Args:
        ddt_out, ddA_cumsum: (b, h, c, q) gradients of dt_out and dA_cumsum (all the stages'
            contributions summed; the padded tail's ddt_out is ignored).
        dt, A, chunk_size, dt_bias, dt_softplus, dt_limit: the forward's arguments.
    Returns:
        dict with ddt (b, l, h), dA (h,) and, when dt_bias is given, ddt_bias (h,).
    """
    _check_chunk_size(chunk_size)
    arrays, dims = check_inputs(dt=dt, A=A, dt_bias=dt_bias, chunk_size=chunk_size,
                                dt_limit=dt_limit)
    ddt_out = _grad_array("ddt_out", ddt_out, "bhcq", dims)
    ddA_cumsum = _grad_array("ddA_cumsum", ddA_cumsum, "bhcq", dims)
    A = arrays["A"]
    dt_out, _ = chunk_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)  # (b, h, c, q)

    # 1. the cumsum's adjoint is a suffix sum: step k's log-decay dt'_k A feeds every
    #    dA_cumsum[t] with t >= k in its chunk (the padded tail's entries included).
    dlog_decay = np.flip(np.cumsum(np.flip(ddA_cumsum, -1), -1), -1)  # (b, h, c, q)
    dA = np.einsum("bhcq,bhcq->h", dlog_decay, dt_out)  # padded dt' = 0 adds nothing
    ddt_prime = ddt_out + A[None, :, None, None] * dlog_decay  # (b, h, c, q)

    # 2. un-chunk (the padded tail is a constant 0 in the forward: dropped), then back
    #    through the clamp, softplus and bias.
    ddt_prime = _unchunk(ddt_prime.transpose(0, 2, 3, 1), dims["l"])  # (b, l, h)
    out = prepare_dt_backward(ddt_prime, dt, dt_bias, dt_softplus, dt_limit)
    out["dA"] = dA
    return out


def chunk_state_backward(dstates, B, x, dt_out, dA_cumsum, seq_idx=None):
    """The backward of stage 2, ``chunk_state``.

    Args:
        dstates: (b, c, h, p, n) gradient of states.
        B, x, dt_out, dA_cumsum, seq_idx: the forward's arguments.
    Returns:
        dict with dB (b, l, g, n), dx (b, l, h, p), ddt_out (b, h, c, q) and
        ddA_cumsum (b, h, c, q) (this stage's contributions only).
    """
    arrays, dims = check_inputs(x=x, B=B, dt_out=dt_out, dA_cumsum=dA_cumsum,
                                seq_idx=seq_idx)
    x, dt_out, dA_cs = arrays["x"], arrays["dt_out"], arrays["dA_cumsum"]
    dS = _grad_array("dstates", dstates, "bchpn", dims)
    l, h, q, g = dims["l"], dims["h"], dims["q"], dims["g"]
    x_c = _chunk(x, q)  # (b, c, q, h, p)
    B_c = _heads(_chunk(arrays["B"], q), h)  # (b, c, q, h, n)

    # 1. the forward's weights w_s = exp(dA_cs[last] - dA_cs[s]) dt'_s, masked by seq_idx.
    decay_to_end = np.exp(dA_cs[..., -1:] - dA_cs)  # (b, h, c, q), <= 1
    if "seq_idx" in arrays:
        keep = _state_keep(arrays["seq_idx"], l, q)  # (b, c, q)
        decay_to_end = np.where(keep[:, None], decay_to_end, 0.0)
    weight = decay_to_end * dt_out  # (b, h, c, q)

    # 2. x and B: the state's gradient read back by B_s (resp. x_s), weighted.
    dx_c = np.einsum("bhcs,bcshn,bchpn->bcshp", weight, B_c, dS, optimize=True)
    dB_c = np.einsum("bhcs,bcshp,bchpn->bcshn", weight, x_c, dS, optimize=True)

    # 3. the weight: its dt' factor, and its exponent dA_cs[last] - dA_cs[s].
    dweight = np.einsum("bcshp,bcshn,bchpn->bhcs", x_c, B_c, dS, optimize=True)
    dexponent = dweight * weight  # (b, h, c, q)
    ddA_cumsum = -dexponent
    ddA_cumsum[..., -1] += dexponent.sum(-1)
    return {"dB": _group_sum(_unchunk(dB_c, l), g), "dx": _unchunk(dx_c, l),
            "ddt_out": dweight * decay_to_end, "ddA_cumsum": ddA_cumsum}


def state_passing_backward(dprev_states, states, dA_cumsum, initial_states=None,
                           seq_idx=None, chunk_size=None, *, dfinal_states=None):
    """The backward of stage 3, ``state_passing``: the scan over chunks, run backwards.

        R = dfinal_states;  for c = C-1 .. 0:  dstates[c] = R;  R = dprev[c] + decay_c R

    Args:
        dprev_states: (b, c, h, p, n) gradient of prev_states.
        states, dA_cumsum, initial_states, seq_idx, chunk_size: the forward's arguments.
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
    Returns:
        dict with dstates (b, c, h, p, n), ddA_cumsum (b, h, c, q) (non-zero in the last
        column only) and, when initial_states is given, dinitial_states (b, h, p, n).
    """
    arrays, dims = check_inputs(states=states, dA_cumsum=dA_cumsum,
                                initial_states=initial_states, seq_idx=seq_idx,
                                chunk_size=chunk_size)
    dprev = _grad_array("dprev_states", dprev_states, "bchpn", dims)
    b, c, h, p, n = arrays["states"].shape
    R = (np.zeros((b, h, p, n)) if dfinal_states is None
         else _grad_array("dfinal_states", dfinal_states, "bhpn", dims).copy())

    # 1. the forward's entering states (the decay's gradient reads them) and decays.
    prev_states, _ = state_passing(arrays["states"], arrays["dA_cumsum"],
                                   initial_states, seq_idx, chunk_size)  # (b, c, h, p, n)
    chunk_decay = np.exp(arrays["dA_cumsum"][..., -1])  # (b, h, c)
    if "seq_idx" in arrays:
        carry = _chunk_carry(arrays["seq_idx"], dims["l"], dims["q"])  # (b, c)
        chunk_decay = np.where(carry[:, None, :], chunk_decay, 0.0)

    # 2. the reverse scan: R is dLoss/d(state after chunk ci), i.e. of prev_states[ci + 1].
    dstates = np.empty_like(prev_states)  # (b, c, h, p, n)
    ddecay = np.empty((b, h, c))
    for ci in range(c - 1, -1, -1):
        dstates[:, ci] = R
        ddecay[:, :, ci] = np.einsum("bhpn,bhpn->bh", R, prev_states[:, ci])
        R = dprev[:, ci] + chunk_decay[:, :, ci, None, None] * R

    # 3. d exp(dA_cs[last]) / d dA_cs[last] = the decay itself (0 where not carried).
    ddA_cumsum = np.zeros_like(arrays["dA_cumsum"])  # (b, h, c, q)
    ddA_cumsum[..., -1] = ddecay * chunk_decay
    out = {"dstates": dstates, "ddA_cumsum": ddA_cumsum}
    if initial_states is not None:
        out["dinitial_states"] = R
    return out


def chunk_scan_backward(dy, B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None,
                        seq_idx=None):
    """The backward of stage 4, ``chunk_scan`` (diagonal block, off-diagonal term, D, z).

    Args:
        dy: (b, l, h, p) gradient of y.
        B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx: the forward's arguments.
    Returns:
        dict with dB and dC (b, l, g, n), dx (b, l, h, p), ddt_out and ddA_cumsum
        (b, h, c, q), dprev_states (b, c, h, p, n) and, where given, dD ((h,) or (h, p))
        and dz (b, l, h, p). dB, dx, ddt_out and ddA_cumsum are this stage's
        contributions only.
    """
    arrays, dims = check_inputs(x=x, B=B, C=C, D=D, z=z, seq_idx=seq_idx, dt_out=dt_out,
                                dA_cumsum=dA_cumsum, prev_states=prev_states)
    dy = _grad_array("dy", dy, "blhp", dims)
    x, dt_out, dA_cs = arrays["x"], arrays["dt_out"], arrays["dA_cumsum"]
    P = arrays["prev_states"]  # (b, c, h, p, n)
    l, h, q, g = dims["l"], dims["h"], dims["q"], dims["g"]

    # 1. the gate and skip need the output before them: recompute the SSM part.
    y_ssm = chunk_scan(B, C, x, dt_out, dA_cs, P, seq_idx=seq_idx)  # (b, l, h, p)
    dy_ssm, dx_skip, dD, dz = _skip_and_gate_backward(dy, y_ssm, x, arrays.get("D"),
                                                      arrays.get("z"))
    dy_c = _chunk(dy_ssm, q)  # (b, c, q, h, p), 0 on the padded tail
    x_c = _chunk(x, q)  # (b, c, q, h, p)
    B_c = _heads(_chunk(arrays["B"], q), h)  # (b, c, q, h, n)
    C_c = _heads(_chunk(arrays["C"], q), h)  # (b, c, q, h, n)
    allowed, enters = _scan_masks(arrays.get("seq_idx"), q)

    # 2. diagonal blocks, as the forward: W[t, s] = (C_t . B_s) L[t, s] dt'_s, L masked to
    #    exactly 0 (before exp) outside the causal, same-sequence pairs.
    CB = np.einsum("bcthn,bcshn->bhcts", C_c, B_c)  # (b, h, c, t, s)
    log_decay = dA_cs[..., :, None] - dA_cs[..., None, :]  # (b, h, c, t, s)
    L = np.exp(np.where(allowed, log_decay, -np.inf))  # (b, h, c, t, s)
    CBL = CB * L
    W = CBL * dt_out[..., None, :]  # (b, h, c, t, s)
    # the transposed (anti-causal) product gives dx; dW is dy_t . x_s
    dx_c = np.einsum("bhcts,bcthp->bcshp", W, dy_c, optimize=True)
    dW = np.einsum("bcthp,bcshp->bhcts", dy_c, x_c, optimize=True)  # (b, h, c, t, s)
    dCB = dW * L * dt_out[..., None, :]  # (b, h, c, t, s)
    dC_c = np.einsum("bhcts,bcshn->bcthn", dCB, B_c, optimize=True)
    dB_c = np.einsum("bhcts,bcthn->bcshn", dCB, C_c, optimize=True)
    ddt_out = np.einsum("bhcts,bhcts->bhcs", dW, CBL)
    # the exponent dA_cs[t] - dA_cs[s]: + to row t, - to column s (W is 0 where masked)
    dexponent = dW * W  # (b, h, c, t, s)
    ddA_cumsum = dexponent.sum(-1) - dexponent.sum(-2)  # (b, h, c, q)

    # 3. off-diagonal term exp(dA_cs[t]) C_t . prev_states[c]: a chunk_state of (dy, C)
    #    with decays from the chunk's start gives dprev_states.
    decay_in = np.exp(dA_cs)  # (b, h, c, q), in (0, 1]
    if enters is not None:
        decay_in = np.where(enters[:, None], decay_in, 0.0)
    dprev = np.einsum("bhct,bcthp,bcthn->bchpn", decay_in, dy_c, C_c, optimize=True)
    dC_c += np.einsum("bhct,bcthp,bchpn->bcthn", decay_in, dy_c, P, optimize=True)
    ddA_cumsum += decay_in * np.einsum("bcthp,bcthn,bchpn->bhct", dy_c, C_c, P,
                                       optimize=True)

    out = {"dB": _group_sum(_unchunk(dB_c, l), g), "dC": _group_sum(_unchunk(dC_c, l), g),
           "dx": _unchunk(dx_c, l) + dx_skip, "ddt_out": ddt_out,
           "ddA_cumsum": ddA_cumsum, "dprev_states": dprev}
    if dD is not None:
        out["dD"] = dD
    if dz is not None:
        out["dz"] = dz
    return out


def ssd_chunked_backward(dy, x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                         initial_states=None, seq_idx=None, dt_softplus=False,
                         dt_limit=(0.0, INF), *, dfinal_states=None):
    """Rung 2: the gradients of ``ssd_chunked``, its stages differentiated in reverse.

    The forward intermediates (dt_out, dA_cumsum, states, prev_states) are recomputed
    here; a kernel may save some of them instead (see the module docstring).

    Args:
        dy: (b, l, h, p) gradient of y.
        x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, dt_softplus,
            dt_limit: the forward's arguments (see ``ssd_chunked``).
        dfinal_states: optional (b, h, p, n) gradient of final_states (None: 0).
    Returns:
        the dict of ``ssd_recurrence_backward``: dx, ddt, dA, dB, dC and, where given,
        dD, dz, ddt_bias, dinitial_states.
    """
    _check_chunk_size(chunk_size)
    check_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, chunk_size=chunk_size, dt_limit=dt_limit,
    )  # validate everything up front, so errors name the caller's arguments
    # forward: the intermediates every backward stage reads
    dt_out, dA_cs = chunk_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)
    states = chunk_state(B, x, dt_out, dA_cs, seq_idx)
    prev_states, _ = state_passing(states, dA_cs, initial_states, seq_idx, chunk_size)
    # 4. chunk_scan: the outputs' gradients reach x, B, C, D, z, dt', dA_cumsum and
    #    the entering states
    scan = chunk_scan_backward(dy, B, C, x, dt_out, dA_cs, prev_states, D, z, seq_idx)
    # 3. state_passing: back over the chunks, from the final state's gradient
    passing = state_passing_backward(scan["dprev_states"], states, dA_cs,
                                     initial_states, seq_idx, chunk_size,
                                     dfinal_states=dfinal_states)
    # 2. chunk_state: each chunk's state gradient reaches its x, B, dt' and dA_cumsum
    state = chunk_state_backward(passing["dstates"], B, x, dt_out, dA_cs, seq_idx)
    # 1. chunk_cumsum: every stage's dt' and dA_cumsum gradients, back to dt, A, dt_bias
    cumsum = chunk_cumsum_backward(
        scan["ddt_out"] + state["ddt_out"],
        scan["ddA_cumsum"] + passing["ddA_cumsum"] + state["ddA_cumsum"],
        dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)
    core = {"dx": scan["dx"] + state["dx"], "dA": cumsum["dA"],
            "dB": scan["dB"] + state["dB"], "dC": scan["dC"]}
    return _ordered(core, cumsum, scan.get("dD"), scan.get("dz"),
                    passing.get("dinitial_states"))
