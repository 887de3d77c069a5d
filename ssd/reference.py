"""NumPy reference for the Mamba-2 SSD forward pass: the ladder of trusted rungs.

Three ways to compute the same thing, each checked against the one below it:

1. ``ssd_recurrence``  -- the sequential loop over time (the slow truth);
2. ``ssd_quadratic``   -- the masked-attention ("dual") form, one (l x l) matrix per head;
3. ``ssd_chunked``     -- the chunked algorithm, split into the four stages the GPU
   kernels implement: ``chunk_cumsum`` -> ``chunk_state`` -> ``state_passing`` ->
   ``chunk_scan``.

One step of the recurrence, ``recurrence_step``, is also the decode step
(``selective_state_update``): one token advances a state held between calls, as a
serving engine's generation loop does after the prefill.

Everything is computed in float64 whatever the input dtype, so the reference is
limited by float64 round-off (~1e-16 relative) and not by the algorithm.

Dimension legend (mamba_ssm / the SSD paper, Dao & Gu 2024)
-------------------------------------------------------------
=====  ===========  =================================================================
code   name         meaning
=====  ===========  =================================================================
b      batch        independent sequences (or packs of sequences, see ``seq_idx``)
l      seqlen       time steps (the paper's T)
h      nheads       heads; each has its own scalar decay A_h (the paper's "A = a*I")
p      headdim      channels per head (the paper's P); x_t is a p-vector per head
n      dstate       state size (the paper's N); B_t and C_t are n-vectors
g      ngroups      B and C are shared by h/g consecutive heads (grouped-value attention)
c      nchunks      ceil(l / q)
q      chunk_size   the block size of the chunked algorithm (the paper's Q)
=====  ===========  =================================================================

Inputs: x (b,l,h,p), dt (b,l,h), A (h), B and C (b,l,g,n); optional D (h) or (h,p),
z (b,l,h,p), dt_bias (h), initial_states (b,h,p,n), seq_idx (b,l) integer.
Head ``i`` reads the B/C of group ``i // (h // g)``.

Semantics (= mamba_ssm ``mamba_chunk_scan_combined``, forward only)
-------------------------------------------------------------------
* dt' = dt + dt_bias; if dt_softplus: dt' = softplus(dt') where dt' <= 20 (identity
  above, as mamba_ssm); then ALWAYS dt' = clamp(dt', lo, hi) with dt_limit = (lo, hi).
  The default (0, inf) therefore maps a negative dt' to 0.
* per head and step, the decay is a_t = exp(dt'_t * A_h) in (0, 1] because A_h <= 0.
* the state is a (p x n) matrix per head:
      h_t = a_t * h_{t-1} + dt'_t * outer(x_t, B_t)
      y_t = h_t @ C_t + D * x_t ;   if z is given: y_t = y_t * silu(z_t)
* initial_states is h_{-1}; final_states is h_{l-1}.
* seq_idx packs several sequences into one row: where seq_idx[t] != seq_idx[t-1] the
  state restarts (h_{t-1} := 0). The virtual seq_idx[-1] is 0, so initial_states only
  feeds the first sequence when seq_idx[:, 0] == 0. seq_idx must be >= 0 and
  non-decreasing along l (contiguous packing). That contract is a subset of mamba_ssm's
  behaviour, on which the two agree: mamba_ssm also takes negative ids, as padding, and
  its chunk_state leaves tokens whose id is negative out of every chunk's state; the
  reference rejects negative ids rather than define what they do.
* cu_seqlens (num_sequences + 1,) integer, with return_varlen_states (mamba_ssm's varlen
  interface): the offsets of the sequences packed along a batch of one row, 0 first and l
  last, strictly increasing, and seq_idx alongside changing exactly at them. The extra output
  varlen_states (num_sequences, h, p, n) holds h_t at each sequence's last token
  t = cu_seqlens[i + 1] - 1, the initial state included in the first sequence's where
  seq_idx[0, 0] == 0 (as in y and final_states). mamba_ssm's chunk_state_varlen leaves the
  initial state out of it when the first sequence ends inside the first chunk; the
  recurrence, and this reference, do not.

Log units: ``dA_cumsum`` is in natural-log units (exp, not exp2). A kernel that works
in log2 units scales by log2(e) itself; the reference keeps the paper's convention.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "Dims",
    "LAYOUTS",
    "check_shapes",
    "check_inputs",
    "prepare_dt",
    "softplus",
    "silu",
    "segsum",
    "ssd_recurrence",
    "recurrence_step",
    "recurrence_states",
    "ssd_quadratic",
    "chunk_cumsum",
    "chunk_state",
    "state_passing",
    "chunk_scan",
    "check_varlen_shapes",
    "check_cu_seqlens",
    "chunk_state_varlen",
    "ssd_chunked",
    "STEP_LAYOUTS",
    "check_step_shapes",
    "StepOperands",
    "step_operands",
    "selective_state_update",
]

INF = float("inf")


class Dims(NamedTuple):
    """The problem dimensions, in legend order."""

    b: int
    l: int
    h: int
    p: int
    n: int
    g: int


# --------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------

#: Layout of every array the reference (and the kernels) accept, one letter per axis.
#: D is special: (h) or (h, p).
LAYOUTS = {
    "x": "blhp",
    "dt": "blh",
    "A": "h",
    "B": "blgn",
    "C": "blgn",
    "D": "h|hp",
    "z": "blhp",
    "dt_bias": "h",
    "initial_states": "bhpn",
    "seq_idx": "bl",
    # intermediates of the chunked algorithm
    "dt_out": "bhcq",
    "dA_cumsum": "bhcq",
    "states": "bchpn",
    "prev_states": "bchpn",
    "final_states": "bhpn",
}

_DIM_NAMES = {
    "b": "batch",
    "l": "seqlen",
    "h": "nheads",
    "p": "headdim",
    "n": "dstate",
    "g": "ngroups",
    "c": "nchunks",
    "q": "chunk_size",
    "s": "cache slots",
}


def _describe(layout, known, shape=None):
    """'(b, l, g, n) = (2, 64, 1, 16)'.

    Sizes come from ``known``; a size not known yet is taken from ``shape`` when it has
    the right rank, else left as its letter.
    """
    fill = shape if shape is not None and len(shape) == len(layout) else None
    sizes = [known[d][0] if d in known else (fill[i] if fill else d)
             for i, d in enumerate(layout)]
    comma = "," if len(layout) == 1 else ""
    letters = f"({', '.join(layout)}{comma})"
    if all(s == d for s, d in zip(sizes, layout)):  # nothing known: just the letters
        return letters
    return f"{letters} = ({', '.join(str(s) for s in sizes)}{comma})"


def _check_chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise TypeError(
            f"chunk_size: expected a positive int, got {chunk_size!r} "
            f"({type(chunk_size).__name__})"
        )
    if chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")


def _match_layout(name, shape, layout, known):
    """Check one shape against its layout; record the sizes it introduces."""
    if len(shape) != len(layout):
        raise ValueError(
            f"{name}: expected shape {_describe(layout, known)}, got {shape} "
            f"({len(shape)} dims instead of {len(layout)})"
        )
    if any(s < 1 for s in shape):
        raise ValueError(f"{name}: every dimension must be >= 1, got shape {shape}")
    for d, size in zip(layout, shape):
        if d in known and known[d][0] != size:
            value, source = known[d]
            raise ValueError(
                f"{name}: expected shape {_describe(layout, known, shape)}, got {shape} "
                f"({_DIM_NAMES[d]} {d}={size} does not match {d}={value} from {source})"
            )
    for d, size in zip(layout, shape):
        known.setdefault(d, (size, name))
    # Once seqlen and chunk size are known, the number of chunks is fixed.
    if "l" in known and "q" in known and "c" not in known:
        known["c"] = (math.ceil(known["l"][0] / known["q"][0]), "ceil(l/q)")


def _check_groups(known):
    if "h" in known and "g" in known and known["h"][0] % known["g"][0] != 0:
        (h, h_src), (g, g_src) = known["h"], known["g"]
        raise ValueError(
            f"{g_src}: nheads h={h} (from {h_src}) is not divisible by ngroups g={g} "
            f"(from {g_src}); each group of B/C must serve a whole number of heads"
        )


def check_shapes(*, chunk_size=None, **shapes):
    """Check that array shapes agree with each other; return the sizes they imply.

    Works on plain tuples, so a torch-side wrapper can share it:
    ``check_shapes(x=tuple(x.shape), dt=tuple(dt.shape), ..., chunk_size=64)``.

    Args:
        chunk_size: optional positive int q.
        **shapes: shape tuples keyed by argument name, any subset of ``LAYOUTS``
            (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_out, dA_cumsum,
            states, prev_states, final_states). ``None`` values are skipped.
    Returns:
        dict letter -> size for every dimension the shapes determine (b, l, h, p, n,
        g, c, q as available).
    Raises:
        ValueError (or TypeError for a non-int chunk_size) whose message starts with
        the name of the offending argument.
    """
    unknown = sorted(set(shapes) - set(LAYOUTS))
    if unknown:
        raise TypeError(f"check_shapes: unknown argument(s) {unknown}")
    known = {}  # letter -> (size, name of the argument that fixed it)
    if chunk_size is not None:
        _check_chunk_size(chunk_size)
        known["q"] = (int(chunk_size), "chunk_size")
    for name in LAYOUTS:  # fixed order: x defines b, l, h, p; B defines g, n; ...
        shape = shapes.get(name)
        if shape is None:
            continue
        shape = tuple(int(s) for s in shape)
        layout = LAYOUTS[name]
        if name == "D":
            if len(shape) not in (1, 2):
                raise ValueError(
                    f"D: expected shape {_describe('h', known)} or "
                    f"{_describe('hp', known)}, got {shape}"
                )
            layout = "h" if len(shape) == 1 else "hp"
        _match_layout(name, shape, layout, known)

    _check_groups(known)
    if "l" in known and "q" in known and "c" in known:
        (l, l_src), (q, q_src), (c, c_src) = known["l"], known["q"], known["c"]
        if c != math.ceil(l / q):
            raise ValueError(
                f"{c_src}: nchunks c={c} but ceil(l/q) = ceil({l}/{q}) = "
                f"{math.ceil(l / q)} (l from {l_src}, q from {q_src})"
            )
    return {d: size for d, (size, _) in known.items()}


def _as_array(name, value, integer=False):
    """np.asarray with a dtype check: real numbers for data, integers for seq_idx."""
    try:
        arr = np.asarray(value)
    except Exception as exc:  # e.g. ragged nested lists
        raise TypeError(f"{name}: cannot convert {type(value).__name__} to an array") from exc
    kind = arr.dtype.kind
    if integer:
        if kind not in "iu":
            raise TypeError(f"{name}: expected an integer array, got dtype {arr.dtype}")
        return arr.astype(np.int64)
    if kind not in "fiu":
        raise TypeError(f"{name}: expected a real-valued array, got dtype {arr.dtype}")
    return arr.astype(np.float64)


def _check_dt_limit(dt_limit):
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dt_limit: expected a pair (lo, hi), got {dt_limit!r}") from exc
    if math.isnan(lo) or math.isnan(hi) or not (0.0 <= lo <= hi):
        raise ValueError(
            f"dt_limit: expected (lo, hi) with 0 <= lo <= hi, got {tuple(dt_limit)!r} "
            "(dt' must stay >= 0 so that every decay exp(dt'*A) is <= 1)"
        )
    return lo, hi


def check_inputs(
    x=None,
    dt=None,
    A=None,
    B=None,
    C=None,
    *,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    dt_out=None,
    dA_cumsum=None,
    states=None,
    prev_states=None,
    chunk_size=None,
    dt_limit=None,
):
    """Validate the arguments of any public function here and convert them to float64.

    Checks, in order: dtypes (real numbers; integers for seq_idx), shapes
    (``check_shapes``), values (finite; A <= 0; seq_idx >= 0 and non-decreasing, the
    subset of mamba_ssm's seq_idx on which the two agree, see the module docstring;
    0 <= dt_limit lo <= hi). Every error message starts with the argument's name.

    Returns:
        (arrays, dims): ``arrays`` maps each given argument name to a float64 array
        (int64 for seq_idx); ``dims`` is the dict of sizes from ``check_shapes``.
    """
    given = {
        "x": x, "dt": dt, "A": A, "B": B, "C": C, "D": D, "z": z, "dt_bias": dt_bias,
        "initial_states": initial_states, "seq_idx": seq_idx, "dt_out": dt_out,
        "dA_cumsum": dA_cumsum, "states": states, "prev_states": prev_states,
    }
    arrays = {
        name: _as_array(name, value, integer=(name == "seq_idx"))
        for name, value in given.items()
        if value is not None
    }
    dims = check_shapes(chunk_size=chunk_size, **{k: v.shape for k, v in arrays.items()})

    for name, arr in arrays.items():
        bad = ~np.isfinite(arr)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name}: contains NaN or inf (first at index {where}); "
                             "inputs must be finite")
    if "A" in arrays and (arrays["A"] > 0).any():
        i = int(np.argmax(arrays["A"]))
        raise ValueError(
            f"A: must be <= 0 so that the decay exp(dt*A) is <= 1; got A[{i}] = "
            f"{arrays['A'][i]:g}"
        )
    if "seq_idx" in arrays:
        s = arrays["seq_idx"]
        if (s < 0).any():
            where = tuple(int(i) for i in np.argwhere(s < 0)[0])
            raise ValueError(f"seq_idx: must be >= 0, got {s[where]} at index {where}")
        steps = np.diff(s, axis=1)
        if (steps < 0).any():
            bi, t = (int(i) for i in np.argwhere(steps < 0)[0])
            raise ValueError(
                f"seq_idx: must be non-decreasing along the sequence (packed sequences "
                f"are contiguous); seq_idx[{bi}, {t}] = {s[bi, t]} > "
                f"seq_idx[{bi}, {t + 1}] = {s[bi, t + 1]}"
            )
    if dt_limit is not None:
        _check_dt_limit(dt_limit)
    return arrays, dims


def check_varlen_shapes(cu_seqlens_shape, dims, seq_idx_given):
    """The rules on cu_seqlens that shapes decide (shared with ``ssd.api.validate``).

    Args:
        cu_seqlens_shape: the shape tuple of cu_seqlens.
        dims: the sizes ``check_shapes`` returned for the other arguments (b from x).
        seq_idx_given: whether seq_idx was passed.
    Raises:
        ValueError naming cu_seqlens: not (num_sequences + 1,) with at least one sequence,
        a batch other than 1 (the sequences are packed along one row), or no seq_idx (it is
        what resets the state where each sequence starts; cu_seqlens only says where each
        one ends).
    """
    shape = tuple(int(s) for s in cu_seqlens_shape)
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected shape (num_sequences + 1,) with at least one "
                         f"sequence, got {shape}")
    if dims.get("b", 1) != 1:
        raise ValueError(f"cu_seqlens: packs the sequences along one batch row, so x's batch "
                         f"must be 1, got b={dims['b']}")
    if not seq_idx_given:
        raise ValueError("cu_seqlens: needs seq_idx (1, l) alongside, the sequence of each "
                         "position, which resets the state where a sequence starts")


def check_cu_seqlens(cu_seqlens, seqlen, seq_idx=None):
    """The rules on the values of cu_seqlens (and its agreement with seq_idx).

    Args:
        cu_seqlens: (num_sequences + 1,) integer array.
        seqlen: l.
        seq_idx: optional (1, l) or (l,) integer array.
    Returns:
        cu_seqlens as an int64 array.
    Raises:
        TypeError naming cu_seqlens for a non-integer dtype; ValueError naming cu_seqlens
        unless it starts at 0, rises strictly (every sequence has a token) and ends at l, and
        unless seq_idx changes exactly at the offsets in between.
    """
    cu = _as_array("cu_seqlens", cu_seqlens, integer=True)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens: expected shape (num_sequences + 1,) with at least one "
                         f"sequence, got {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens: must start at 0, got cu_seqlens[0] = {cu[0]}")
    steps = np.diff(cu)
    if (steps <= 0).any():
        i = int(np.argmax(steps <= 0))
        raise ValueError(f"cu_seqlens: must be strictly increasing (every sequence has at "
                         f"least one token); cu_seqlens[{i + 1}] = {cu[i + 1]} <= "
                         f"cu_seqlens[{i}] = {cu[i]}")
    if cu[-1] != seqlen:
        raise ValueError(f"cu_seqlens: the last offset must be the sequence length l = "
                         f"{seqlen}, got cu_seqlens[-1] = {cu[-1]}")
    if seq_idx is not None:
        row = np.asarray(seq_idx).reshape(-1)
        changes = np.flatnonzero(row[1:] != row[:-1]) + 1
        if not np.array_equal(changes, cu[1:-1]):
            raise ValueError(f"cu_seqlens: starts sequences at {cu[1:-1].tolist()}, but "
                             f"seq_idx changes at {changes.tolist()}; the two must agree")
    return cu


# --------------------------------------------------------------------------------------
# Small pieces shared by every rung
# --------------------------------------------------------------------------------------


def softplus(v):
    """log(1 + exp(v)), evaluated without overflow (np.logaddexp(0, v))."""
    return np.logaddexp(0.0, v)


def silu(v):
    """v * sigmoid(v); sigmoid(v) = exp(-softplus(-v)) never overflows."""
    return v * np.exp(-softplus(-v))


def prepare_dt(dt, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """The step size the SSM actually uses, dt' (what ``chunk_cumsum`` stores as dt_out).

    Order (as mamba_ssm's chunk_cumsum kernel): add bias -> softplus -> clamp.

    Args:
        dt: (b, l, h) raw step sizes, any real dtype.
        dt_bias: optional (h,), added per head.
        dt_softplus: if True, dt' = softplus(dt') where dt' <= 20 and dt' unchanged
            above 20 (softplus(20) = 20 + 2e-9, so the switch only avoids overflow).
        dt_limit: (lo, hi), 0 <= lo <= hi; dt' = clamp(dt', lo, hi), applied ALWAYS,
            so the default (0, inf) sends a negative dt' to 0.
    Returns:
        dt': (b, l, h) float64, >= 0.
    """
    arrays, _ = check_inputs(dt=dt, dt_bias=dt_bias, dt_limit=dt_limit)
    return _step_size(arrays["dt"], arrays.get("dt_bias"), dt_softplus,  # (b, l, h) + (h,)
                      _check_dt_limit(dt_limit))


def _step_size(dt, dt_bias, dt_softplus, limits):
    """dt' from float64 arrays: dt + dt_bias (broadcast), softplus where <= 20, then the
    clamp to ``limits`` (lo, hi), or none when ``limits`` is None (the decode step's default)."""
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = np.where(dt <= 20.0, softplus(dt), dt)
    return dt if limits is None else np.clip(dt, *limits)


def _heads(a, h):
    """Expand the group axis of B or C to heads: (..., g, n) -> (..., h, n).

    Head i uses group i // (h // g), i.e. each group is repeated h // g times in place.
    """
    return np.repeat(a, h // a.shape[-2], axis=-2)


def _skip_and_gate(y, x, D, z):
    """y + D * x, then * silu(z) -- the last two lines of every rung. y, x: (b, l, h, p)."""
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x  # D: (h,) -> (h, 1), or (h, p)
    if z is not None:
        y = y * silu(z)
    return y


# --------------------------------------------------------------------------------------
# Rung 1: the recurrence
# --------------------------------------------------------------------------------------


def ssd_recurrence(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                   seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
                   return_final_states=False, *, states_out=None):
    """Rung 1: the SSM as a loop over time (vectorised over b, h, p, n).

        h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T      # (p, n) per head
        y_t = h_t C_t + D x_t ;  y_t *= silu(z_t)

    Args:
        x: (b, l, h, p); dt: (b, l, h); A: (h,) <= 0; B, C: (b, l, g, n).
        D: optional (h,) or (h, p). z: optional (b, l, h, p). dt_bias: optional (h,).
        initial_states: optional (b, h, p, n). seq_idx: optional (b, l) integer.
        dt_softplus, dt_limit: see ``prepare_dt``.
        return_final_states: also return h_{l-1}.
        states_out: optional (b, l, h, p, n) array that receives every h_t
            (see ``recurrence_states``).
    Returns:
        y: (b, l, h, p) float64, or (y, final_states (b, h, p, n) float64).
    """
    arrays, _ = check_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_limit=dt_limit,
    )
    x, A = arrays["x"], arrays["A"]
    b, l, h, p = x.shape
    n = arrays["B"].shape[-1]
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    Bh = _heads(arrays["B"], h)  # (b, l, h, n)
    Ch = _heads(arrays["C"], h)  # (b, l, h, n)
    seq = arrays.get("seq_idx")

    state = arrays.get("initial_states", np.zeros((b, h, p, n)))  # h_{-1}: (b, h, p, n)
    prev_seq = np.zeros(b, dtype=np.int64)  # the virtual seq_idx[-1] = 0
    y = np.empty((b, l, h, p))
    for t in range(l):
        if seq is not None:  # a new sequence starts: forget the previous one
            new_seq = seq[:, t] != prev_seq  # (b,)
            state = np.where(new_seq[:, None, None, None], 0.0, state)
            prev_seq = seq[:, t]
        decay = np.exp(dt[:, t] * A)  # (b, h), in (0, 1]
        write = np.einsum("bh,bhp,bhn->bhpn", dt[:, t], x[:, t], Bh[:, t])
        state = decay[:, :, None, None] * state + write  # (b, h, p, n)
        y[:, t] = np.einsum("bhpn,bhn->bhp", state, Ch[:, t])
        if states_out is not None:
            states_out[:, t] = state
    y = _skip_and_gate(y, x, arrays.get("D"), arrays.get("z"))
    return (y, state) if return_final_states else y


def recurrence_step(state, x, dt, A, B, C):
    """One step of the recurrence, the step of ``ssd_recurrence``'s loop with dt' and A per
    channel as well as per head: the decode step's arithmetic (tests/test_decode.py checks that
    decoding a sequence with it gives ``ssd_recurrence``'s outputs and states).

        h_t = exp(dt' A) h_{t-1} + dt' x_t B_t^T      # (p, n) per head
        y_t = h_t C_t                                 # before the D skip and the z gate

    Args (float64 arrays; dt and A broadcast over what they do not vary along):
        state: (b, h, p, n) h_{t-1}.
        x: (b, h, p).
        dt: dt' (already through bias, softplus and clamp), (b, h, p), or (b, h, 1) per head.
        A: (h, p, n), or (h, 1, 1) per head.
        B, C: (b, h, n), each head's group already picked.
    Returns:
        (h_t (b, h, p, n), y_t (b, h, p)).
    """
    decay = np.exp(dt[..., None] * A)  # (b, h, p or 1, n or 1)
    state = decay * state + (dt * x)[..., None] * B[:, :, None, :]  # (b, h, p, n)
    return state, np.einsum("bhpn,bhn->bhp", state, C)


def recurrence_states(x, dt, A, B, C, dt_bias=None, initial_states=None, seq_idx=None,
                      dt_softplus=False, dt_limit=(0.0, INF)):
    """Every state h_t of the recurrence: (b, l, h, p, n) float64.

    For checking intermediates: the chunked path's prev_states[:, c] must equal
    h_{c*q - 1} (and initial_states for c = 0). Memory grows like l * h * p * n.
    """
    x = np.asarray(x)
    states = np.empty(x.shape + (np.shape(B)[-1],))  # (b, l, h, p, n)
    ssd_recurrence(x, dt, A, B, C, dt_bias=dt_bias, initial_states=initial_states,
                   seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit,
                   states_out=states)
    return states


# --------------------------------------------------------------------------------------
# Rung 2: the quadratic (masked attention) form
# --------------------------------------------------------------------------------------


def segsum(x):
    """Segment sums: out[..., t, s] = x[..., s+1] + ... + x[..., t] (s <= t), else -inf.

    Args:
        x: (..., T) per-step log-decays (dt' * A).
    Returns:
        (..., T, T) float64. exp(segsum(x)) is the causal decay mask L of SSD:
        L[t, s] = prod_{k=s+1..t} a_k, with exact zeros above the diagonal.

    Numerical notes:
    * The tempting ``cs[t] - cs[s]`` with cs = cumsum(x) subtracts two large numbers
      when the sequence is long (cs drifts like -t), so short segments lose all their
      digits. Here each column s sums only its own terms x[s+1..t]: zero x on and above
      the diagonal, then cumsum down the columns. No cancellation.
    * Entries above the diagonal are set to -inf, not to a large negative number, and
      the mask is applied BEFORE exp: exp(-inf) = 0 exactly. Multiplying exp(...) by a
      0/1 mask afterwards is wrong, because the unmasked upper entries are -segsum,
      which can be large and positive -> exp overflows to inf, and inf * 0 = NaN.
    """
    x = np.asarray(x, dtype=np.float64)
    T = x.shape[-1]
    xx = np.broadcast_to(x[..., :, None], x.shape + (T,))  # xx[..., t, s] = x[t]
    strictly_lower = np.tril(np.ones((T, T), dtype=bool), k=-1)  # s < t
    xx = np.where(strictly_lower, xx, 0.0)
    out = np.cumsum(xx, axis=-2)  # out[t, s] = sum_{s < k <= t} x[k]
    causal = np.tril(np.ones((T, T), dtype=bool), k=0)  # s <= t
    return np.where(causal, out, -np.inf)


def ssd_quadratic(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None,
                  seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
                  return_final_states=False):
    """Rung 2: the state-space dual -- masked attention with a decay mask, per head.

        L = exp(segsum(dt' A))                     (h, l, l) lower-triangular decays
        M = L o (C B^T)                            the semiseparable "attention" matrix
        y = M (dt' x) + exp(cumsum(dt' A)) C h_{-1}

    With seq_idx, M[t, s] is also zeroed where seq_idx[t] != seq_idx[s], and the initial
    state reaches only positions with seq_idx[t] == 0. Cost O(l^2) per head; the
    recurrence is O(l) but sequential.

    Args / Returns: exactly as ``ssd_recurrence``.
    """
    arrays, _ = check_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, dt_limit=dt_limit,
    )
    x, A = arrays["x"], arrays["A"]
    h = x.shape[2]
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    Bh = _heads(arrays["B"], h)  # (b, l, h, n)
    Ch = _heads(arrays["C"], h)  # (b, l, h, n)
    seq = arrays.get("seq_idx")

    # 1. decay mask L[t, s] = exp(dA_{s+1} + ... + dA_t); -inf (-> 0) above the diagonal
    #    and between different packed sequences, applied before exp (see segsum).
    dA = dt * A  # (b, l, h), <= 0
    log_L = segsum(dA.transpose(0, 2, 1))  # (b, h, l, l)
    if seq is not None:
        same_seq = seq[:, :, None] == seq[:, None, :]  # (b, t, s)
        log_L = np.where(same_seq[:, None], log_L, -np.inf)
    L = np.exp(log_L)  # (b, h, t, s)

    # 2. the attention-like matrix M = L o (C B^T), then y = M (dt' x)
    CB = np.einsum("bthn,bshn->bhts", Ch, Bh)  # (b, h, t, s)
    M = L * CB
    y = np.einsum("bhts,bshp->bthp", M, dt[..., None] * x)  # (b, l, h, p)

    # 3. the final state: the last row of L weights every write dt'_s x_s B_s^T
    final = np.einsum("bhs,bsh,bshp,bshn->bhpn", L[:, :, -1, :], dt, x, Bh, optimize=True)

    # 4. the initial state decays by exp(dA_0 + ... + dA_t) before C_t reads it.
    #    (Every partial sum is <= 0, so this cumsum is safe to exponentiate.)
    if "initial_states" in arrays:
        h0 = arrays["initial_states"]  # (b, h, p, n)
        decay_in = np.exp(np.cumsum(dA, axis=1))  # (b, l, h)
        if seq is not None:  # only the sequence that continues the virtual seq_idx 0
            decay_in = np.where((seq == 0)[:, :, None], decay_in, 0.0)
        y = y + np.einsum("bthn,bhpn,bth->bthp", Ch, h0, decay_in, optimize=True)
        final = final + decay_in[:, -1, :, None, None] * h0

    y = _skip_and_gate(y, x, arrays.get("D"), arrays.get("z"))
    return (y, final) if return_final_states else y


