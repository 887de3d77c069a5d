"""Tables and figures of the backward chapter (``notebooks/13``), all on the CPU, float64.

* What the backward receives and returns: :func:`gradient_table`.
* The adjoint of the recurrence: :func:`impulse_gradient` and :func:`plot_impulse_gradient`
  (a gradient flows backwards in time with the forward's decays), and
  :func:`finite_difference_table` (every element of every input against central differences).
* dt's path: :func:`dt_path_table` (the slope at the clamp's edges against one-sided and
  central differences).
* The chunked backward: :func:`stage_check_table` (each stage's backward against finite
  differences of its forward, the four composed against the recurrence's adjoint) and
  :func:`plot_gradient_blocks` (the gradient's matrix is the forward's, transposed).
* Save or recompute: :func:`intermediates_table` (one shape, every intermediate) and
  :func:`save_or_recompute` (the entering states across shapes and chunk sizes).
* The kernels: :func:`kernel_table` (each cuTile launch of the backward: its grid, what it
  writes and reads, from a captured launch and the kernel's own signature) and
  :func:`contract_table` (the PyTorch stages the kernels are tested against, against the NumPy
  ladder).

The loss behind every check is the linear one, <dy, y> + <dfinal_states, final_states>: its
gradient with respect to the outputs is (dy, dfinal_states) exactly, so its finite differences
test the backward and nothing else.
"""
from __future__ import annotations

import math
import re

import numpy as np

from .. import reference as R
from .. import reference_backward as RB
from ..cost import ssd_costs
from ..problem import EDGE_SHAPES
from .derivation import STAGE_COLOURS
from .tables import Table

__all__ = [
    "relative_error", "linear_loss", "gradient_table", "impulse_gradient",
    "plot_impulse_gradient", "finite_difference_table", "dt_path_table", "kink_gap",
    "directional_error", "stage_check_table", "plot_gradient_blocks", "intermediates_table",
    "save_or_recompute", "kernel_table", "contract_table",
]


def relative_error(actual, expected) -> float:
    """||actual - expected|| / ||expected|| (Frobenius; the plain norm if expected is 0)."""
    norm = np.linalg.norm(expected)
    return float(np.linalg.norm(np.asarray(actual) - expected) / (norm if norm > 0 else 1.0))


def _flags(spec) -> dict:
    return dict(dt_softplus=spec.dt_softplus, dt_limit=spec.dt_limit)


def _shape(a) -> str:
    return "(" + ", ".join(str(s) for s in np.shape(a)) + ")"


def linear_loss(spec, inputs, grads) -> float:
    """<dy, y> + <dfinal_states, final_states> of the recurrence: the loss whose gradient
    with respect to (y, final_states) is (grads["dy"], grads["dfinal_states"])."""
    y, final = R.ssd_recurrence(**inputs, **_flags(spec), return_final_states=True)
    return float((grads["dy"] * y).sum() + (grads["dfinal_states"] * final).sum())


# ---------------------------------------------------------------------------------------------
# The loss's side


def gradient_table(spec, seed=0) -> Table:
    """What the backward receives (the upstream gradients) and returns (one gradient per
    float input, in that input's shape), from ``ssd_chunked_backward`` on ``spec``."""
    inputs, grads = spec.make_inputs(seed), spec.make_output_grads(seed)
    got = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                  dfinal_states=grads["dfinal_states"])
    rows = [dict(tensor=f"`{k}`", role="receives, from the loss", shape=_shape(v),
                 layout=("b, l, h, p" if k == "dy" else "b, h, p, n")) for k, v in grads.items()]
    for key, grad in got.items():
        name = key[1:]
        layout = "h" if name == "D" and np.ndim(grad) == 1 else R.LAYOUTS[name].split("|")[-1]
        rows.append(dict(tensor=f"`{key}`", role=f"returns, the gradient of `{name}`",
                         shape=_shape(grad), layout=", ".join(layout)))
    if "seq_idx" in inputs:
        rows.append(dict(tensor="`seq_idx`", role="none: integer, not differentiable",
                         shape=_shape(inputs["seq_idx"]), layout="b, l"))
    return Table(rows)


