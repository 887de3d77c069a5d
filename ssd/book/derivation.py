"""Tables and figures of the derivation chapters (``notebooks/01`` to ``03``), all on the CPU.

* Chapter 1, the recurrence as a scan: :func:`combine`, :func:`doubling_scan`, :func:`scan_work`.
* Chapter 2, the duality: the matrix of any SSM (:func:`ssm_matrix`, :func:`run_ssm`), a
  semiseparable matrix realised as an SSM (:func:`hankel_ranks`, :func:`realize`), a diagonal
  SSM as a sum of masked attentions (:func:`diagonal_ssm`, :func:`diagonal_as_attention`), the
  segment-sum hazards (:func:`segment_sum_errors`, :func:`exp_mask_patterns`).
* Chapter 3, the chunked algorithm: the block picture (:func:`plot_block_picture`), state
  passing as a scalar SSM over chunks (:func:`chunk_passing_matrix`), and why the book does not
  scan (:func:`scan_versus_chunked`, :func:`datasheet_fp32_rate`).

Everything is float64 NumPy unless a function says otherwise; tables come back as
:class:`ssd.book.tables.Table`, figures as matplotlib Figures made without pyplot.
"""
from __future__ import annotations

import math

import numpy as np

from ..cost import STAGES, recurrence_flops, ssd_costs
from ..reference import segsum
from .tables import Table

# ---------------------------------------------------------------------------------------------
# Chapter 1: the recurrence is a scan


def combine(first, second):
    """Compose two steps of h -> a h + w, ``first`` applied before ``second``.

    Each step is a pair (a, w) of a decay and a write. Doing (a1, w1) then (a2, w2) maps h to
    a2 (a1 h + w1) + w2 = (a1 a2) h + (a2 w1 + w2): a step of the same kind. The composition is
    associative, which is what lets a parallel scan regroup the steps.
    """
    (a1, w1), (a2, w2) = first, second
    a2 = np.asarray(a2)
    scale = a2.reshape(a2.shape + (1,) * (np.ndim(w1) - a2.ndim))
    return a1 * a2, scale * w1 + w2


def doubling_scan(a, w):
    """Every state of h_t = a_t h_{t-1} + w_t (from h_{-1} = 0), by recursive doubling.

    Round k combines each position with the one 2^k before it, all positions at once,
    so after ceil(log2 l) rounds position t holds the composition of steps 0..t, whose
    write is h_t.

    Args:
        a: (l,) decays; w: (l, ...) writes (a state of any shape per step).
    Returns:
        (states (l, ...), rounds, combines): the states, the number of rounds (the
        depth) and the number of pairs combined in all rounds (the work).
    """
    acc_a = np.array(a, dtype=np.float64)  # (l,)
    acc_w = np.array(w, dtype=np.float64)  # (l, ...)
    l = len(acc_a)
    rounds = combines = 0
    shift = 1
    while shift < l:
        earlier = (acc_a[:-shift], acc_w[:-shift])  # position t - shift
        later = (acc_a[shift:], acc_w[shift:])  # position t
        new_a, new_w = combine(earlier, later)
        acc_a = np.concatenate([acc_a[:shift], new_a])
        acc_w = np.concatenate([acc_w[:shift], new_w])
        rounds, combines, shift = rounds + 1, combines + (l - shift), 2 * shift
    return acc_w, rounds, combines


def scan_work(lengths) -> Table:
    """Depth and work of three ways to compute every state of a length-l recurrence: the
    loop (l dependent steps, one combine each), recursive doubling (:func:`doubling_scan`)
    and a work-efficient scan (an up-sweep and a down-sweep, each ceil(log2 l) rounds,
    2 (l - 1) combines in all)."""
    rows = []
    for l in lengths:
        depth = math.ceil(math.log2(l)) if l > 1 else 0
        rows.append(dict(l=l, loop=l, doubling_rounds=depth,
                         doubling_work=sum(l - 2**k for k in range(depth)),
                         efficient_rounds=2 * depth, efficient_work=2 * (l - 1)))
    return Table(rows, labels=dict(loop="loop: steps",
                                   doubling_rounds="doubling: rounds",
                                   doubling_work="doubling: combines",
                                   efficient_rounds="work-efficient: rounds",
                                   efficient_work="work-efficient: combines"))