# --------------------------------------------------------------------------------------
# Rung 3: the chunked algorithm, one function per GPU stage
# --------------------------------------------------------------------------------------


def _chunk(a, q, pad_mode="constant"):
    """Split axis 1 (l) into chunks: (b, l, ...) -> (b, c, q, ...).

    The tail is padded to c*q; with zeros by default (a zero x, B, C or dt' contributes
    nothing), or by repeating the last value (pad_mode="edge", used for seq_idx).
    """
    b, l = a.shape[:2]
    c = math.ceil(l / q)
    widths = [(0, 0)] * a.ndim
    widths[1] = (0, c * q - l)
    a = np.pad(a, widths, mode=pad_mode)
    return a.reshape((b, c, q) + a.shape[2:])


def _chunk_last_positions(l, q):
    """Index of the last *valid* position of each chunk: min((ci+1)*q, l) - 1, shape (c,)."""
    c = math.ceil(l / q)
    return np.minimum((np.arange(c) + 1) * q, l) - 1


def _state_keep(seq, l, q):
    """Positions chunk_state keeps: those of the sequence still running at the chunk's end.

    Args:
        seq: (b, l) integer seq_idx. l, q: seqlen and chunk size.
    Returns:
        (b, c, q) bool: seq_idx[s] == seq_idx at the chunk's last valid position.
    """
    seq_c = _chunk(seq, q, pad_mode="edge")  # (b, c, q)
    seq_last = seq[:, _chunk_last_positions(l, q)]  # (b, c)
    return seq_c == seq_last[:, :, None]