# ---------------------------------------------------------------------------------------------
# The adjoint of the recurrence


def impulse_gradient(A_values, step=0.05, length=120) -> dict:
    """The forward's impulse response beside the backward's, one head per decay rate.

    P = N = 1, B = C = 1 and a constant step ``step``. Forward: x is an impulse at t = 0, and
    y_t = step exp(step A t). Backward: dy is an impulse at the last position T = length - 1,
    and ``ssd_recurrence_backward`` returns dx_s = step exp(step A (T - s)) for s <= T: the
    same curve read backwards in time.

    Returns:
        dict with t (l,), y (l, h) and dx (l, h).
    """
    A = np.asarray(A_values, dtype=np.float64)
    h = len(A)
    x = np.zeros((1, length, h, 1))  # (b, l, h, p)
    x[:, 0] = 1.0
    dt = np.full((1, length, h), step)  # (b, l, h)
    ones = np.ones((1, length, 1, 1))  # B and C: (b, l, g, n)
    y = R.ssd_recurrence(x, dt, A, ones, ones)[0, :, :, 0]  # (l, h)
    dy = np.zeros((1, length, h, 1))
    dy[:, -1] = 1.0
    dx = RB.ssd_recurrence_backward(dy, x, dt, A, ones, ones)["dx"][0, :, :, 0]  # (l, h)
    return dict(t=np.arange(length), y=y, dx=dx, A=A, step=step)


