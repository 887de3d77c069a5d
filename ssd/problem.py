"""Problem specifications: seeded inputs plus the reference for every stage.

A ``ProblemSpec`` names one SSD forward problem (sizes and optional features). It
makes reproducible inputs and returns the float64 NumPy reference for each
intermediate of the chunked algorithm, so a kernel test can compare stage by stage::

    spec = EDGE_SHAPES["l-not-multiple"]
    inputs = spec.make_inputs(seed=0)           # dict of NumPy arrays
    ref = spec.reference(inputs)                # dt_out, dA_cumsum, states, ...
    y = ssd_chunked(**inputs, **spec.options)   # == ref["y"]

and the same for the backward pass, from seeded upstream gradients::

    grads = spec.make_output_grads(seed=0)      # dy, dfinal_states
    dref = spec.reference_backward(inputs, grads)  # dprev_states, dstates, ..., dx, ddt, ...

Three collections of specs:

* ``EDGE_SHAPES``  -- small named shapes, each isolating one edge case or feature;
* ``MODEL_SHAPES`` -- the benchmark suite (sizes of real Mamba-2 models);
* ``random_spec(rng)`` -- a random valid spec of modest size (property tests,
  random GPU shapes).

How inputs are drawn (``make_inputs``), and why
-----------------------------------------------
* x, z, D ~ N(0, 1): activations of unit scale (the model normalises them).
* B, C ~ N(0, 1), NOT scaled by 1/sqrt(n): in Mamba-2, B and C come out of a
  projection + conv + SiLU with O(1) entries and SSD applies no attention-style
  scaling, so C_t . B_s grows like sqrt(n). Keeping that makes low-precision kernels
  face the magnitudes they meet in a model; y ends up O(1) for n ~ 64..128.
* dt' (the step after bias/softplus) is log-uniform in [1e-3, 1e-1], Mamba-2's
  ``dt_min``/``dt_max`` initialisation range. With ``dt_softplus`` the raw dt is the
  inverse softplus of that target; with ``dt_bias`` too, the bias carries the
  per-head inverse-softplus target (as Mamba-2 initialises it) and the raw dt is
  N(0, 0.5^2) around it. Without softplus, a bias is log-uniform in the same range
  and adds to the raw dt (both positive).
* A = -exp(U(log 1, log 16)): Mamba-2's ``A_init_range = (1, 16)``. Per step the decay
  exp(dt' A) lies in [exp(-1.6), exp(-0.001)].
* initial_states ~ N(0, 0.1^2): about the size of a state the recurrence reaches on
  its own (|h| ~ sqrt(dt'/|A|)), as when they come from a previous call's
  final_states.
* seq_idx is int32 (as mamba_ssm expects); everything else is float64 unless
  ``dtype`` asks otherwise. Each array has its own random stream keyed by its name,
  so switching one feature on leaves the other arrays unchanged.
* The upstream gradients dy and dfinal_states (``make_output_grads``) ~ N(0, 1): a loss
  whose gradient is of the outputs' own scale; streams of their own, so drawing them
  leaves the inputs unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from ssd.reference import (
    INF,
    Dims,
    _check_dt_limit,
    check_shapes,
    chunk_cumsum,
    chunk_scan,
    chunk_state,
    state_passing,
)
from ssd.reference_backward import (
    chunk_cumsum_backward,
    chunk_scan_backward,
    chunk_state_backward,
    state_passing_backward,
)

__all__ = ["ProblemSpec", "EDGE_SHAPES", "MODEL_SHAPES", "random_spec"]

# One independent random stream per array (see make_inputs, make_output_grads).
_STREAMS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
_GRAD_STREAMS = ("dy", "dfinal_states")

#: Names of the entries ``ProblemSpec.reference`` returns, in stage order.
REFERENCE_KEYS = ("dt_out", "dA_cumsum", "states", "prev_states", "final_states", "y")

#: Names of the entries ``ProblemSpec.reference_backward`` returns, in the backward's
#: stage order: the gradients of the intermediates, then of the inputs. The last four are
#: present only when the spec has that input (D, z, dt_bias, initial_states).
BACKWARD_KEYS = ("dprev_states", "dstates", "ddt_out", "ddA_cumsum", "dx", "ddt", "dA",
                 "dB", "dC", "dD", "dz", "ddt_bias", "dinitial_states")


def _inverse_softplus(v):
    """The u with softplus(u) = v, for v > 0: log(expm1(v))."""
    return np.log(np.expm1(v))


@dataclass(frozen=True)
class ProblemSpec:
    """One SSD forward problem: sizes, features and a name.

    Attributes:
        batch, seqlen, nheads, headdim, dstate, ngroups: b, l, h, p, n, g.
        chunk_size: q (seqlen need not be a multiple of it).
        D: None, "h" (one skip weight per head) or "hp" (one per channel).
        z: whether to gate the output with silu(z).
        dt_bias, dt_softplus, dt_limit: the dt transform (see ``prepare_dt``).
        initial_states: whether to pass an initial state.
        seq_boundaries: positions where a new packed sequence starts. Either a tuple of
            ints used for every batch row, or a tuple of ``batch`` tuples, one per row.
            seq_idx[b, t] = number of boundaries <= t. Empty tuple: no seq_idx at all.
            A boundary at 0 makes the row start at seq_idx 1, so the initial state is
            ignored there (mamba_ssm's virtual seq_idx[-1] is 0).
        name: label used in test ids and tables.
    """

    batch: int
    seqlen: int
    nheads: int
    headdim: int
    dstate: int
    ngroups: int = 1
    chunk_size: int = 64
    D: str | None = None
    z: bool = False
    dt_bias: bool = False
    dt_softplus: bool = False
    dt_limit: tuple = (0.0, INF)
    initial_states: bool = False
    seq_boundaries: tuple = ()
    name: str = field(default="", compare=False)

    def __post_init__(self):
        for attr in ("batch", "seqlen", "nheads", "headdim", "dstate", "ngroups"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{attr}: expected a positive int, got {value!r}")
        if self.D not in (None, "h", "hp"):
            raise ValueError(f"D: expected None, 'h' or 'hp', got {self.D!r}")
        object.__setattr__(self, "dt_limit", tuple(float(v) for v in self.dt_limit))
        _check_dt_limit(self.dt_limit)
        # the shape rules (h divisible by g, chunk_size a positive int) live in one place
        b, l, h, p, n, g = self.dims
        check_shapes(x=(b, l, h, p), B=(b, l, g, n), chunk_size=self.chunk_size)
        object.__setattr__(self, "seq_boundaries", self._normalised_boundaries())

    def _normalised_boundaries(self):
        sb = tuple(self.seq_boundaries)
        if not sb:
            return ()
        per_row = isinstance(sb[0], (tuple, list))
        rows = [tuple(r) for r in sb] if per_row else [sb]
        if per_row and len(rows) != self.batch:
            raise ValueError(
                f"seq_boundaries: {len(rows)} rows given, expected batch = {self.batch}")
        for row in rows:
            if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) for t in row):
                raise ValueError(f"seq_boundaries: positions must be ints, got {row!r}")
            if any(not 0 <= t < self.seqlen for t in row):
                raise ValueError(
                    f"seq_boundaries: positions must lie in [0, {self.seqlen}), got {row!r}")
            if any(t1 <= t0 for t0, t1 in zip(row, row[1:])):
                raise ValueError(
                    f"seq_boundaries: positions must be strictly increasing, got {row!r}")
        return tuple(tuple(int(t) for t in r) for r in rows) if per_row else tuple(
            int(t) for t in rows[0])

    # ---- derived sizes ---------------------------------------------------------------

    @property
    def dims(self) -> Dims:
        """(b, l, h, p, n, g)."""
        return Dims(self.batch, self.seqlen, self.nheads, self.headdim, self.dstate,
                    self.ngroups)

    @property
    def nchunks(self) -> int:
        """c = ceil(l / q)."""
        return math.ceil(self.seqlen / self.chunk_size)

    @property
    def x_numel(self) -> int:
        """b * l * h * p, the number of elements of x (and of y)."""
        return self.batch * self.seqlen * self.nheads * self.headdim

    @property
    def options(self) -> dict:
        """The non-array arguments: ``ssd_chunked(**inputs, **spec.options)``."""
        return {"chunk_size": self.chunk_size, "dt_softplus": self.dt_softplus,
                "dt_limit": self.dt_limit}

    def seq_idx(self):
        """(b, l) int32 sequence index from ``seq_boundaries``, or None."""
        if not self.seq_boundaries:
            return None
        rows = (self.seq_boundaries if isinstance(self.seq_boundaries[0], tuple)
                else [self.seq_boundaries] * self.batch)
        t = np.arange(self.seqlen)
        return np.stack([(t[:, None] >= np.array(r, dtype=np.int64)[None, :]).sum(1)
                         if r else np.zeros(self.seqlen, np.int64) for r in rows]
                        ).astype(np.int32)

    def cu_seqlens(self):
        """(num_sequences + 1,) int32 offsets of the packed sequences of a batch of one row
        (mamba_ssm's cu_seqlens): 0, the boundaries after position 0, then l. Agrees with
        :meth:`seq_idx` (an unpacked spec is one sequence)."""
        if self.batch != 1:
            raise ValueError(f"cu_seqlens: packs sequences along one batch row, but this spec "
                             f"has batch {self.batch}")
        row = self.seq_boundaries
        row = row[0] if row and isinstance(row[0], tuple) else row
        return np.array([0, *(t for t in row if t > 0), self.seqlen], dtype=np.int32)

    def replace(self, **changes) -> "ProblemSpec":
        """A copy with some fields changed (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    # ---- inputs and reference ---------------------------------------------------------

    def make_inputs(self, seed=0, dtype=np.float64) -> dict:
        """Seeded inputs: x, dt, A, B, C and the optional arrays the spec asks for.

        Args:
            seed: int; the same seed gives the same arrays.
            dtype: float dtype of the float arrays (drawn in float64, then cast).
        Returns:
            dict with x (b,l,h,p), dt (b,l,h), A (h,), B and C (b,l,g,n), and when
            enabled D ((h,) or (h,p)), z (b,l,h,p), dt_bias (h,), initial_states
            (b,h,p,n), seq_idx (b,l) int32. Absent features are absent keys.
        """
        b, l, h, p, n, g = self.dims
        rng = {name: np.random.default_rng([seed, i]) for i, name in enumerate(_STREAMS)}
        log_uniform = lambda r, size: np.exp(r.uniform(np.log(1e-3), np.log(1e-1), size))

        out = {"x": rng["x"].standard_normal((b, l, h, p))}
        dt_target = log_uniform(rng["dt"], (b, l, h))  # the dt' we aim for
        if self.dt_softplus and self.dt_bias:  # bias = per-head target, dt = noise around it
            dt_bias = _inverse_softplus(log_uniform(rng["dt_bias"], h))
            out["dt"] = 0.5 * rng["dt"].standard_normal((b, l, h))
        elif self.dt_softplus:
            dt_bias = None
            out["dt"] = _inverse_softplus(dt_target)
        else:  # no softplus: dt' = dt (+ bias), both positive
            dt_bias = log_uniform(rng["dt_bias"], h)
            out["dt"] = dt_target
        out["A"] = -np.exp(rng["A"].uniform(np.log(1.0), np.log(16.0), h))
        out["B"] = rng["B"].standard_normal((b, l, g, n))
        out["C"] = rng["C"].standard_normal((b, l, g, n))
        if self.D is not None:
            out["D"] = rng["D"].standard_normal((h,) if self.D == "h" else (h, p))
        if self.z:
            out["z"] = rng["z"].standard_normal((b, l, h, p))
        if self.dt_bias:
            out["dt_bias"] = dt_bias
        if self.initial_states:
            out["initial_states"] = 0.1 * rng["initial_states"].standard_normal((b, h, p, n))
        out = {k: v.astype(dtype) for k, v in out.items()}
        if self.seq_boundaries:
            out["seq_idx"] = self.seq_idx()
        return out

    def reference(self, inputs) -> dict:
        """Float64 reference for every stage of the chunked algorithm.

        Args:
            inputs: a dict from ``make_inputs`` (any float dtype; computed in float64
                from the values as given, so rounded low-precision inputs get their own
                exact reference).
        Returns:
            dict of float64 arrays:
                dt_out, dA_cumsum: (b, h, c, q)   -- chunk_cumsum
                states: (b, c, h, p, n)           -- chunk_state
                prev_states: (b, c, h, p, n)      -- state_passing
                final_states: (b, h, p, n)        -- state_passing
                y: (b, l, h, p)                   -- chunk_scan
        """
        get = inputs.get
        dt_out, dA_cumsum = chunk_cumsum(inputs["dt"], inputs["A"], self.chunk_size,
                                         get("dt_bias"), self.dt_softplus, self.dt_limit)
        states = chunk_state(inputs["B"], inputs["x"], dt_out, dA_cumsum, get("seq_idx"))
        prev_states, final_states = state_passing(states, dA_cumsum, get("initial_states"),
                                                  get("seq_idx"), self.chunk_size)
        y = chunk_scan(inputs["B"], inputs["C"], inputs["x"], dt_out, dA_cumsum,
                       prev_states, get("D"), get("z"), get("seq_idx"))
        return {"dt_out": dt_out, "dA_cumsum": dA_cumsum, "states": states,
                "prev_states": prev_states, "final_states": final_states, "y": y}

    def make_output_grads(self, seed=0, dtype=np.float64) -> dict:
        """Seeded upstream gradients for the backward pass, N(0, 1).

        Args:
            seed: int; the same seed gives the same arrays.
            dtype: float dtype (drawn in float64, then cast).
        Returns:
            dict with dy (b, l, h, p) and dfinal_states (b, h, p, n).
        """
        b, l, h, p, n, g = self.dims
        shapes = {"dy": (b, l, h, p), "dfinal_states": (b, h, p, n)}
        return {name: np.random.default_rng([seed, len(_STREAMS) + i])
                .standard_normal(shapes[name]).astype(dtype)
                for i, name in enumerate(_GRAD_STREAMS)}

    def reference_backward(self, inputs, grads) -> dict:
        """Float64 reference for every gradient of the chunked backward, stage by stage.

        The forward intermediates come from ``reference(inputs)``; each stage's backward
        (``ssd.reference_backward``) runs in reverse order.

        Args:
            inputs: a dict from ``make_inputs`` (any float dtype; computed in float64).
            grads: a dict from ``make_output_grads``: dy (b, l, h, p) and, optionally,
                dfinal_states (b, h, p, n).
        Returns:
            dict of float64 arrays, keys in ``BACKWARD_KEYS`` order:
                dprev_states: (b, c, h, p, n)     -- chunk_scan's backward
                dstates: (b, c, h, p, n)          -- state_passing's backward
                ddt_out, ddA_cumsum: (b, h, c, q) -- summed over chunk_scan,
                                                     state_passing and chunk_state
                dx (b, l, h, p), ddt (b, l, h), dA (h,), dB and dC (b, l, g, n), and
                where the spec has the input: dD ((h,) or (h, p)), dz (b, l, h, p),
                ddt_bias (h,), dinitial_states (b, h, p, n)
        """
        get = inputs.get
        x, B, C, seq_idx = inputs["x"], inputs["B"], inputs["C"], get("seq_idx")
        ref = self.reference(inputs)
        dt_out, dA_cumsum = ref["dt_out"], ref["dA_cumsum"]
        scan = chunk_scan_backward(grads["dy"], B, C, x, dt_out, dA_cumsum,
                                   ref["prev_states"], get("D"), get("z"), seq_idx)
        passing = state_passing_backward(scan["dprev_states"], ref["states"], dA_cumsum,
                                         get("initial_states"), seq_idx, self.chunk_size,
                                         dfinal_states=grads.get("dfinal_states"))
        state = chunk_state_backward(passing["dstates"], B, x, dt_out, dA_cumsum, seq_idx)
        ddt_out = scan["ddt_out"] + state["ddt_out"]
        ddA_cumsum = scan["ddA_cumsum"] + passing["ddA_cumsum"] + state["ddA_cumsum"]
        cumsum = chunk_cumsum_backward(ddt_out, ddA_cumsum, inputs["dt"], inputs["A"],
                                       self.chunk_size, get("dt_bias"), self.dt_softplus,
                                       self.dt_limit)
        out = {"dprev_states": scan["dprev_states"], "dstates": passing["dstates"],
               "ddt_out": ddt_out, "ddA_cumsum": ddA_cumsum,
               "dx": scan["dx"] + state["dx"], "ddt": cumsum["ddt"], "dA": cumsum["dA"],
               "dB": scan["dB"] + state["dB"], "dC": scan["dC"], "dD": scan.get("dD"),
               "dz": scan.get("dz"), "ddt_bias": cumsum.get("ddt_bias"),
               "dinitial_states": passing.get("dinitial_states")}
        return {k: v for k, v in out.items() if v is not None}

    def __str__(self):
        b, l, h, p, n, g = self.dims
        feats = [f for f, on in (("D=" + str(self.D), self.D), ("z", self.z),
                                 ("dt_bias", self.dt_bias), ("softplus", self.dt_softplus),
                                 (f"dt_limit={self.dt_limit}", self.dt_limit != (0.0, INF)),
                                 ("h0", self.initial_states),
                                 ("seq_idx", bool(self.seq_boundaries))) if on]
        label = f"{self.name}: " if self.name else ""
        return (f"{label}b={b} l={l} h={h} p={p} n={n} g={g} q={self.chunk_size}"
                + (" " + " ".join(feats) if feats else ""))


def _specs(base, table):
    """Build {name: ProblemSpec(**base, **overrides, name=name)}."""
    return {name: ProblemSpec(**{**base, **over}, name=name) for name, over in table.items()}


#: Small named shapes, one edge case or feature each (q = 32 unless stated).
EDGE_SHAPES = _specs(
    dict(batch=2, seqlen=96, nheads=4, headdim=16, dstate=16, ngroups=1, chunk_size=32),
    {
        "single-chunk": dict(seqlen=32),
        "three-chunks": dict(seqlen=96),
        "l-not-multiple": dict(seqlen=83),  # 2 full chunks + a tail of 19
        "l-less-than-q": dict(seqlen=20),  # one partial chunk
        "ngroups-gt-1": dict(nheads=8, ngroups=2, seqlen=80),
        "dstate-ne-chunk": dict(dstate=24, seqlen=80),
        "headdim-not-pow2": dict(headdim=48, seqlen=80),
        "initial-states": dict(initial_states=True, seqlen=80),
        # row 0: a boundary mid-chunk, one exactly at a chunk start (32), one mid-chunk;
        # row 1: a boundary at 0 (initial state ignored), a one-token sequence (40) and
        # a new sequence on the very last token (95).
        "seq-idx-mid-chunk": dict(initial_states=True,
                                  seq_boundaries=((5, 32, 70), (0, 40, 41, 95))),
        "z-gate": dict(z=True, seqlen=80),
        "D-per-head": dict(D="h", seqlen=80),
        "D-per-channel": dict(D="hp", seqlen=80),
        # the limit clips both ends of the log-uniform [1e-3, 1e-1] range of dt'
        "dt-bias-softplus-limit": dict(dt_bias=True, dt_softplus=True,
                                       dt_limit=(0.005, 0.05), seqlen=80),
        "all-features": dict(batch=2, seqlen=83, nheads=6, ngroups=3, headdim=24,
                             dstate=12, chunk_size=16, D="hp", z=True, dt_bias=True,
                             dt_softplus=True, dt_limit=(0.002, 0.08),
                             initial_states=True,
                             seq_boundaries=((3, 16, 50), (0, 64, 82))),
    },
)

#: Benchmark suite: (batch, seqlen, heads, headdim, dstate, groups) of real models, with
#: the Mamba-2 module's forward features (D per head, dt_bias + softplus; the z gate is
#: applied by the module's gated RMSNorm, not by the scan) and its chunk_size 256.
MODEL_SHAPES = {
    name: ProblemSpec(b, l, h, p, n, g, chunk_size=256, D="h", dt_bias=True,
                      dt_softplus=True, name=name)
    for name, (b, l, h, p, n, g) in {
        "130m": (8, 2048, 24, 64, 128, 1),
        "2.7b": (4, 4096, 80, 64, 128, 1),
        "long-16k": (1, 16384, 80, 64, 128, 1),
        "codestral-7b": (2, 8192, 128, 64, 128, 8),
        "small-state": (16, 1024, 32, 64, 64, 1),
    }.items()
}


def random_spec(rng, max_chunks=4) -> ProblemSpec:
    """A random valid spec of modest size (float64 reference well under a second).

    Draws q in {16, 32, 64}, 1..max_chunks chunks with l anywhere in the last one
    (often not a multiple of q; sometimes l < q), g in {1, 2, 4} with h = g * (1..3),
    p in {8, 16, 24, 32, 48, 64}, n in {8, 16, 24, 32, 64}, b in 1..3, and every
    optional feature independently (seq_idx boundaries per row, sometimes at 0 or at a
    chunk start).

    Args:
        rng: a numpy Generator (np.random.default_rng(seed)).
    """
    q = int(rng.choice([16, 32, 64]))
    c = int(rng.integers(1, max_chunks + 1))
    l = int(rng.integers((c - 1) * q + 1, c * q + 1))
    g = int(rng.choice([1, 1, 2, 4]))
    h = g * int(rng.integers(1, 4))
    b = int(rng.integers(1, 4))
    boundaries = ()
    if rng.random() < 0.4:  # per-row boundaries, drawn from random positions and chunk starts
        candidates = np.unique(np.concatenate([rng.integers(0, l, size=4), np.arange(0, l, q)]))
        rows = []
        for _ in range(b):
            k = int(rng.integers(0, min(4, len(candidates)) + 1))
            rows.append(tuple(sorted(int(t) for t in rng.choice(candidates, k, replace=False))))
        boundaries = tuple(rows)
    limit = (0.0, INF)
    if rng.random() < 0.3:
        limit = (float(rng.choice([0.0, 0.002, 0.01])), float(rng.choice([0.03, 0.1, INF])))
    return ProblemSpec(
        batch=b, seqlen=l, nheads=h, headdim=int(rng.choice([8, 16, 24, 32, 48, 64])),
        dstate=int(rng.choice([8, 16, 24, 32, 64])), ngroups=g, chunk_size=q,
        D=[None, "h", "hp"][int(rng.integers(0, 3))], z=bool(rng.random() < 0.5),
        dt_bias=bool(rng.random() < 0.5), dt_softplus=bool(rng.random() < 0.5),
        dt_limit=limit, initial_states=bool(rng.random() < 0.5),
        seq_boundaries=boundaries, name="random",
    )