def _chunk_carry(seq, l, q):
    """Chunks that continue the sequence the chunk before ended with (a virtual 0 before 0).

    Args:
        seq: (b, l) integer seq_idx. l, q: seqlen and chunk size.
    Returns:
        (b, c) bool; where False, state_passing drops the carried state.
    """
    seq_last = seq[:, _chunk_last_positions(l, q)]  # (b, c)
    seq_before = np.concatenate([np.zeros((seq.shape[0], 1), np.int64), seq_last[:, :-1]],
                                axis=1)
    return seq_last == seq_before


def _scan_masks(seq, q):
    """chunk_scan's masks: the pairs its diagonal block keeps, the positions that read the
    entering state.

    Args:
        seq: (b, l) integer seq_idx, or None. q: chunk size.
    Returns:
        allowed: (q, q) causal mask s <= t, or (b, 1, c, t, s) with same-sequence pairs only.
        enters: None, or (b, c, q) bool: seq_idx[t] == seq_idx[chunk_start - 1] (a virtual
            0 for chunk 0).
    """
    causal = np.tril(np.ones((q, q), dtype=bool))  # (t, s): s <= t
    if seq is None:
        return causal, None
    seq_c = _chunk(seq, q, pad_mode="edge")  # (b, c, q)
    same = seq_c[:, :, :, None] == seq_c[:, :, None, :]  # (b, c, t, s)
    # seq_idx just before each chunk: position ci*q - 1, a virtual 0 for chunk 0.
    before = np.concatenate([np.zeros((seq.shape[0], 1), np.int64), seq_c[:, :-1, -1]], axis=1)
    return causal & same[:, None], seq_c == before[:, :, None]