def plot_impulse_gradient(result):
    """Left: y_t after an impulse in x at t = 0. Right: dx_s after an impulse in dy at the
    last position. Both over step, on a log scale (``impulse_gradient``'s dict)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 2.9), dpi=90)
    ax0, ax1 = fig.subplots(1, 2, sharey=True)
    t, step = result["t"], result["step"]
    for k, A in enumerate(result["A"]):
        ax0.semilogy(t, result["y"][:, k] / step, label=f"A = {A:g}")
        ax1.semilogy(t, result["dx"][:, k] / step, label=f"A = {A:g}")
    ax0.set(title="forward: impulse in $x_0$", xlabel="position t", ylabel="$y_t / \\Delta$",
            ylim=(1e-6, 2))
    ax1.set(title=f"backward: impulse in dy at t = {t[-1]}", xlabel="position s",
            ylabel="$dx_s / \\Delta$")
    ax1.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def finite_difference_table(spec, inputs, grads, eps=1e-6) -> Table:
    """Every element of every float input: the recurrence's adjoint against the central
    difference of :func:`linear_loss`, with step eps max(1, |value|).

    One row per input: its shape, its element count, the largest gradient (in absolute value),
    the largest absolute difference and that over the largest gradient ("relative"). Use a
    tiny ``spec``: each element costs two runs of the recurrence. No element may lie within a
    step of a kink of the dt transform (:func:`kink_gap`), where a central difference sees
    half a slope.
    """
    gap = kink_gap(spec, inputs)
    if gap.min() <= 2 * eps * max(1.0, float(np.abs(inputs["dt"]).max())):
        raise ValueError("inputs: a dt lies within a step of a kink of the dt transform")
    adjoint = RB.ssd_recurrence_backward(grads["dy"], **inputs, **_flags(spec),
                                         dfinal_states=grads["dfinal_states"])
    rows = []
    for key in (k for k in inputs if k != "seq_idx"):
        value, numeric = inputs[key], np.empty_like(inputs[key])
        for i in np.ndindex(value.shape):
            step = eps * max(1.0, abs(value[i]))
            moved = [value.copy(), value.copy()]
            moved[0][i] += step
            moved[1][i] -= step
            plus, minus = (linear_loss(spec, {**inputs, key: m}, grads) for m in moved)
            numeric[i] = (plus - minus) / (2 * step)
        err = float(np.abs(adjoint["d" + key] - numeric).max())
        largest = float(np.abs(numeric).max())
        rows.append(dict(input=f"`{key}`", shape=_shape(value), elements=int(value.size),
                         largest=largest, abs_err=err,
                         rel_err=err / largest if largest > 0 else err))
    return Table(rows, formats=dict(largest=".3g", abs_err=".1e", rel_err=".1e"),
                 labels=dict(largest="max |gradient|", abs_err="max |difference|",
                             rel_err="relative"))


# ---------------------------------------------------------------------------------------------
# dt's path


def dt_path_table(points, dt_limit, eps=1e-7) -> Table:
    """The slope d dt' / d dt that ``prepare_dt_backward`` passes, at chosen points, against
    finite differences from below, from above and centred (step ``eps``).

    Args:
        points: list of (label, dt, dt_softplus); no bias.
        dt_limit: (lo, hi) of the clamp.
    Returns:
        one row a point: label, dt, the value before the clamp, dt', the backward's slope and
        the three differences. At a clamp edge the one-sided differences disagree and the
        central one takes their mean: the backward's value there is a convention.
    """
    rows = []
    for label, dt, softplus in points:
        def f(v, softplus=softplus):
            return float(R.prepare_dt(np.full((1, 1, 1), v), None, softplus, dt_limit)[0, 0, 0])

        before = float(R.softplus(dt)) if softplus and dt <= 20 else dt
        slope = float(RB.prepare_dt_backward(np.ones((1, 1, 1)), np.full((1, 1, 1), dt), None,
                                             softplus, dt_limit)["ddt"][0, 0, 0])
        rows.append(dict(point=label, softplus="yes" if softplus else "no", dt=dt,
                         before=before, dt_prime=f(dt), slope=slope,
                         below=(f(dt) - f(dt - eps)) / eps, above=(f(dt + eps) - f(dt)) / eps,
                         central=(f(dt + eps) - f(dt - eps)) / (2 * eps)))
    return Table(rows, formats=dict(dt=".4g", before=".4g", dt_prime=".4g", slope=".4f",
                                    below=".4f", above=".4f", central=".4f"),
                 labels=dict(before="before clamp", dt_prime="dt'", slope="backward",
                             below="FD below", above="FD above", central="FD central"))


def kink_gap(spec, inputs):
    """(b, l, h): how far dt + dt_bias lies from a kink of the dt transform (the clamp's
    edges, and softplus's switch to the identity at 20)."""
    u = inputs["dt"] + inputs.get("dt_bias", 0.0)
    s = np.where(u <= 20, R.softplus(u), u) if spec.dt_softplus else u
    lo, hi = spec.dt_limit
    gap = np.minimum(np.abs(s - lo), np.abs(s - hi) if np.isfinite(hi) else np.inf)
    return np.minimum(gap, np.abs(u - 20)) if spec.dt_softplus else gap


# ---------------------------------------------------------------------------------------------
# The chunked backward, stage by stage


def directional_error(loss, args, grad, name, rng, eps=1e-6, free=None) -> float:
    """The backward's gradient of args[name] along a random direction v against the central
    difference of ``loss`` along v.

    The difference |FD - <grad, v>| is taken relative to the larger of |FD| and
    ||grad|| rms(v), the size of a derivative along a random direction (round-off in the
    difference is absolute, so a derivative that happens to be small must not inflate it).
    ``free``: a 0/1 mask (broadcast to the argument) that keeps v off elements next to a kink.
    """
    value = np.asarray(args[name], dtype=np.float64)
    v = rng.uniform(-1.0, 1.0, value.shape) * (1.0 if free is None else free)
    step = eps * max(1.0, float(np.abs(value).max()))
    numeric = (loss({**args, name: value + step * v})
               - loss({**args, name: value - step * v})) / (2 * step)
    analytic = float((grad * v).sum())
    scale = max(abs(numeric), float(np.linalg.norm(grad) * np.sqrt(np.mean(v ** 2))))
    return abs(numeric - analytic) / scale if scale > 0 else abs(numeric - analytic)


def _stage_error(forward, backward, args, upstream, keys, rng, free=None) -> float:
    """The largest :func:`directional_error` over ``keys`` of one stage: loss =
    <upstream, forward(args)> (each output against its upstream gradient)."""
    def loss(kw):
        out = forward(**kw)
        out = out if isinstance(out, tuple) else (out,)
        return float(sum((u * o).sum() for u, o in zip(upstream, out)))

    grads = backward(args)
    return max(directional_error(loss, args, grads["d" + k], k, rng,
                                 free=(free or {}).get(k)) for k in keys)


def stage_check_table(names, seed=0) -> Table:
    """Per named edge shape (``ssd.problem.EDGE_SHAPES``): each stage's backward against
    finite differences of its forward (the largest :func:`directional_error` over the arrays
    it differentiates, random upstream gradients), and the four composed
    (``ssd_chunked_backward``) against the recurrence's adjoint (the largest
    :func:`relative_error` over every gradient)."""
    rows = []
    for name in names:
        spec = EDGE_SHAPES[name]
        inputs, grads = spec.make_inputs(seed), spec.make_output_grads(seed)
        ref = spec.reference(inputs)
        rng = np.random.default_rng(seed)
        get = inputs.get
        row = dict(shape=f"`{name}`", l=spec.seqlen, q=spec.chunk_size,
                   seq_idx="yes" if spec.seq_boundaries else "no")

        args = dict(B=inputs["B"], C=inputs["C"], x=inputs["x"], dt_out=ref["dt_out"],
                    dA_cumsum=ref["dA_cumsum"], prev_states=ref["prev_states"], D=get("D"),
                    z=get("z"), seq_idx=get("seq_idx"))
        up = (rng.standard_normal(ref["y"].shape),)
        keys = [k for k in ("B", "C", "x", "dt_out", "dA_cumsum", "prev_states", "D", "z")
                if args[k] is not None]
        row["chunk_scan"] = _stage_error(R.chunk_scan, lambda a: RB.chunk_scan_backward(*up, **a),
                                         args, up, keys, rng)

        args = dict(states=ref["states"], dA_cumsum=ref["dA_cumsum"],
                    initial_states=get("initial_states"), seq_idx=get("seq_idx"),
                    chunk_size=spec.chunk_size)
        up_sp = (rng.standard_normal(ref["prev_states"].shape),
                 rng.standard_normal(ref["final_states"].shape))
        keys = ["states", "dA_cumsum"] + (["initial_states"] if spec.initial_states else [])
        row["state_passing"] = _stage_error(
            R.state_passing,
            lambda a: RB.state_passing_backward(up_sp[0], **a, dfinal_states=up_sp[1]),
            args, up_sp, keys, rng)

        args = dict(B=inputs["B"], x=inputs["x"], dt_out=ref["dt_out"],
                    dA_cumsum=ref["dA_cumsum"], seq_idx=get("seq_idx"))
        up_cs = (rng.standard_normal(ref["states"].shape),)
        row["chunk_state"] = _stage_error(
            R.chunk_state, lambda a: RB.chunk_state_backward(*up_cs, **a), args, up_cs,
            ["B", "x", "dt_out", "dA_cumsum"], rng)

        args = dict(dt=inputs["dt"], A=inputs["A"], chunk_size=spec.chunk_size,
                    dt_bias=get("dt_bias"), **_flags(spec))
        up_cc = (rng.standard_normal(ref["dt_out"].shape),
                 rng.standard_normal(ref["dA_cumsum"].shape))
        free = kink_gap(spec, inputs) > 2e-6 * max(1.0, float(np.abs(inputs["dt"]).max()))
        keys = [k for k in ("dt", "A", "dt_bias") if args[k] is not None]
        row["chunk_cumsum"] = _stage_error(
            R.chunk_cumsum, lambda a: RB.chunk_cumsum_backward(*up_cc, **a), args, up_cc, keys,
            rng, free=dict(dt=free, dt_bias=free.all(axis=(0, 1))))

        want = RB.ssd_recurrence_backward(grads["dy"], **inputs, **_flags(spec),
                                          dfinal_states=grads["dfinal_states"])
        got = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                      dfinal_states=grads["dfinal_states"])
        row["composed"] = max(relative_error(got[k], want[k]) for k in want)
        rows.append(row)
    stages = ("chunk_scan", "state_passing", "chunk_state", "chunk_cumsum")
    return Table(rows, formats={k: ".1e" for k in (*stages, "composed")},
                 labels={**{k: f"`{k}`" for k in stages}, "seq_idx": "`seq_idx`",
                         "composed": "all four vs recurrence"})