# ---------------------------------------------------------------------------------------------
# Chapter 2: the matrix of an SSM, semiseparable matrices, masked attention


def ssm_matrix(A, B, C):
    """The matrix M of a time-varying SSM with one input channel: y = M x, where

        h_t = A_t h_{t-1} + B_t x_t,   y_t = C_t . h_t,   M[t, s] = C_t . A_t ... A_{s+1} B_s.

    Args:
        A: (l, N, N) state matrices; B, C: (l, N).
    Returns:
        (l, l) lower-triangular float64.
    """
    A, B, C = (np.asarray(v, dtype=np.float64) for v in (A, B, C))
    l = len(B)
    M = np.zeros((l, l))
    for s in range(l):
        carried = B[s]  # A_t ... A_{s+1} B_s, grown one t at a time
        for t in range(s, l):
            if t > s:
                carried = A[t] @ carried
            M[t, s] = C[t] @ carried
    return M


def run_ssm(A, B, C, x):
    """The SSM's outputs y_t = C_t . h_t with h_t = A_t h_{t-1} + B_t x_t, h_{-1} empty or 0.

    The state may change size from step to step: A_t is (r_t, r_{t-1}), B_t and C_t (r_t,), as
    :func:`realize` returns them (A_0 is (r_0, 0)). Lists or arrays.
    """
    h = np.zeros(np.shape(A[0])[1])
    y = np.empty(len(x))
    for t, x_t in enumerate(x):
        h = np.asarray(A[t]) @ h + np.asarray(B[t]) * x_t
        y[t] = np.asarray(C[t]) @ h
    return y


def hankel_ranks(M, rtol=1e-10) -> np.ndarray:
    """rank(M[t:, :t+1]) for each t: the largest block of M on and below the diagonal that has
    (t, t) as its corner. M is N-semiseparable exactly when all are <= N (every other block on
    and below the diagonal lies inside one of these)."""
    M = np.asarray(M, dtype=np.float64)
    top = np.abs(M).max() or 1.0
    return np.array([int((np.linalg.svd(M[t:, :t + 1], compute_uv=False) > rtol * top).sum())
                     for t in range(len(M))])


def realize(M, rtol=1e-10):
    """An SSM whose matrix is M (lower triangular), its state at step t of size
    rank(M[t:, :t+1]).

    Factor each block H_t = M[t:, :t+1] = U_t R_t (thin SVD, U_t with orthonormal
    columns) and let the state after step t be h_t = R_t x_{0..t}; then
    y_t = (row 0 of U_t) . h_t. The block's first t columns are the block H_{t-1}
    without its top row, U_{t-1}[1:] R_{t-1}, so h_t = U_t^T U_{t-1}[1:] h_{t-1}
    + R_t[:, t] x_t: a recurrence. Hence a lower-triangular matrix whose blocks on and
    below the diagonal have rank <= N is the matrix of an SSM with a state of size <= N.

    Returns:
        (A, B, C): lists of l arrays, A_t (r_t, r_{t-1}), B_t and C_t (r_t,); see
        :func:`run_ssm`.
    """
    M = np.asarray(M, dtype=np.float64)
    top = np.abs(M).max() or 1.0
    A, B, C, U_prev = [], [], [], np.zeros((len(M) + 1, 0))
    for t in range(len(M)):
        U, s, Vt = np.linalg.svd(M[t:, :t + 1], full_matrices=False)
        r = int((s > rtol * top).sum())
        U, R = U[:, :r], s[:r, None] * Vt[:r]  # H_t = U R
        A.append(U.T @ U_prev[1:])
        B.append(R[:, t])
        C.append(U[0])
        U_prev = U
    return A, B, C