def chunk_cumsum(dt, A, chunk_size, dt_bias=None, dt_softplus=False, dt_limit=(0.0, INF)):
    """Stage 1: the step sizes dt' and the cumulative log-decay within each chunk.

    Args:
        dt: (b, l, h) raw step sizes.
        A: (h,) <= 0.
        chunk_size: q, positive int; l need not be a multiple of q.
        dt_bias, dt_softplus, dt_limit: see ``prepare_dt``.
    Returns:
        dt_out: (b, h, c, q) float64, dt' per position; 0 on the padded tail.
        dA_cumsum: (b, h, c, q) float64, dA_cumsum[..., t] = sum_{k <= t in chunk}
            dt'_k A_h (natural-log units, <= 0, non-increasing along q). Because the
            padded dt' is 0, it stays flat past l, so dA_cumsum[..., -1] is also the
            value at the chunk's last valid position.
    """
    _check_chunk_size(chunk_size)  # required here (check_inputs treats None as absent)
    arrays, _ = check_inputs(dt=dt, A=A, dt_bias=dt_bias, chunk_size=chunk_size,
                             dt_limit=dt_limit)
    A = arrays["A"]
    # 1. dt' = clamp(softplus(dt + dt_bias)) per position.
    dt = prepare_dt(dt, dt_bias, dt_softplus, dt_limit)  # (b, l, h)
    # 2. zero-pad l to c*q and split into chunks: a step with dt' = 0 neither decays
    #    the state (exp(0) = 1) nor writes to it. Zero AFTER the clamp, so lo > 0 in
    #    dt_limit cannot leak into the padding.
    dt_out = _chunk(dt, chunk_size).transpose(0, 3, 1, 2)  # (b, c, q, h) -> (b, h, c, q)
    # 3. running sum of the log-decay inside each chunk (restarts at every chunk).
    dA_cumsum = np.cumsum(dt_out * A[None, :, None, None], axis=-1)  # (b, h, c, q)
    return dt_out, dA_cumsum