def plot_gradient_blocks(M, chunk_size):
    """The matrix of one head in the forward (M, lower triangular) and in the backward (M^T,
    upper triangular), its blocks coloured by the stage that computes them in each pass.

    An off-diagonal block carries three stripes, its three factors from left to right: in
    the forward the C side (chunk_scan), the carry (state_passing), the B side (chunk_state);
    in the backward, transposed, the B side (chunk_state's backward), the carry (state_passing's
    backward), the C side (chunk_scan's backward).

    Args:
        M: (l, l) the matrix of one head, l a multiple of ``chunk_size``.
    Returns:
        a matplotlib Figure.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Polygon, Rectangle

    q, c = chunk_size, len(M) // chunk_size
    forward = ("chunk_scan (off-diagonal term)", "state_passing", "chunk_state")
    fig = Figure(figsize=(7.5, 3.9), dpi=90)
    axes = fig.subplots(1, 2)
    with np.errstate(divide="ignore"):
        texture = np.log10(np.abs(M))
    texture[np.triu_indices(len(M), 1)] = np.nan  # transparent above the diagonal
    for ax, transposed in zip(axes, (False, True)):
        stripes = forward[::-1] if transposed else forward
        for i in range(c):
            x0 = i * q - .5
            corner = (x0 + q, x0) if transposed else (x0, x0 + q)  # upper or lower triangle
            ax.add_patch(Polygon([(x0, x0), corner, (x0 + q, x0 + q)], closed=True,
                                 fc=STAGE_COLOURS["chunk_scan"], alpha=0.55, ec="none"))
            for j in range(i):
                row, col = (j, i) if transposed else (i, j)
                for k, stage in enumerate(stripes):
                    ax.add_patch(Rectangle((col * q - .5 + k * q / 3, row * q - .5), q / 3, q,
                                           fc=STAGE_COLOURS[stage], alpha=0.55, ec="none"))
                ax.add_patch(Rectangle((col * q - .5, row * q - .5), q, q, fill=False,
                                       ec="0.3", lw=0.5))
        ax.imshow(texture.T if transposed else texture, cmap="Greys", vmin=-6, vmax=1,
                  alpha=0.35, interpolation="nearest")
        ticks = [k * q for k in range(c)]
        ax.set(xticks=ticks, yticks=ticks, xlim=(-.5, c * q - .5), ylim=(c * q - .5, -.5))
    axes[0].set(title="forward: $y = M\\,(\\Delta \\odot x)$", xlabel="source s (x)",
                ylabel="target t (y)")
    axes[1].set(title="backward: $\\Delta \\odot M^\\top \\mathrm{dy}$",
                xlabel="source t (dy)", ylabel="target s (dx)")
    legend = [Patch(fc=STAGE_COLOURS["chunk_scan"], alpha=0.7,
                    label="chunk_scan: diagonal blocks"),
              Patch(fc=STAGE_COLOURS[forward[0]], alpha=0.7,
                    label="chunk_scan: read the state / write its gradient ($C$)"),
              Patch(fc=STAGE_COLOURS[forward[1]], alpha=0.7,
                    label="state_passing: carry forwards / backwards ($\\gamma$)"),
              Patch(fc=STAGE_COLOURS[forward[2]], alpha=0.7,
                    label="chunk_state: write the state / read its gradient ($B$)")]
    fig.legend(handles=legend, loc="lower center", ncol=2, fontsize=7.5, frameon=False)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------------
# Save or recompute


def _recompute_floor_us(flops, moved, bandwidth, rate):
    return 1e6 * max(moved / bandwidth, flops / rate)


def intermediates_table(spec, chunk_size=None, dtype_bytes=2, bandwidth=None,
                        rate=None) -> Table:
    """Every forward intermediate the backward reads, at one shape: what keeping it from the
    forward to the backward costs in memory, against what rebuilding it costs.

    Counting as ``ssd.cost.ssd_costs`` (compulsory traffic, a multiply-add is 2 FLOPs), inputs
    and the output in ``dtype_bytes``, dt_out, dA_cumsum, states and C B^T in fp32, prev_states
    in the inputs' dtype (what ``ssd`` and ``mamba_ssm`` store). Rebuilding prev_states runs
    chunk_state and state_passing as ``ssd``'s default fused walk does: it reads x, B, dt_out
    and dA_cumsum and writes prev_states only. C B^T is rebuilt from B and C; the output
    before the gate (needed for dz only) by chunk_scan. The last row, the inputs, is kept
    whatever the choice: the scale the others compare with.

    With ``bandwidth`` (bytes/s) and ``rate`` (FLOP/s), ``rebuild_us``: the floor of
    rebuilding it, max(bytes / bandwidth, FLOPs / rate), in microseconds. The backward reads
    a kept intermediate and a rebuilt one alike, so the floor is what rebuilding adds.
    """
    b, l, h, p, n, g = spec.dims
    q = chunk_size or spec.chunk_size
    c = math.ceil(l / q)
    io, fp32 = dtype_bytes, 4
    cost = ssd_costs(spec.dims, q, io, entering_state_bytes=io, has_z=spec.z)
    state_elems = b * c * h * p * n
    walk_flops = cost["chunk_state"]["flops"] + cost["state_passing"]["flops"]
    walk_bytes = cost["chunk_state"]["bytes_read"] + state_elems * io
    gate = "dz only" + ("" if spec.z else " (no z here)")
    rows = [
        dict(intermediate="`dt_out`, `dA_cumsum`", shape="2 x (b, h, c, q)", bytes=fp32,
             saved=2 * b * h * c * q * fp32, read_by="every stage", rebuild="chunk_cumsum",
             flops=cost["chunk_cumsum"]["flops"], moved=cost["chunk_cumsum"]["bytes"]),
        dict(intermediate="`states`", shape="(b, c, h, p, n)", bytes=fp32,
             saved=state_elems * fp32, read_by="none (rebuilds prev_states)",
             rebuild="chunk_state", flops=cost["chunk_state"]["flops"],
             moved=cost["chunk_state"]["bytes"]),
        dict(intermediate="`prev_states`", shape="(b, c, h, p, n)", bytes=io,
             saved=state_elems * io, read_by="chunk_scan, state_passing",
             rebuild="chunk_state + state_passing", flops=walk_flops, moved=walk_bytes),
        dict(intermediate="C Bᵀ", shape="(b, c, g, q, q)", bytes=fp32,
             saved=b * c * g * q * q * fp32, read_by="chunk_scan", rebuild="from B, C",
             flops=2 * b * c * q * q * n * g, moved=2 * b * l * g * n * io),
        dict(intermediate="output before the gate", shape="(b, l, h, p)", bytes=io,
             saved=b * l * h * p * io, read_by=gate, rebuild="chunk_scan",
             flops=cost["chunk_scan"]["flops"], moved=cost["chunk_scan"]["bytes"]),
        dict(intermediate="inputs `x`, `dt`, `B`, `C`", shape="", bytes=io,
             saved=(b * l * h * p + b * l * h + 2 * b * l * g * n) * io,
             read_by="every stage", rebuild="kept anyway", flops=None, moved=None),
    ]
    for r in rows:
        r["saved_mb"] = r["saved"] / 1e6
        r["gflop"] = None if r["flops"] is None else r["flops"] / 1e9
        r["moved_mb"] = None if r["moved"] is None else r["moved"] / 1e6
        if bandwidth and rate:
            r["rebuild_us"] = (None if r["flops"] is None else
                               _recompute_floor_us(r["flops"], r["moved"], bandwidth, rate))
    columns = ["intermediate", "shape", "saved_mb", "read_by", "rebuild", "gflop", "moved_mb"]
    columns += ["rebuild_us"] if bandwidth and rate else []
    return Table(rows, columns,
                 formats=dict(saved_mb=".1f", gflop=".3g", moved_mb=".1f", rebuild_us=".1f"),
                 labels=dict(saved_mb="kept MB", read_by="read by the backward of",
                             rebuild="rebuilt by", gflop="rebuild GFLOP",
                             moved_mb="rebuild MB", rebuild_us="rebuild floor µs"))


def save_or_recompute(shapes, chunk_sizes, bandwidth, rate, dtype_bytes=2) -> Table:
    """The entering states (prev_states) across shapes and chunk sizes: keep or rebuild.

    Per shape (name -> ``ProblemSpec``) and chunk size q: the chunks c, prev_states' MB and
    that over x's (it is N / Q, whatever the batch and length), the floor of rebuilding it
    (as :func:`intermediates_table`), the floor of the whole forward (``ssd.cost.floor_ms``),
    both at ``bandwidth`` bytes/s and ``rate`` FLOP/s, and their ratio.
    """
    from ..cost import floor_ms

    rows = []
    for name, spec in shapes.items():
        for q in chunk_sizes:
            table = intermediates_table(spec, q, dtype_bytes, bandwidth, rate)
            prev = table.find(intermediate="`prev_states`")
            b, l, h, p, n, g = spec.dims
            forward_us = 1e3 * floor_ms(ssd_costs(spec.dims, q, dtype_bytes,
                                                  entering_state_bytes=dtype_bytes),
                                        bandwidth, rate)
            rows.append(dict(shape=name, q=q, c=math.ceil(l / q), prev_mb=prev["saved_mb"],
                             over_x=prev["saved"] / (b * l * h * p * dtype_bytes),
                             rebuild_us=prev["rebuild_us"], forward_us=forward_us,
                             share=prev["rebuild_us"] / forward_us))
    return Table(rows, formats=dict(prev_mb=".0f", over_x=".2f", rebuild_us=".0f",
                                    forward_us=".0f", share="{:.0%}"),
                 labels=dict(prev_mb="prev_states MB", over_x="over x",
                             rebuild_us="rebuild floor µs", forward_us="forward floor µs",
                             share="rebuild / forward"))


# ---------------------------------------------------------------------------------------------
# The kernels


def _grid_formula(doc: str) -> tuple[str, str]:
    """(the grid tuple, what one block does) from a kernel docstring opening "Grid: (...), ...":
    the tuple up to its balanced closing parenthesis, then the text up to the first ";" or "."."""
    text = " ".join(doc.split())
    start = text.index("Grid:") + len("Grid:")
    start = text.index("(", start)
    depth = 0
    for end in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            break
    rest = text[end + 1:].lstrip(",;: ")
    return text[start:end + 1], re.split(r"[;.]", rest, maxsplit=1)[0].strip()


def _array_roles(kernel) -> dict:
    """{array parameter: its signature comment} of a cuTile kernel, in parameter order."""
    import inspect

    source = inspect.getsource(kernel._pyfunc)
    return dict(re.findall(r"^\s*(\w+): Array,\s*#\s*(.*)$", source, flags=re.MULTILINE))


def _grid_value(formula: str, args: dict, dims: dict) -> tuple:
    """A docstring's grid formula evaluated at a captured launch: the problem's sizes ``dims``
    (b, l, h, p, g, n, c, q), the launch's integer arguments (its tiles: BLOCK_Q, BLOCK_N, ...)
    and ``slices`` (the state slices of a (BLOCK_P x BLOCK_N) walk), with ``cdiv``."""
    names = {k: v for k, v in args.items() if isinstance(v, int) and not isinstance(v, bool)}
    names.update(dims, cdiv=lambda a, b: -(-a // b))
    if "BLOCK_P" in names and "BLOCK_N" in names:
        names["slices"] = names["cdiv"](dims["p"], names["BLOCK_P"]) * \
            names["cdiv"](dims["n"], names["BLOCK_N"])
    return tuple(int(v) for v in eval(formula, {"__builtins__": {}}, names))  # noqa: S307


def kernel_table(dtype: str = "bfloat16") -> Table:
    """Every cuTile launch of one backward, in launch order, recorded on the CPU.

    The launches are those ``ssd.tools.aot.capture_backward(dtype, "all")`` records for the
    default backward (the walk, then chunk_scan's kernels with chunk_state's folded in;
    ``ScanBackwardConfig.dprev_in_walk``), with every option
    on: seq_idx, the gate's rebuilt output, dt_bias, initial and final states. Per launch: the kernel, its grid as its docstring writes it
    (checked against the launch's grid: a docstring that disagrees raises ValueError) and what
    one block does, the blocks launched at the captured shape, the arrays it writes (a
    signature comment saying "out"; "(+=)" where it says "in" too) and the arrays it only
    reads. Nothing here is typed in: a changed kernel changes the table.

    Returns:
        the Table (a row also holds ``stage``, the kernel's module), with ``dims``: the
        captured problem's sizes (b, l, h, p, g, n, c, q), read off x, B and dt_out of the
        first launch that reads them.
    """
    import inspect

    from ..config import ScanBackwardConfig
    from ..tools.aot import capture_backward

    records = capture_backward(dtype, "all", ScanBackwardConfig().dprev_in_walk)
    named = [dict(zip(inspect.signature(r.kernel._pyfunc).parameters, r.args)) for r in records]
    scan = next(args for args in named if "x" in args)  # the walk, which reads no x, runs first
    (b, l, h, p), (g, n) = scan["x"].shape, scan["B"].shape[2:]
    c, q = scan["dt_out"].shape[2:]
    dims = dict(b=b, l=l, h=h, p=p, g=g, n=n, c=c, q=q)
    rows = []
    for record, args in zip(records, named):
        fn = record.kernel._pyfunc
        stage = fn.__module__.rsplit(".", 1)[-1].removesuffix("_backward")
        grid, block = _grid_formula(fn.__doc__)
        if _grid_value(grid, args, dims) != tuple(record.grid):
            raise ValueError(f"{fn.__name__}: its docstring's grid {grid} gives "
                             f"{_grid_value(grid, args, dims)}, the launch {record.grid}")
        writes, reads = [], []
        for name, comment in _array_roles(record.kernel).items():
            if args[name].numel() == 1:  # a stand-in for an array the launch does not use
                continue
            if re.search(r"\bout\b", comment):
                writes.append(f"`{name}`" + (" (+=)" if re.search(r"\bin\b", comment) else ""))
            else:
                reads.append(f"`{name}`")
        rows.append(dict(stage=f"`{stage}`", kernel=f"`{fn.__name__}`", grid=f"`{grid}`",
                         block=block, blocks=math.prod(record.grid), writes=", ".join(writes),
                         reads=", ".join(reads)))
    table = Table(rows, ["kernel", "grid", "block", "blocks", "writes", "reads"],
                  labels=dict(block="one block", blocks="blocks here"))
    table.dims = dims
    return table


def contract_table(spec, seed=0) -> Table:
    """The backward's PyTorch stages (``ssd.backward.ssd_chunked_backward_torch``, the
    specification each cuTile kernel is tested against) in float64 on the CPU, against the NumPy
    ladder (``ssd.reference_backward.ssd_chunked_backward``), on ``spec``'s seeded inputs and
    upstream gradients: one row per gradient, its shape and relative error."""
    import torch

    from ..backward import ssd_chunked_backward_torch

    inputs, grads = spec.make_inputs(seed), spec.make_output_grads(seed)
    want = RB.ssd_chunked_backward(grads["dy"], **inputs, **spec.options,
                                   dfinal_states=grads["dfinal_states"])
    tensors = {k: torch.from_numpy(v) for k, v in {**inputs, **grads}.items()}
    dy, dfinal = tensors.pop("dy"), tensors.pop("dfinal_states")
    got = ssd_chunked_backward_torch(dy, **tensors, **spec.options, dfinal_states=dfinal)
    rows = [dict(gradient=f"`{k}`", shape=_shape(v), rel_err=relative_error(got[k].numpy(), v))
            for k, v in want.items()]
    return Table(rows, formats=dict(rel_err=".1e"), labels=dict(rel_err="relative error"))