def diagonal_ssm(a, B, C, x):
    """A diagonal SSM (Mamba-1's structure, one input channel): each of the N state entries
    decays at its own rate, h_t[k] = a_t[k] h_{t-1}[k] + B_t[k] x_t, y_t = C_t . h_t.

    Args:
        a: (l, N) decays in (0, 1]; B, C: (l, N); x: (l,).
    Returns:
        y: (l,).
    """
    h, y = np.zeros(np.shape(a)[1]), np.empty(len(x))
    for t in range(len(x)):
        h = a[t] * h + B[t] * x[t]
        y[t] = C[t] @ h
    return y


def diagonal_as_attention(a, B, C, x):
    """The same diagonal SSM unrolled: a sum of N masked attentions, one mask per state entry,
    y = sum_k (L_k o C[:, k] B[:, k]^T) x with L_k = exp(segsum(log a[:, k])).

    Returns:
        (y (l,), masks (N, l, l)).
    """
    masks = np.exp(segsum(np.log(np.asarray(a, dtype=np.float64)).T))  # (N, l, l)
    M = np.einsum("kts,tk,sk->ts", masks, C, B)
    return M @ x, masks


def exact_segment_sums(ell, band):
    """exact[k - 1][s] = ell[s+1] + ... + ell[s+k], correctly rounded, for k = 1..band.

    The float64 values are exact dyadic rationals: scaled to one common denominator they are
    integers, whose prefix sums Python computes exactly; each difference is rounded once.
    """
    ratios = [float(v).as_integer_ratio() for v in ell]
    den = max(d for _, d in ratios)
    prefix = np.cumsum(np.array([n * (den // d) for n, d in ratios], dtype=object))
    return [np.array([float(v) / den for v in prefix[k:] - prefix[:-k]], dtype=np.float64)
            for k in range(1, band + 1)]


def _segsum_lower(ell, dtype):
    """segsum's algorithm (zero the upper triangle, cumsum down the columns) kept in ``dtype``;
    entries above the diagonal are left at 0 (only segments are read from it)."""
    x = np.asarray(ell, dtype=dtype)
    strictly_lower = np.tril(np.ones((len(x), len(x)), dtype=bool), k=-1)
    return np.cumsum(np.where(strictly_lower, x[:, None], dtype(0)), axis=0, dtype=dtype)


SEGMENT_METHODS = ("naive cumsum difference", "cumsum restarted every chunk", "segsum")


def segment_sum_errors(ell, chunk_sizes=(64, 128, 256), dtypes=("float32", "float64")) -> Table:
    """The error of each way to compute log L[t, s] = ell[s+1] + ... + ell[t], against the
    exact sums, in each dtype.

    For chunk size q the segments are those of up to q steps (the segment sums the chunked
    algorithm uses); the restarted cumsum is read only for segments inside one chunk of q. The
    value is max |error| over those segments: an absolute error in log L, which is the relative
    error of L = exp(log L). The float32 rows start from ``ell`` rounded to float32.
    Rows: method x dtype; one column per chunk size (``q<size>``).
    """
    ell = np.asarray(ell, dtype=np.float64)
    l = len(ell)
    exact = exact_segment_sums(ell, max(chunk_sizes))
    rows = []
    for method in SEGMENT_METHODS:
        for name in dtypes:
            dt = np.dtype(name).type
            row = dict(method=method, dtype=name)
            for q in chunk_sizes:
                if method == "segsum":
                    S = _segsum_lower(ell, dt)
                    got = lambda k: np.diagonal(S, offset=-k)  # noqa: E731
                else:
                    cs = ell.astype(dt)
                    cs = (np.cumsum(cs, dtype=dt) if method.startswith("naive") else
                          np.concatenate([np.cumsum(cs[i:i + q], dtype=dt)
                                          for i in range(0, l, q)]))
                    got = lambda k: cs[k:] - cs[:-k]  # noqa: E731
                worst = 0.0
                for k in range(1, q + 1):
                    err = np.abs(got(k).astype(np.float64) - exact[k - 1])
                    if method.startswith("cumsum restarted"):
                        err = err[np.arange(l - k) // q == np.arange(k, l) // q]
                    if err.size:
                        worst = max(worst, float(err.max()))
                row[f"q{q}"] = worst
            rows.append(row)
    return Table(rows, ["method", "dtype", *(f"q{q}" for q in chunk_sizes)],
                 {f"q{q}": ".1e" for q in chunk_sizes},
                 {f"q{q}": f"q = {q}" for q in chunk_sizes})


EXP_PATTERNS = ("multiply exp by the mask", "select after a clamped exp", "mask before exp")


def exp_mask_patterns(ell, dtype="float32") -> Table:
    """Three ways to turn the difference of cumulative sums into the decay mask L, in ``dtype``:

    * multiply: exp(cs_t - cs_s) * causal. Above the diagonal the exponent is >= 0 and grows
      with the distance; exp overflows to inf, and inf * 0 = NaN.
    * select after a clamped exp (``mamba_ssm``'s kernels): where(causal,
      exp(min(cs_t - cs_s, 0)), 0). The clamp keeps every exp <= 1, and a select never
      multiplies.
    * mask before exp (``ssd.reference.segsum``, this book's kernels): exp(where(causal,
      cs_t - cs_s, -inf)); exp(-inf) = 0 exactly.

    Rows: pattern, NaN entries, entries above the diagonal that are not exactly 0 (a NaN is
    one), and the largest absolute error of L on and below the diagonal against float64
    ``segsum`` (L lies in [0, 1]; all three patterns compute the same values there).
    """
    dt = np.dtype(dtype).type
    cs = np.cumsum(np.asarray(ell, dtype=dt), dtype=dt)
    diff = cs[:, None] - cs[None, :]
    causal = np.tril(np.ones(diff.shape, dtype=bool))
    truth = np.exp(segsum(np.asarray(ell, dtype=np.float64)))
    with np.errstate(over="ignore", invalid="ignore"):
        made = {
            EXP_PATTERNS[0]: np.exp(diff) * causal.astype(dt),
            EXP_PATTERNS[1]: np.where(causal, np.exp(np.minimum(diff, dt(0))), dt(0)),
            EXP_PATTERNS[2]: np.exp(np.where(causal, diff, dt(-np.inf))),
        }
    rows = []
    for name, L in made.items():
        rows.append(dict(pattern=name, nan=int(np.isnan(L).sum()),
                         above=int((np.triu(L, 1) != 0).sum()),
                         abs_err=float(np.abs(L[causal].astype(np.float64)
                                              - truth[causal]).max())))
    return Table(rows, formats=dict(abs_err=".1e"),
                 labels=dict(nan="NaN", above="nonzero above diagonal",
                             abs_err="max |err| of L below"))


# ---------------------------------------------------------------------------------------------
# Chapter 3: the block picture, state passing as an SSM, why not a scan

#: One colour per stage, shared by the block picture and the chapters that refer to it.
STAGE_COLOURS = {
    "chunk_cumsum": "#7f7f7f",
    "chunk_state": "#2ca02c",
    "state_passing": "#9467bd",
    "chunk_scan": "#1f77b4",
    "chunk_scan (off-diagonal term)": "#ff7f0e",
}


def plot_block_picture(M, chunk_size, dstate, block=(3, 1)):
    """The blocks of M coloured by the stage that computes them (left), and one off-diagonal
    block as the product of its three factors, each coloured by its stage (right).

    Args:
        M: (l, l) the matrix of one head, l a multiple of ``chunk_size``.
        chunk_size: Q. dstate: N (the rank of the off-diagonal blocks).
        block: (target chunk, source chunk) of the block drawn on the right.
    Returns:
        a matplotlib Figure.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Polygon, Rectangle

    q, c = chunk_size, len(M) // chunk_size
    c_to, c_from = block
    colour = STAGE_COLOURS
    off = ("chunk_scan (off-diagonal term)", "state_passing", "chunk_state")  # C, carry, B
    fig = Figure(figsize=(7.6, 3.3), dpi=90)
    ax0, ax1 = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1, 1.2]))

    for i in range(c):
        x0, y0 = i * q - .5, i * q - .5  # diagonal block (i, i): its lower triangle
        ax0.add_patch(Polygon([(x0, y0), (x0, y0 + q), (x0 + q, y0 + q)], closed=True,
                              fc=colour["chunk_scan"], alpha=0.55, ec="none"))
        for j in range(i):  # off-diagonal block (i, j): one stripe per factor
            for k, stage in enumerate(off):
                ax0.add_patch(Rectangle((j * q - .5 + k * q / 3, i * q - .5), q / 3, q,
                                        fc=colour[stage], alpha=0.55, ec="none"))
            ax0.add_patch(Rectangle((j * q - .5, i * q - .5), q, q, fill=False, ec="0.3",
                                    lw=0.5))
    with np.errstate(divide="ignore"):
        texture = np.log10(np.abs(M))
    texture[np.triu_indices(len(M), 1)] = np.nan  # transparent above the diagonal
    ax0.imshow(texture, cmap="Greys", vmin=-6, vmax=1, alpha=0.35, interpolation="nearest")
    ax0.add_patch(Rectangle((c_from * q - .5, c_to * q - .5), q, q, fill=False, ec="k", lw=2))
    ax0.set(title=f"blocks of $M$ (Q = {q})", xlabel="source s", ylabel="target t",
            xticks=[k * q for k in range(c)], yticks=[k * q for k in range(c)],
            xlim=(-.5, c * q - .5), ylim=(c * q - .5, -.5))

    # the factorization of block (c_to, c_from): (Q x N) . scalar . (N x Q), to scale
    ax1.set_axis_off()
    ax1.set(xlim=(0, 3.4 * q), ylim=(-0.05 * q, 1.2 * q))
    w = max(dstate, q / 8)  # the N side, widened so that a small N stays visible
    y0 = 0.15 * q
    ax1.add_patch(Rectangle((0, y0), q, q, fc="0.88", ec="k", lw=1.5))
    ax1.text(q / 2, y0 + q / 2, f"$M_{{{c_to}{c_from}}}$\n$Q \\times Q$", ha="center",
             va="center")
    ax1.text(1.1 * q, y0 + q / 2, "=", fontsize=14, ha="center", va="center")
    x = 1.25 * q
    ax1.add_patch(Rectangle((x, y0), w, q, fc=colour[off[0]], alpha=0.7, ec="k"))
    ax1.text(x + w / 2, y0 - 0.04 * q, "$Q \\times N$", ha="center", va="top", fontsize=8)
    x += w + 0.1 * q
    ax1.add_patch(Rectangle((x, y0 + q / 2 - w / 2), w, w, fc=colour[off[1]], alpha=0.7,
                            ec="k"))
    ax1.text(x + w / 2, y0 + q / 2 - w / 2 - 0.04 * q, "scalar", ha="center", va="top",
             fontsize=8)
    x += w + 0.1 * q
    ax1.add_patch(Rectangle((x, y0 + q - w), q, w, fc=colour[off[2]], alpha=0.7, ec="k"))
    ax1.text(x + q / 2, y0 + q - w - 0.04 * q, "$N \\times Q$", ha="center", va="top",
             fontsize=8)
    ax1.set_title(f"one off-diagonal block: rank $\\leq N$ = {dstate}")
    legend = [Patch(fc=colour["chunk_scan"], alpha=0.7, label="chunk_scan: diagonal blocks"),
              Patch(fc=colour[off[0]], alpha=0.7, label="chunk_scan: read the state ($C$)"),
              Patch(fc=colour[off[1]], alpha=0.7, label="state_passing: carry ($\\gamma$)"),
              Patch(fc=colour[off[2]], alpha=0.7, label="chunk_state: write the state ($B$)")]
    ax1.legend(handles=legend, loc="lower right", fontsize=7.5, frameon=False,
               bbox_to_anchor=(1.0, 0.02))
    fig.tight_layout()
    return fig


def chunk_passing_matrix(dA_cumsum):
    """State passing as the quadratic form of a scalar SSM over chunks.

    The walk H_0 = h_{-1}, H_{c+1} = gamma_c H_c + S_c, with the decay of a whole chunk
    gamma_c = exp(dA_cumsum[c, last]), is the recurrence of chapter 1 with one scalar
    decay per step, over chunks instead of positions. Unrolled,
    [H_0, ..., H_c] = W [h_{-1}, S_0, ..., S_{c-1}], with W the (c+1) x (c+1)
    lower-triangular exp(segsum([0, log gamma_0, ..., log gamma_{c-1}])): W[i, j] is the
    decay across chunks j .. i-1.

    Args:
        dA_cumsum: (..., c, q) from ``chunk_cumsum``.
    Returns:
        W: (..., c + 1, c + 1) float64.
    """
    last = np.asarray(dA_cumsum, dtype=np.float64)[..., -1]  # (..., c): log gamma
    padded = np.concatenate([np.zeros(last.shape[:-1] + (1,)), last], axis=-1)
    return np.exp(segsum(padded))


#: FP32 lanes (CUDA cores) per SM of a Hopper (sm_90) GPU: an NVIDIA datasheet figure
#: (the H100 whitepaper), not a measurement. Each does one fused multiply-add (2 FLOPs) a clock.
HOPPER_FP32_LANES_PER_SM = 128


def datasheet_fp32_rate(environment) -> float:
    """The peak fp32 rate of the CUDA cores, FLOP/s, from datasheet unit counts: SMs x
    ``HOPPER_FP32_LANES_PER_SM`` x 2 FLOPs x the maximum SM clock, with the SM count and the
    clock read from a recording's environment. A datasheet figure, not a measurement."""
    return (int(environment["sm_count"]) * HOPPER_FP32_LANES_PER_SM * 2
            * float(environment["sm_clock_max_mhz"]) * 1e6)


def scan_versus_chunked(dims, chunk_sizes, matmul_flops_per_s) -> Table:
    """What a scan would have to run at to tie the chunked algorithm, per chunk size.

    The chunked algorithm's FLOPs (``ssd.cost.ssd_costs``) split into matrix products, which
    run on the tensor cores (chunk_state, chunk_scan), and elementwise work (chunk_cumsum,
    state_passing). A scan does all of its work elementwise, at least the recurrence's
    5 l p n per head (``ssd.cost.recurrence_flops``), a bound generous to the scan. With the
    matrix products at ``matmul_flops_per_s`` and everything elementwise at a rate R, the two
    take equally long when

        R = matmul_flops_per_s * (scan FLOPs - chunked elementwise FLOPs) / chunked matmul FLOPs,

    the break-even rate: a scan is faster only on a GPU whose elementwise rate exceeds it.
    """
    b, l, h, p, n, _ = getattr(dims, "dims", dims)
    scan = b * h * recurrence_flops(l, p, n)
    rows = []
    for q in chunk_sizes:
        cost = ssd_costs(dims, q)
        elementwise = cost["chunk_cumsum"]["flops"] + cost["state_passing"]["flops"]
        matmul = sum(cost[s]["flops"] for s in STAGES) - elementwise
        rows.append(dict(q=q, matmul=matmul / 1e9, elementwise=elementwise / 1e9,
                         scan=scan / 1e9, break_even=matmul_flops_per_s * (scan - elementwise)
                         / matmul / 1e12))
    return Table(rows, formats=dict(matmul=".1f", elementwise=".2f", scan=".1f",
                                    break_even=".0f"),
                 labels=dict(matmul="chunked: matmul GFLOP", elementwise="elementwise GFLOP",
                             scan="scan GFLOP (at least)",
                             break_even="break-even TFLOP/s"))


__all__ = [
    "combine", "doubling_scan", "scan_work", "ssm_matrix", "run_ssm", "hankel_ranks", "realize",
    "diagonal_ssm", "diagonal_as_attention", "exact_segment_sums", "segment_sum_errors",
    "SEGMENT_METHODS", "EXP_PATTERNS", "exp_mask_patterns", "STAGE_COLOURS",
    "plot_block_picture", "chunk_passing_matrix", "HOPPER_FP32_LANES_PER_SM",
    "datasheet_fp32_rate", "scan_versus_chunked",
]


def chunk_size_costs(dims, chunk_sizes, bandwidth, rate, dtype_bytes=2) -> Table:
    """FLOPs, bytes and floors of the chunked forward per chunk size (``ssd.cost``).

    Per chunk size q: c, GFLOP and MB (read + written) per stage and in total, FLOPs per byte,
    and three floors (``ssd.cost.floor_ms`` at ``bandwidth`` bytes/s and ``rate`` FLOP/s, in
    ms): ``floor`` with the entering states stored in the inputs' dtype (``dtype_bytes``, what
    ``ssd`` and ``mamba_ssm`` store), ``floor_fp32`` with them in fp32, and ``floor_cb`` in the
    inputs' dtype with C B^T computed once per group instead of once per head.
    """
    from ..cost import floor_ms

    rows = []
    for q in chunk_sizes:
        cost = ssd_costs(dims, q, dtype_bytes, entering_state_bytes=dtype_bytes)
        fp32 = ssd_costs(dims, q, dtype_bytes, entering_state_bytes=4)
        shared = ssd_costs(dims, q, dtype_bytes, entering_state_bytes=dtype_bytes,
                           cb_per_group=True)
        row = dict(q=q, c=math.ceil(getattr(dims, "dims", dims)[1] / q))
        for s in (*STAGES, "total"):
            row[f"{s}_gflop"] = cost[s]["flops"] / 1e9
            row[f"{s}_mb"] = cost[s]["bytes"] / 1e6
        row["flop_per_byte"] = cost["total"]["flops"] / cost["total"]["bytes"]
        row["floor"] = floor_ms(cost, bandwidth, rate)
        row["floor_fp32"] = floor_ms(fp32, bandwidth, rate)
        row["floor_cb"] = floor_ms(shared, bandwidth, rate)
        row["bound"] = {s: "memory" if cost[s]["bytes"] / bandwidth > cost[s]["flops"] / rate
                        else "compute" for s in STAGES}
        rows.append(row)
    formats = {f"{s}_gflop": ".2f" for s in STAGES}
    formats.update({f"{s}_mb": ".1f" for s in STAGES})
    formats.update(total_gflop=".1f", total_mb=".0f", flop_per_byte=".1f", floor=".3f",
                   floor_fp32=".3f", floor_cb=".3f")
    labels = {f"{s}_gflop": s for s in STAGES}
    labels.update({f"{s}_mb": s for s in STAGES})
    labels.update(total_gflop="total", total_mb="total", flop_per_byte="FLOP/B",
                  floor="floor ms", floor_fp32="fp32 states", floor_cb="C Bᵀ per group")
    return Table(rows, ["q", "c"], formats, labels)


__all__ += ["chunk_size_costs"]