def chunk_state(B, x, dt_out, dA_cumsum, seq_idx=None):
    """Stage 2: the state each chunk would produce on its own (starting from zero).

        states[c] = sum_{s in c} exp(dA_cumsum[last] - dA_cumsum[s]) dt'_s x_s B_s^T

    Args:
        B: (b, l, g, n). x: (b, l, h, p).
        dt_out, dA_cumsum: (b, h, c, q) from ``chunk_cumsum``.
        seq_idx: optional (b, l) integer; positions whose seq_idx differs from that of
            the chunk's last valid position are left out (their sequence has ended
            before the chunk does).
    Returns:
        states: (b, c, h, p, n) float64.
    """
    arrays, dims = check_inputs(x=x, B=B, dt_out=dt_out, dA_cumsum=dA_cumsum,
                                seq_idx=seq_idx)
    x, dt_out, dA_cumsum = arrays["x"], arrays["dt_out"], arrays["dA_cumsum"]
    l, h, q = dims["l"], dims["h"], dims["q"]
    x_c = _chunk(x, q)  # (b, c, q, h, p)
    B_c = _heads(_chunk(arrays["B"], q), h)  # (b, c, q, h, n)

    # 1. decay from each position s to the end of its chunk. Both cumsums live in one
    #    chunk, so the difference is short-range; it is <= 0, so exp cannot overflow.
    decay_to_end = np.exp(dA_cumsum[..., -1:] - dA_cumsum)  # (b, h, c, q)
    weight = decay_to_end * dt_out  # (b, h, c, q); 0 on the padded tail

    # 2. keep only positions of the sequence that is still running at the chunk's end.
    if "seq_idx" in arrays:
        keep = _state_keep(arrays["seq_idx"], l, q)  # (b, c, q)
        weight = np.where(keep[:, None], weight, 0.0)

    # 3. sum of the weighted writes x_s B_s^T over the chunk.
    return np.einsum("bhcs,bcshp,bcshn->bchpn", weight, x_c, B_c, optimize=True)


def state_passing(states, dA_cumsum, initial_states=None, seq_idx=None, chunk_size=None):
    """Stage 3: the state entering each chunk -- the only sequential step, over chunks.

        prev_states[0]   = initial_states (or 0)
        prev_states[c+1] = exp(dA_cumsum[c, last]) * prev_states[c] + states[c]

    Args:
        states: (b, c, h, p, n) from ``chunk_state``.
        dA_cumsum: (b, h, c, q) from ``chunk_cumsum``; only its last column (the decay
            across a whole chunk) is used.
        initial_states: optional (b, h, p, n).
        seq_idx: optional (b, l) integer. The carried state is dropped (the decay factor
            set to 0) when the seq_idx at chunk c's last valid position differs from
            that at chunk c-1's last valid position (a virtual 0 before chunk 0).
        chunk_size: optional, q; defaults to dA_cumsum.shape[-1] and must agree with it.
    Returns:
        prev_states: (b, c, h, p, n) float64, the state entering chunk c (= h_{c*q-1}).
        final_states: (b, h, p, n) float64, the state after the last chunk (= h_{l-1}).
    """
    arrays, dims = check_inputs(states=states, dA_cumsum=dA_cumsum,
                                initial_states=initial_states, seq_idx=seq_idx,
                                chunk_size=chunk_size)
    states = arrays["states"]
    b, c, h, p, n = states.shape
    q = dims["q"]

    # 1. decay across each whole chunk: exp(sum of dA in the chunk) in (0, 1].
    chunk_decay = np.exp(arrays["dA_cumsum"][..., -1])  # (b, h, c)

    # 2. does chunk ci continue the sequence that chunk ci-1 ended with?
    if "seq_idx" in arrays:
        carry = _chunk_carry(arrays["seq_idx"], dims["l"], q)  # (b, c)
        chunk_decay = np.where(carry[:, None, :], chunk_decay, 0.0)

    # 3. the scan over chunks.
    running = arrays.get("initial_states", np.zeros((b, h, p, n)))  # (b, h, p, n)
    prev_states = np.empty_like(states)  # (b, c, h, p, n)
    for ci in range(c):
        prev_states[:, ci] = running
        running = chunk_decay[:, :, ci, None, None] * running + states[:, ci]
    return prev_states, running


def chunk_scan(B, C, x, dt_out, dA_cumsum, prev_states, D=None, z=None, seq_idx=None):
    """Stage 4: the outputs -- diagonal block + off-diagonal term + D skip + z gate.

        y_t = sum_{s<=t in chunk} (C_t . B_s) exp(dA_cumsum[t] - dA_cumsum[s]) dt'_s x_s
              + exp(dA_cumsum[t]) C_t . prev_states[chunk of t]
              + D x_t ;   then y_t *= silu(z_t)

    Args:
        B, C: (b, l, g, n). x: (b, l, h, p).
        dt_out, dA_cumsum: (b, h, c, q) from ``chunk_cumsum``.
        prev_states: (b, c, h, p, n) from ``state_passing``.
        D: optional (h,) or (h, p). z: optional (b, l, h, p).
        seq_idx: optional (b, l) integer. The diagonal block drops pairs (t, s) from
            different sequences; the off-diagonal term is kept only where seq_idx[t] ==
            seq_idx[chunk_start - 1] (a virtual 0 for chunk 0).
    Returns:
        y: (b, l, h, p) float64.
    """
    arrays, dims = check_inputs(x=x, B=B, C=C, D=D, z=z, seq_idx=seq_idx, dt_out=dt_out,
                                dA_cumsum=dA_cumsum, prev_states=prev_states)
    x, dt_out, dA_cs = arrays["x"], arrays["dt_out"], arrays["dA_cumsum"]
    b, l, h, p = x.shape
    q = dims["q"]
    x_c = _chunk(x, q)  # (b, c, q, h, p)
    B_c = _heads(_chunk(arrays["B"], q), h)  # (b, c, q, h, n)
    C_c = _heads(_chunk(arrays["C"], q), h)  # (b, c, q, h, n)
    # (t, s) or (b, 1, c, t, s) pairs kept; None or (b, c, q) positions reading the state
    allowed, enters = _scan_masks(arrays.get("seq_idx"), q)

    # 1. diagonal blocks: causal attention inside each chunk with a decay mask.
    #    The exponent dA_cs[t] - dA_cs[s] is <= 0 for s <= t but >= 0 above the
    #    diagonal; mask it to -inf BEFORE exp so those entries are exactly 0 (masking
    #    after exp could meet inf * 0 = NaN).
    CB = np.einsum("bcthn,bcshn->bhcts", C_c, B_c)  # (b, h, c, t, s)
    log_decay = dA_cs[..., :, None] - dA_cs[..., None, :]  # (b, h, c, t, s)
    L = np.exp(np.where(allowed, log_decay, -np.inf))  # (b, h, c, t, s)
    y_diag = np.einsum("bhcts,bhcs,bcshp->bcthp", CB * L, dt_out, x_c, optimize=True)

    # 2. off-diagonal term: the state entering the chunk, decayed to t, read by C_t.
    decay_in = np.exp(dA_cs)  # (b, h, c, q), in (0, 1]
    if enters is not None:
        decay_in = np.where(enters[:, None], decay_in, 0.0)
    y_off = np.einsum("bcthn,bchpn,bhct->bcthp", C_c, arrays["prev_states"], decay_in,
                      optimize=True)

    # 3. un-chunk, drop the padded tail, then the D skip and the z gate.
    y = (y_diag + y_off).reshape(b, -1, h, p)[:, :l]  # (b, l, h, p)
    return _skip_and_gate(y, x, arrays.get("D"), arrays.get("z"))


def chunk_state_varlen(B, x, dt_out, dA_cumsum, prev_states, cu_seqlens, seq_idx):
    """The final state of every packed sequence, from the chunk where it ends alone.

    For sequence i with last position e = cu_seqlens[i + 1] - 1 in chunk c = e // q, at
    k = e - c q in it::

        varlen_states[i] = exp(dA_cumsum[c, k]) prev_states[c]      (if it ran into chunk c)
                         + sum_{s in c, s >= cu_seqlens[i], s <= e}
                               exp(dA_cumsum[c, k] - dA_cumsum[c, s]) dt'_s x_s B_s^T

    The entering state counts where the sequence is the one running before the chunk: where
    seq_idx before the chunk (a virtual 0 before chunk 0, as in ``chunk_scan``) is its own.
    prev_states[c] is then h_{cq-1} of that sequence (the initial state's part included, for a
    first sequence of id 0); otherwise the sequence began inside the chunk.

    Args:
        B: (1, l, g, n). x: (1, l, h, p).
        dt_out, dA_cumsum: (1, h, c, q) from ``chunk_cumsum``.
        prev_states: (1, c, h, p, n) from ``state_passing``.
        cu_seqlens: (num_sequences + 1,) integer offsets (see ``check_cu_seqlens``).
        seq_idx: (1, l) integer, changing exactly at the offsets.
    Returns:
        varlen_states: (num_sequences, h, p, n) float64.
    """
    arrays, dims = check_inputs(x=x, B=B, dt_out=dt_out, dA_cumsum=dA_cumsum,
                                prev_states=prev_states, seq_idx=seq_idx)
    check_varlen_shapes(np.shape(cu_seqlens), dims, seq_idx is not None)
    cu = check_cu_seqlens(cu_seqlens, dims["l"], arrays["seq_idx"])
    h, p, n, q = dims["h"], dims["p"], dims["n"], dims["q"]
    x, dt_out, dA_cs = arrays["x"][0], arrays["dt_out"][0], arrays["dA_cumsum"][0]
    B_h = _heads(arrays["B"], h)[0]  # (l, h, n)
    seq = arrays["seq_idx"][0]  # (l,)
    prev = arrays["prev_states"][0]  # (c, h, p, n)
    out = np.empty((len(cu) - 1, h, p, n))
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        last = end - 1
        c, k = divmod(int(last), q)
        # 1. the state entering chunk c, decayed to the last token, where the sequence ran
        #    into the chunk (seq_idx just before it is its own; a virtual 0 before chunk 0).
        before = seq[c * q - 1] if c > 0 else 0
        runs_in = seq[last] == before
        enter = np.exp(dA_cs[:, c, k])[:, None, None] * prev[c] if runs_in else 0.0  # (h, p, n)
        # 2. the chunk's own writes, from the sequence's first token in the chunk to its last.
        pos = np.arange(max(int(start), c * q), int(end))  # (m,) positions in l
        j = pos - c * q  # (m,) positions in the chunk
        weight = np.exp(dA_cs[:, c, k, None] - dA_cs[:, c, j]) * dt_out[:, c, j]  # (h, m), <= dt'
        out[i] = enter + np.einsum("hm,mhp,mhn->hpn", weight, x[pos], B_h[pos], optimize=True)
    return out


def ssd_chunked(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                dt_limit=(0.0, INF), return_final_states=False, return_varlen_states=False):
    """Rung 3: the chunked SSD algorithm = the four stages in order.

    Same arguments and return convention as mamba_ssm's ``mamba_chunk_scan_combined``
    (forward): y (b, l, h, p), or (y, final_states (b, h, p, n)) when
    return_final_states; with return_varlen_states also varlen_states (num_sequences, h,
    p, n) last: (y, varlen_states) or (y, final_states, varlen_states). cu_seqlens is read
    only then (as mamba_ssm), and needs a batch of 1 and seq_idx (see
    ``check_varlen_shapes``, ``chunk_state_varlen``). All float64. l need not be a
    multiple of chunk_size: the tail chunk is zero-padded internally (dt' = 0 there) and
    the padded outputs are dropped.
    """
    _check_chunk_size(chunk_size)
    _, dims = check_inputs(
        x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
        seq_idx=seq_idx, chunk_size=chunk_size, dt_limit=dt_limit,
    )  # validate everything up front, so errors name the caller's arguments
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states: needs cu_seqlens, the offsets of the "
                             "packed sequences")
        check_varlen_shapes(np.shape(cu_seqlens), dims, seq_idx is not None)
        check_cu_seqlens(cu_seqlens, dims["l"], seq_idx)
    # 1. step sizes and the cumulative log-decay inside each chunk
    dt_out, dA_cumsum = chunk_cumsum(dt, A, chunk_size, dt_bias, dt_softplus, dt_limit)
    # 2. what each chunk writes into the state, on its own
    states = chunk_state(B, x, dt_out, dA_cumsum, seq_idx)
    # 3. carry the state across chunks (sequential over c)
    prev_states, final_states = state_passing(states, dA_cumsum, initial_states, seq_idx,
                                              chunk_size)
    # 4. outputs: intra-chunk attention + inter-chunk state + D skip + z gate
    y = chunk_scan(B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx)
    out = (y, final_states) if return_final_states else (y,)
    if return_varlen_states:
        # 5. each packed sequence's final state, from the chunk where it ends
        out += (chunk_state_varlen(B, x, dt_out, dA_cumsum, prev_states, cu_seqlens, seq_idx),)
    return out if len(out) > 1 else y


# --------------------------------------------------------------------------------------
# The decode step: one token through the recurrence, the state kept between calls
# --------------------------------------------------------------------------------------

#: The decode step's arguments (mamba_ssm's ``selective_state_update`` with heads), one
#: letter per axis; "|" separates the forms an argument may take, told apart by rank (the
#: shorter one is per head). ``s``: the rows of a paged state cache, which replace b in
#: ``state`` when state_batch_indices is given.
STEP_LAYOUTS = {
    "x": "bhp",
    "dt": "bhp|bh",
    "A": "hpn|h",
    "B": "bgn",
    "C": "bgn",
    "D": "hp|h",
    "z": "bhp",
    "dt_bias": "hp|h",
    "state": "bhpn",  # last: the state must fit the token's inputs
    "state_batch_indices": "b",
}


def check_step_shapes(**shapes):
    """Check the decode step's shapes against each other; return the sizes they imply.

    Like ``check_shapes``, on plain tuples (the torch side shares it). With
    ``state_batch_indices`` the state's first axis is the cache's rows, s, not b.

    Returns:
        dict letter -> size (b, h, p, n, g, and s with state_batch_indices).
    Raises:
        ValueError (TypeError for an unknown argument) whose message starts with the
        argument's name.
    """
    unknown = sorted(set(shapes) - set(STEP_LAYOUTS))
    if unknown:
        raise TypeError(f"check_step_shapes: unknown argument(s) {unknown}")
    known = {}
    for name, layouts in STEP_LAYOUTS.items():
        shape = shapes.get(name)
        if shape is None:
            continue
        shape = tuple(int(s) for s in shape)
        options = layouts.split("|")
        if name == "state" and shapes.get("state_batch_indices") is not None:
            options = ["shpn"]
        if name == "state" and len(shape) == 3:
            raise ValueError(
                f"state: expected shape {_describe(options[0], known)}, got {shape}; "
                "mamba_ssm's head-less form (batch, dim, dstate) is not supported: give "
                "every argument a head axis of 1 (state.unsqueeze(1), x.unsqueeze(1), ...)")
        layout = next((o for o in options if len(o) == len(shape)), None)
        if layout is None:
            forms = " or ".join(_describe(o, known) for o in options)
            raise ValueError(f"{name}: expected shape {forms}, got {shape}")
        _match_layout(name, shape, layout, known)
    _check_groups(known)
    return {d: size for d, (size, _) in known.items()}


class StepOperands(NamedTuple):
    """The decode step's arguments in float64, each in its one full form (views where a
    per-head form is broadcast)."""

    state: np.ndarray  # (b, h, p, n) the state row each batch entry reads; 0 where padded
    x: np.ndarray  # (b, h, p)
    v: np.ndarray  # (b, h, p) dt + dt_bias, before softplus and clamp
    dt: np.ndarray  # (b, h, p) dt', after bias, softplus and clamp
    A: np.ndarray  # (h, p, n)
    B: np.ndarray  # (b, h, n) each head's group
    C: np.ndarray  # (b, h, n)
    D: np.ndarray | None  # (h, p)
    z: np.ndarray | None  # (b, h, p)
    rows: np.ndarray  # (b,) int64: the state row of each batch entry, -1 where padded


def step_operands(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                  state_batch_indices=None, dt_limit=None):
    """Validate the decode step's arguments and bring each to one form: (StepOperands, dims).

    Checks dtypes (real numbers; integers for state_batch_indices), shapes
    (``check_step_shapes``), finite values, dt_limit (None, or 0 <= lo <= hi) and the cache
    rows (below s; a negative one is padding; no row named twice, or two tokens would
    advance one state). A may be positive and dt' negative: the step is the recurrence
    whatever their signs (mamba_ssm checks neither).
    """
    given = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    arrays = {k: _as_array(k, v) for k, v in given.items() if v is not None}
    rows = None
    if state_batch_indices is not None:
        rows = _as_array("state_batch_indices", state_batch_indices, integer=True)
    dims = check_step_shapes(**{k: v.shape for k, v in arrays.items()},
                             state_batch_indices=None if rows is None else rows.shape)
    for name, arr in arrays.items():
        if not np.isfinite(arr).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
            raise ValueError(f"{name}: contains NaN or inf (first at index {where}); "
                             "inputs must be finite")
    limits = None if dt_limit is None else _check_dt_limit(dt_limit)
    b, h, p, n = dims["b"], dims["h"], dims["p"], dims["n"]
    if rows is None:
        rows = np.arange(b)
    else:
        if (rows >= dims["s"]).any():
            i = int(np.argmax(rows))
            raise ValueError(f"state_batch_indices: row {rows[i]} at index {i} is past the "
                             f"state's {dims['s']} rows")
        used = rows[rows >= 0]
        if len(np.unique(used)) < len(used):
            raise ValueError("state_batch_indices: a state row is named twice; each batch "
                             "entry must own its row (negative entries are padding)")
        rows = np.where(rows < 0, -1, rows)
    per_head = lambda a, full: a.reshape(a.shape + (1,) * (len(full) - a.ndim))  # noqa: E731
    dt_in = per_head(arrays["dt"], (b, h, p))  # (b, h, p) or (b, h, 1)
    bias = arrays.get("dt_bias")
    bias = None if bias is None else per_head(bias, (h, p))  # (h, p) or (h, 1)
    v = np.broadcast_to(_step_size(dt_in, bias, False, None), (b, h, p))
    dt_out = np.broadcast_to(_step_size(dt_in, bias, dt_softplus, limits), (b, h, p))
    A_full = np.broadcast_to(per_head(arrays["A"], (h, p, n)), (h, p, n))
    D_full = None if D is None else np.broadcast_to(per_head(arrays["D"], (h, p)), (h, p))
    padded = rows < 0
    read = np.where(padded[:, None, None, None], 0.0, arrays["state"][np.maximum(rows, 0)])
    return StepOperands(state=read, x=arrays["x"], v=v, dt=dt_out, A=A_full,
                        B=_heads(arrays["B"], h), C=_heads(arrays["C"], h), D=D_full,
                        z=arrays.get("z"), rows=rows), dims


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, dt_limit=None):
    """The decode step in float64: one token per batch entry through ``recurrence_step``.

    The semantics of mamba_ssm's Triton ``selective_state_update`` (with heads):

        dt' = dt + dt_bias; softplus(dt') where dt' <= 20 if dt_softplus; no clamp
              unless dt_limit = (lo, hi) is given (the forward's clamp)
        h   = exp(dt' A) h + dt' x B^T ;   y = h C + D x ;   y *= silu(z) if z is given

    Args:
        state: (b, h, p, n), or (s, h, p, n) with state_batch_indices; not modified here.
        x: (b, h, p). dt: (b, h, p), or (b, h) per head. A: (h, p, n), or (h,) per head.
        B, C: (b, g, n), h % g == 0. D, dt_bias: optional (h, p), or (h,) per head.
        z: optional (b, h, p). dt_softplus: as above.
        state_batch_indices: optional (b,) int, the state row each batch entry reads and
            writes; a negative entry is padding (y = 0 there, no state row touched).
        dt_limit: optional (lo, hi), 0 <= lo <= hi.
    Returns:
        y (b, h, p) float64, and the state after the step, float64: a copy of ``state`` with
        the rows the batch names advanced (the kernel updates them in place).
    """
    ops, _ = step_operands(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                           dt_softplus=dt_softplus, state_batch_indices=state_batch_indices,
                           dt_limit=dt_limit)
    advanced, y = recurrence_step(ops.state, ops.x, ops.dt, ops.A, ops.B, ops.C)
    y = _skip_and_gate(y, ops.x, ops.D, ops.z)
    live = ops.rows >= 0
    y[~live] = 0.0
    new_state = np.array(state, dtype=np.float64)
    new_state[ops.rows[live]] = advanced[live]
    return y, new_state
