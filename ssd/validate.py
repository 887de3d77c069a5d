"""Checking the cuTile stages against the float64 reference: one copy for tests and chapters.

The GPU tests (``tests/test_gpu_kernels.py``) and the GPU chapters validate a stage the same way:

1. :func:`device_inputs` -- seeded inputs of a :class:`ssd.problem.ProblemSpec` on the GPU, the
   low-precision streams (x, z, B, C, dt) cast to the dtype under test, the rest fp32;
2. :func:`reference_of` -- the float64 reference computed from exactly those (rounded) values,
   so the error measured is the kernel's and not the cast's;
3. :func:`poisoned_outputs` -- every output buffer filled with NaN before the launch, so an
   element a kernel forgets to write makes the check fail instead of passing on stale memory;
4. :func:`check_outputs` -- two criteria per stage output, both must hold:

   * the norm: :func:`rel_err`, ‖out − ref‖ / ‖ref‖ (inf if any element is not finite), at
     most :data:`TOL` for the input dtype (:data:`TOL_CUMSUM` for stage 1);
   * every element: |out − ref| ≤ atol + rtol·|ref| (:func:`elementwise_bound`,
     :func:`check_elementwise`), which names the worst element and the tile it lies in.

   The norm alone cannot see one wrong tile of a large output: a zeroed (chunk, head) tile
   among T tiles moves it by about 1/sqrt(T), under the bf16 tolerance once T > 4,500.

Norm tolerances (per input dtype), and why:

* float32: cuTile runs fp32 MMAs in full fp32 (not TF32: measured errors are ~2e-6). The
  error is then set by exp2 / log approximations and fp32 accumulation over a chunk
  (u = 6e-8, a few hundred terms): 2e-5 is 10x the worst error the GPU tests record and still
  10,000x below what a wrong mask, decay or missing term gives (1e-1 .. 1).
* float16: inputs and the MMA operands built on chip (decay-weighted C·Bᵀ, scaled B) are
  rounded to fp16 (u = 2^-11 ≈ 4.9e-4), accumulated in fp32; a norm-wise error of about
  one u is expected (3e-4 seen): 2e-3.
* bfloat16: u = 2^-8 ≈ 3.9e-3 for each on-chip rounding; two such roundings per term
  (operand and weight) give a few e-3 in norm (2.6e-3 seen): tolerance 1.5e-2.
* The stage-1 outputs dt_out and dA_cumsum are fp32 arithmetic on rounded inputs: 1e-5.

Elementwise bounds, derived from the unit roundoff u of the input dtype and u32 = 2^-24 of fp32
(:func:`elementwise_bound`):

* An output element is a sum of K terms t_k accumulated in fp32. Each term is a product of
  values of which m were rounded to the input dtype on chip (the MMA operands the kernels build:
  dt- and decay-scaled B in ``chunk_state``, decay-weighted C·Bᵀ and the entering state in
  ``chunk_scan``), so it carries a relative error of m roundings, each uniform in [-u, u]
  (standard deviation u/sqrt(3)). Independent errors add in quadrature: the element's error has a
  standard deviation of about sqrt(m/3)·u·S, S = sqrt(Σ t_k²). The fp32 work adds up to
  (sqrt(K) + F + D)·u32·S: sqrt(K) for the accumulation, F = 4 units for the exp2, log and
  sigmoid approximations, and D = max |dA_cumsum| because a decay exp(dA_cumsum[t] −
  dA_cumsum[s]) is computed from cumulative sums as large as D, whose rounding moves the
  exponent by up to D·u32. So ε = sqrt(m/3)·u + (sqrt(K) + F + D)·u32.
* S is not known per element; for terms of random sign it is about the size of the sum itself,
  or of its neighbours where the sum cancels: S ≈ max(|ref|, scale), scale the RMS of ref over
  the element's tile (:func:`tile_scale`; for a gated y, the ungated y's times the element's
  gate). The bound allows Z = 12 standard deviations: rtol = Z·ε + u_store, atol = Z·ε·scale,
  u_store the rounding of the stored output (y in the input dtype, prev_states in the state
  dtype). The largest of 10^9 Gaussian errors is about 6 standard deviations; with the kernels'
  roundings emulated on the CPU (tests/test_validate.py) the worst element of a million also
  reached about 6 (a few dominant terms of random size make the tails heavier than Gaussian);
  12 leaves a factor of two. The scale is floored at a tenth of the whole output's RMS (a tile
  of exact zeros stays zero up to a small absolute error); dt_out's is at least 1: softplus
  forms 1 + e^x, of order 1, whatever dt' is.
* Per stage: dt_out m = 0, K = 1; dA_cumsum m = 0, K = q; states m = 1, K = q; prev_states and
  final_states m = 1, K = q + c (the carries); y m = 2, K = q + n. For y that makes rtol about
  4.2e-2 in bf16 and 5.3e-3 in fp16, and in fp32 1.3e-5 plus 7e-7 per unit of D (D <= 1.6·q
  for the test inputs' dt' <= 0.1 and |A| <= 16). Loose next to a kernel's rounding (the
  emulated kernels' worst element stays under half its bound), and more than 10x tighter than
  what a wrong tile, a decay off by one position or a dropped carry does to the elements it
  touches.

A tile is where a kernel's mistake would sit: a (batch, chunk, head) block of y, states and
prev_states; a (batch, head) block of final_states; a (batch, head, chunk) row of dt_out and
dA_cumsum. :func:`check_elementwise` reports the worst element, its tile, the largest error per
tile (relative to its bound) and how many tiles fail.

:data:`FAULTS` and :func:`inject_fault` perturb correct outputs the way a broken kernel would
(the float64 reference recomputed with the mistake, its difference added to the outputs), so that
a test can show each such mistake is caught. ``SSD_INJECT_FAULT=all`` (or a comma-separated list
of names) asks the GPU tests to check every fault on every problem they run
(:func:`requested_faults`).

Only the constants import without torch; ``DTYPES`` (name -> torch dtype) and the functions
that take tensors need it (imported on first use).
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, replace

import numpy as np

from .problem import ProblemSpec

#: The input dtypes the kernels accept, by name.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: Relative-error tolerance of every stage-2/3 output, per input dtype (see the module doc).
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}
#: Tolerance of the stage-1 outputs (dt_out, dA_cumsum): fp32 arithmetic whatever the input.
TOL_CUMSUM = 1e-5
#: Relative-error tolerance of every gradient of the backward (``ssd.autograd``), per input
#: dtype (:func:`check_gradient`). fp16 and bf16: each gradient is returned in its input's
#: dtype, and that rounding (u / sqrt(3) in norm: 2.8e-4 and 2.3e-3) dominates: an fp32 backward
#: from intermediates rounded as the forward stores them, emulated on the CPU, gives up to
#: 2.5e-4 and 1.9e-3; the forward's tolerances leave 8x. fp32: the fp32 sums over every
#: position of dA, ddt_bias and dD cancel, up to 8e-6 in that emulation at chunk 256, and the
#: backward reads stage 1's fp32 dA_cumsum, whose rounding (up to |dA_cumsum| times 2^-24) moves
#: every decay: perturbing it by 1e-6 relative, 17 units, gives up to 6e-5; 1e-4 covers both.
#: A dropped term, a wrong mask or a missing decay moves a gradient by 1e-2 or more.
GRAD_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1.5e-2}
#: Every element of a gradient may differ from the reference by this many GRAD_TOL times
#: max(|ref|, the reference's RMS): its rounding is a few u times its own size (the entering
#: states are stored in the input dtype, the result rounded to it; heavy-tailed gradients such as
#: ddt have elements far above the RMS, each with an error of its own size), at most 1.6 GRAD_TOL
#: in the CPU emulation, while a wrong or unwritten tile is off by about its own size, which the
#: norm misses once the tile is small.
GRAD_ELEMENT_FACTOR = 10.0
#: Inputs cast to the dtype under test; the others (A, D, dt_bias, initial_states) stay fp32.
LOW_PRECISION = ("x", "z", "B", "C", "dt")
#: Stage outputs in stage order (``states`` only exists with the split stage 2).
STAGE_KEYS = ("dt_out", "dA_cumsum", "states", "prev_states", "final_states", "y")

#: Unit roundoff (half an ulp at 1) of each dtype.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
#: Standard deviations the elementwise bound allows (see the module doc).
ELEMENT_Z = 12.0
#: fp32 units allowed for the on-chip exp2, log and sigmoid approximations.
FN_UNITS = 4.0
#: A tile's scale is at least this fraction of the whole output's RMS.
SCALE_FLOOR = 0.1
#: The axes that name a tile of each output (the rest of the output's axes lie inside a tile).
TILE_AXES = {"dt_out": ("b", "h", "c"), "dA_cumsum": ("b", "h", "c"), "states": ("b", "c", "h"),
             "prev_states": ("b", "c", "h"), "final_states": ("b", "h"), "y": ("b", "c", "h")}


def __getattr__(name):  # PEP 562: DTYPES needs torch, the constants above do not
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tol_for(key: str, dtype: str) -> float:
    """The norm tolerance for stage output ``key`` with inputs of ``dtype``."""
    return TOL_CUMSUM if key in ("dt_out", "dA_cumsum") else TOL[dtype]


# ------------------------------------------------------------------------------------------
# Inputs, reference, poisoned outputs


def device_inputs(spec: ProblemSpec, seed: int, dtype: str, device="cuda") -> dict:
    """Seeded inputs on ``device``: x, z, B, C, dt in ``dtype``; A, D, dt_bias, states fp32;
    seq_idx int32. Returns a dict of torch tensors keyed as ``spec.make_inputs``."""
    import torch

    out = {}
    for name, arr in spec.make_inputs(seed).items():
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
        if name == "seq_idx":
            out[name] = t.to(torch.int32)
        else:
            out[name] = t.to(getattr(torch, dtype) if name in LOW_PRECISION else torch.float32)
    return out


def host_inputs(inputs: dict) -> dict:
    """The inputs as NumPy arrays on the host: floats in float64 (exactly the values the
    kernels read), integers as they are."""
    return {k: as_float64(v) if v.is_floating_point() else v.cpu().numpy()
            for k, v in inputs.items()}


def reference_of(spec: ProblemSpec, inputs: dict) -> dict:
    """The float64 reference (every stage, see ``ProblemSpec.reference``) computed from
    exactly the values the kernels read."""
    return spec.reference(host_inputs(inputs))


def poisoned_outputs(spec: ProblemSpec, dtype: str, split: bool, state_dtype="float32",
                     device="cuda", groups=1, entering=True) -> dict:
    """NaN-filled output buffers for every stage, shaped as the stages write them:
    dt_out, dA_cumsum (b,h,c,q) fp32; prev_states (b,c,h,p,n) in ``state_dtype`` (unless not
    ``entering``: the one-kernel stages 2 and 3 store no entering state);
    final_states (b,h,p,n) fp32; y (b,l,h,p) in ``dtype``; with ``split`` also states
    (b,c,h,p,n) fp32; with ``groups`` > 1 also chunk_decay (b,h,c,DECAY_ROW) fp32 and group_enter
    (b,groups,h,p,n) in ``state_dtype``."""
    import torch

    b, l, h, p, n, g = spec.dims
    c, q = spec.nchunks, spec.chunk_size
    nan = dict(fill_value=float("nan"), device=device)
    out = {
        "dt_out": torch.full((b, h, c, q), dtype=torch.float32, **nan),
        "dA_cumsum": torch.full((b, h, c, q), dtype=torch.float32, **nan),
        "prev_states": torch.full((b, c, h, p, n), dtype=getattr(torch, state_dtype), **nan),
        "final_states": torch.full((b, h, p, n), dtype=torch.float32, **nan),
        "y": torch.full((b, l, h, p), dtype=getattr(torch, dtype), **nan),
    }
    if not entering:
        del out["prev_states"]
    if split:
        out["states"] = torch.full((b, c, h, p, n), dtype=torch.float32, **nan)
    if groups > 1:
        from .kernels.tiles import DECAY_ROW

        out["chunk_decay"] = torch.full((b, h, c, DECAY_ROW), dtype=torch.float32, **nan)
        out["group_enter"] = torch.full((b, groups, h, p, n), dtype=getattr(torch, state_dtype), **nan)
    return out


@contextlib.contextmanager
def poisoned_memory():
    """Within the block, ``torch.empty`` (and every allocation that leaves memory uninitialised)
    fills floats with NaN: PyTorch's deterministic mode with ``fill_uninitialized_memory``, for
    the output buffers a launcher allocates itself (the backward's). warn_only, so that an
    operation without a deterministic implementation warns instead of failing (those warnings
    are silenced: the values are what is checked)."""
    import torch
    import torch.utils.deterministic

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


def as_float64(out) -> np.ndarray:
    """A torch tensor (any device, any float dtype) or an array as a float64 NumPy array."""
    if isinstance(out, np.ndarray):
        return out.astype(np.float64, copy=False)
    return out.detach().double().cpu().numpy()


# ------------------------------------------------------------------------------------------
# The norm criterion


def rel_err(out, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius; ‖ref‖ = 0 counts as 1); inf if ``out`` has a
    non-finite element (an unwritten, NaN-poisoned one or an overflow). ``out``: a torch
    tensor or a NumPy array."""
    o = as_float64(out)
    if not np.isfinite(o).all():
        return math.inf  # an unwritten (NaN-poisoned) or overflowed element
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(o - ref) / (denom if denom > 0 else 1.0))


# ------------------------------------------------------------------------------------------
# The elementwise criterion


@dataclass(frozen=True)
class Bound:
    """|out − ref| ≤ atol + rtol·|ref| per element, atol = ``arel`` times the element's tile
    scale (see the module doc). ``eps`` is the error per unit S of one element (one standard
    deviation); ``m``, ``K`` and ``decay`` (= D) are the inputs of its derivation."""

    key: str
    dtype: str
    rtol: float
    arel: float
    eps: float
    m: int
    K: int
    decay: float


def _stage_model(key: str, q: int, n: int, c: int) -> tuple[int, int, bool]:
    """(m roundings to the input dtype per term, K fp32 terms, whether decays enter)."""
    return {"dt_out": (0, 1, False), "dA_cumsum": (0, q, False), "states": (1, q, True),
            "prev_states": (1, q + c, True), "final_states": (1, q + c, True),
            "y": (2, q + n, True)}[key]


def elementwise_bound(key: str, dtype: str, *, chunk_size: int, dstate: int, nchunks: int,
                      decay: float = 0.0, state_dtype: str | None = None) -> Bound:
    """The elementwise bound of stage output ``key`` for inputs of ``dtype``.

    Args:
        key: a stage output (:data:`STAGE_KEYS`).
        dtype: the input dtype's name.
        chunk_size, dstate, nchunks: q, n and c of the problem.
        decay: D = max |dA_cumsum| of the problem (the largest cumulative log-decay).
        state_dtype: the dtype prev_states is stored in (default: fp32).
    """
    u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF["float32"]
    m, K, decays = _stage_model(key, chunk_size, dstate, nchunks)
    D = float(decay) if decays else 0.0
    eps = math.sqrt(m / 3) * u + (math.sqrt(K) + FN_UNITS + D) * u32
    store = {"y": dtype, "prev_states": state_dtype or "float32"}.get(key, "float32")
    return Bound(key, dtype, rtol=ELEMENT_Z * eps + UNIT_ROUNDOFF[store], arel=ELEMENT_Z * eps,
                 eps=eps, m=m, K=K, decay=D)


def bound_for(key: str, dtype: str, spec: ProblemSpec, ref: dict,
              state_dtype: str | None = None) -> Bound:
    """:func:`elementwise_bound` for ``spec``, D read from the reference's dA_cumsum."""
    return elementwise_bound(key, dtype, chunk_size=spec.chunk_size, dstate=spec.dstate,
                             nchunks=spec.nchunks, decay=float(np.abs(ref["dA_cumsum"]).max()),
                             state_dtype=state_dtype)


def _tiled(key: str, a: np.ndarray, q: int, fill=np.nan) -> np.ndarray:
    """``a`` as (tile grid..., elements of a tile): y (b, l, h, p) -> (b, c, h, q·p), padded with
    ``fill`` past l; states (b, c, h, p, n) -> (b, c, h, p·n); final_states (b, h, p, n) -> (b, h,
    p·n); dt_out (b, h, c, q) as it is. Other keys: one tile per leading index."""
    if key == "y":
        b, l, h, p = a.shape
        c = -(-l // q)
        a = np.concatenate([a, np.full((b, c * q - l, h, p), fill)], axis=1)
        return a.reshape(b, c, q, h, p).transpose(0, 1, 3, 2, 4).reshape(b, c, h, q * p)
    if key in ("states", "prev_states"):
        return a.reshape(a.shape[:3] + (-1,))
    if key == "final_states":
        return a.reshape(a.shape[:2] + (-1,))
    if key in ("dt_out", "dA_cumsum"):
        return a
    return a.reshape(a.shape[0], -1)


def tile_of(key: str, index: tuple, q: int) -> tuple:
    """The tile (as :data:`TILE_AXES` names it) that holds element ``index`` of output ``key``."""
    if key == "y":
        b, t, h, _ = index
        return (int(b), int(t) // q, int(h))
    width = len(TILE_AXES.get(key, ("b",)))
    return tuple(int(i) for i in index[:width])


def tile_scale(key: str, ref: np.ndarray, q: int, gate: np.ndarray | None = None) -> np.ndarray:
    """Each element's scale (see the module doc), shaped as ``ref``: the RMS of ``ref`` over the
    element's tile, at least :data:`SCALE_FLOOR` of the whole output's RMS (and at least 1 for
    dt_out). For y with a gate g = silu(z) (``gate``, shaped as y), the tile's RMS is that of the
    ungated y = ref / g (from the elements where |g| >= 0.05), times the element's |g|: one
    element's gate can be 20x its tile's typical one."""
    whole = math.sqrt(float(np.mean(np.square(ref)))) if ref.size else 0.0
    values = ref
    if key == "y" and gate is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.where(np.abs(gate) >= 0.05, ref / gate, np.nan)
    tiles = _tiled(key, values, q)
    with warnings.catch_warnings():  # a tile with no element to average (all gates ~0): 0
        warnings.simplefilter("ignore", RuntimeWarning)
        rms = np.nan_to_num(np.sqrt(np.nanmean(np.square(tiles), axis=-1)), nan=0.0)
    scale = np.broadcast_to(rms[..., None], tiles.shape)
    if key == "y":  # back to (b, l, h, p)
        b, l, h, p = ref.shape
        c = tiles.shape[1]
        scale = scale.reshape(b, c, h, q, p).transpose(0, 1, 3, 2, 4).reshape(b, c * q, h, p)
        scale = scale[:, :l]
        if gate is not None:
            scale = scale * np.abs(gate)
    scale = np.maximum(scale.reshape(ref.shape), SCALE_FLOOR * whole)
    return np.maximum(scale, 1.0) if key == "dt_out" else scale


@dataclass(frozen=True)
class ElementCheck:
    """The elementwise comparison of one output: ``ratio`` is the worst |out − ref| / bound
    (> 1 fails; inf for a non-finite element) at ``index``, which lies in ``tile``;
    ``tile_ratio`` holds the worst ratio of every tile (axes :attr:`tile_axes`)."""

    key: str
    bound: Bound
    ratio: float
    index: tuple
    out: float
    ref: float
    tile: tuple
    tile_axes: tuple
    tile_ratio: np.ndarray
    bad_tiles: int

    @property
    def ok(self) -> bool:
        return self.ratio <= 1.0

    @property
    def tiles(self) -> int:
        return int(self.tile_ratio.size)

    def describe(self) -> str:
        """One line naming the worst element and its tile (for an assertion message)."""
        tile = ", ".join(f"{a}={i}" for a, i in zip(self.tile_axes, self.tile))
        return (f"{self.key}{list(self.index)} = {self.out:.6g}, reference {self.ref:.6g}: "
                f"{self.ratio:.3g}x its bound (atol {self.bound.arel:.2e}·scale, rtol "
                f"{self.bound.rtol:.2e}); tile ({tile}), {self.bad_tiles} of {self.tiles} "
                f"tiles fail")

    def fields(self) -> dict:
        """The entries a GPU test records for this check (JSON-ready)."""
        return dict(elem_ratio=self.ratio, elem_index=list(self.index),
                    elem_tile=list(self.tile), bad_tiles=self.bad_tiles, rtol=self.bound.rtol,
                    atol_rel=self.bound.arel)


def check_elementwise(key: str, out, ref: np.ndarray, bound: Bound, chunk_size: int,
                      gate: np.ndarray | None = None) -> ElementCheck:
    """Compare ``out`` (torch tensor or array) with the float64 ``ref`` element by element.

    Every element must satisfy |out − ref| ≤ bound.arel·scale + bound.rtol·|ref|, scale from
    :func:`tile_scale` (``gate``: silu(z) for y, if the problem has z); a non-finite element
    fails (ratio inf). Returns the worst element and tile (see :class:`ElementCheck`)."""
    o = as_float64(out)
    if o.shape != ref.shape:
        raise ValueError(f"{key}: output shape {o.shape} != reference shape {ref.shape}")
    err = np.abs(o - ref)
    allowed = bound.arel * tile_scale(key, ref, chunk_size, gate) + bound.rtol * np.abs(ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / allowed)  # 0 / 0: exact; x / 0: inf
    ratio = np.where(np.isfinite(o), ratio, np.inf)
    flat = int(np.argmax(ratio)) if ratio.size else 0
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape)) if ratio.size else ()
    tile_ratio = np.nanmax(_tiled(key, ratio, chunk_size, fill=0.0), axis=-1)
    worst = float(ratio[index]) if ratio.size else 0.0
    return ElementCheck(key, bound, worst, index, float(o[index]) if o.size else 0.0,
                        float(ref[index]) if ref.size else 0.0, tile_of(key, index, chunk_size),
                        TILE_AXES.get(key, ("b",)), tile_ratio, int((tile_ratio > 1.0).sum()))


@dataclass(frozen=True)
class StageCheck:
    """Both criteria on one stage output."""

    key: str
    rel_err: float
    tol: float
    elem: ElementCheck

    @property
    def ok_norm(self) -> bool:
        return self.rel_err <= self.tol

    @property
    def ok(self) -> bool:
        return self.ok_norm and self.elem.ok

    def failure(self) -> str:
        """What failed ('' if nothing did)."""
        parts = []
        if not self.ok_norm:
            parts.append(f"{self.key}: rel err {self.rel_err:.3e} > {self.tol:.0e}")
        if not self.elem.ok:
            parts.append(self.elem.describe())
        return "; ".join(parts)

    def fields(self) -> dict:
        return dict(rel_err=self.rel_err, tol=self.tol, **self.elem.fields())


def check_outputs(spec: ProblemSpec, got: dict, ref: dict, dtype: str,
                  state_dtype: str | None = None, z=None) -> dict:
    """Both criteria on every output in ``got``: {key: :class:`StageCheck`}.

    Args:
        got: outputs (torch tensors or arrays) keyed as :data:`STAGE_KEYS`; ref: the reference.
        dtype: the input dtype; state_dtype: prev_states' storage dtype (default fp32).
        z: the gate input, if the problem has one (tensor or array): y's scale follows silu(z).
    """
    from .reference import silu

    gate = None if z is None else silu(as_float64(z))
    return {key: StageCheck(key, rel_err(out, ref[key]), tol_for(key, dtype),
                            check_elementwise(key, out, ref[key],
                                              bound_for(key, dtype, spec, ref, state_dtype),
                                              spec.chunk_size, gate if key == "y" else None))
            for key, out in got.items()}


def check_varlen_states(spec: ProblemSpec, out, want: np.ndarray, ref: dict, dtype: str,
                        state_dtype: str | None = None) -> StageCheck:
    """Both criteria on each packed sequence's final state (the forward's varlen_states,
    (num_sequences, h, p, n)) against ``want``, the reference's
    (:func:`ssd.reference.chunk_state_varlen` on ``ref``'s intermediates).

    One tile per (sequence, head), as final_states has one per (batch, head); the norm tolerance
    of the dtype; the elementwise bound of prev_states (m = 1, K = q + c, and the rounding of
    the stored state, ``state_dtype``): each is an entering state as stage 2 stored it, decayed,
    plus one chunk's writes, in fp32."""
    elem = check_elementwise("final_states", out, want,
                             bound_for("prev_states", dtype, spec, ref, state_dtype),
                             spec.chunk_size)
    return StageCheck("varlen_states", rel_err(out, want), TOL[dtype],
                      replace(elem, key="varlen_states"))


@dataclass(frozen=True)
class GradientCheck:
    """One gradient against the reference: the norm (:func:`rel_err` <= ``tol``) and the worst
    element (``elem_ratio``: the largest error over GRAD_ELEMENT_FACTOR x tol x max(|ref|, the
    reference's RMS), at most 1; inf where an element is not finite)."""

    key: str
    rel_err: float
    tol: float
    elem_ratio: float
    elem_index: tuple

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tol and self.elem_ratio <= 1.0

    def failure(self) -> str:
        return (f"{self.key}: relative error {self.rel_err:.3e} (tolerance {self.tol:.0e}), worst "
                f"element {self.elem_index} at {self.elem_ratio:.3g}x its bound")

    def fields(self) -> dict:
        return dict(stage=self.key, rel_err=self.rel_err, tol=self.tol,
                    elem_ratio=self.elem_ratio, elem_index=list(self.elem_index))


def check_gradient(key: str, out, ref: np.ndarray, dtype: str, scale=None) -> GradientCheck:
    """Both criteria on one gradient (a torch tensor or an array) against its float64
    reference, for inputs of ``dtype`` (:data:`GRAD_TOL`, :data:`GRAD_ELEMENT_FACTOR`).
    ``scale``: for a gradient of :data:`SUMMED`, the 2-norm of its terms (:func:`sum_scales`),
    shaped like it; both criteria then measure the error against max(|ref|, scale)."""
    o = as_float64(out)
    if o.shape != ref.shape:
        raise ValueError(f"{key}: shape {o.shape}, the reference's is {ref.shape}")
    tol = GRAD_TOL[dtype]
    err = np.abs(o - ref)
    if not np.isfinite(err).all():
        index = tuple(int(i) for i in np.argwhere(~np.isfinite(err))[0])
        return GradientCheck(key, math.inf, tol, math.inf, index)
    size = np.abs(ref) if scale is None else np.maximum(np.abs(ref), scale)
    denom = float(np.linalg.norm(size))
    norm = float(np.linalg.norm(err)) / (denom if denom > 0 else 1.0)
    if not err.size:
        return GradientCheck(key, norm, tol, 0.0, ())
    rms = float(np.sqrt(np.mean(size ** 2)))
    ratio = err / (GRAD_ELEMENT_FACTOR * tol * np.maximum(size, rms if rms > 0 else 1.0))
    index = tuple(int(i) for i in np.unravel_index(np.argmax(ratio), ratio.shape))
    return GradientCheck(key, norm, tol, float(ratio[index]), index)


#: The gradients that sum a term over every position, per head (and channel): a sum of rounded
#: terms is off by about the rounding times the 2-norm of its terms, whatever cancellation
#: leaves of the sum, so :func:`check_gradient` measures them against that norm where it is the
#: larger (:func:`sum_scales`). In bf16, random shapes with one or two heads saw dA at 1.9e-2 of
#: its value and 0.13 of its element bound, its terms cancelling; a dropped term or a wrong mask
#: moves the sum by a term's size, far above the terms' norm times GRAD_TOL.
SUMMED = ("dA", "ddt_bias", "dD")


def sum_scales(spec: ProblemSpec, inputs: dict, dy, want: dict) -> dict:
    """{key: the 2-norm of the terms it sums, shaped like it} for each gradient of
    :data:`SUMMED` that ``want`` holds (``ProblemSpec.reference_backward``'s result, with its
    intermediates), from the values the kernels read (``inputs``: tensors; ``dy``: a tensor, or
    None for none):
    ddt_bias sums the per-position ddt; dA sums ddA_cumsum times the cumulative dt' of its chunk
    (the adjoint of dA_cumsum = cumsum(A dt')); dD sums dy silu(z) x over the positions (and
    over the channels, for a per-head D)."""
    from .reference import silu

    host = host_inputs(inputs)
    out = {}
    if "ddt_bias" in want:
        out["ddt_bias"] = np.sqrt(np.sum(want["ddt"] ** 2, axis=(0, 1)))
    if "dA" in want:
        dt_out = spec.reference(host)["dt_out"]  # (b, h, c, q)
        terms = want["ddA_cumsum"] * np.cumsum(dt_out, axis=-1)
        out["dA"] = np.sqrt(np.sum(terms ** 2, axis=(0, 2, 3)))
    if "dD" in want:
        dy = np.zeros(host["x"].shape) if dy is None else as_float64(dy)
        if "z" in host:
            dy = dy * silu(host["z"])
        axes = (0, 1, 3) if want["dD"].ndim == 1 else (0, 1)
        out["dD"] = np.sqrt(np.sum((dy * host["x"]) ** 2, axis=axes))
    return out


# ------------------------------------------------------------------------------------------
# Running the forward


def run_stages(spec: ProblemSpec, inputs: dict, dtype: str, config) -> dict:
    """Run the whole forward (``ssd.api.forward_stages``) into poisoned buffers and return
    every stage output (a dict keyed as :data:`STAGE_KEYS`), after a synchronize."""
    import torch

    from .api import forward_stages, takes_fused_scan
    from .kernels.state_passing import chunks_per_group

    if takes_fused_scan(config, inputs.get("seq_idx")):
        outputs = poisoned_outputs(spec, dtype, split=False, entering=False)
    else:
        outputs = poisoned_outputs(spec, dtype, split=not config.state.fused,
                                   state_dtype=config.state.storage_dtype(dtype),
                                   groups=config.state.groups)
    r = forward_stages(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"],
                       spec.chunk_size, D=inputs.get("D"), z=inputs.get("z"),
                       dt_bias=inputs.get("dt_bias"), initial_states=inputs.get("initial_states"),
                       seq_idx=inputs.get("seq_idx"), dt_softplus=spec.dt_softplus,
                       dt_limit=spec.dt_limit, config=config, outputs=outputs)
    torch.cuda.synchronize()
    for key, buf in outputs.items():
        assert r[key] is buf, f"{key}: the stage did not write into the buffer it was given"
    if config.state.groups > 1:
        # The grouped walk's states start from zero at each group: checked as the entering
        # states chunk_scan forms from them, prev_states[c] + chunk_decay[c] group_enter[g(c)].
        cpg = chunks_per_group(spec.nchunks, config.state.groups)
        g_of = torch.arange(spec.nchunks, device=r["prev_states"].device) // cpg
        row = r.pop("chunk_decay")   # (b, h, c, DECAY_ROW): the carry repeated along the row
        assert torch.equal(row, row[..., :1].expand_as(row)), "chunk_decay: a row holds one carry"
        decay = row[..., 0].double().permute(0, 2, 1)[..., None, None]  # (b, c, h, 1, 1)
        r["prev_states"] = r["prev_states"].double() + decay * r.pop("group_enter").double()[:, g_of]
    return r


def stage_errors(spec: ProblemSpec, dtype: str, config, seed: int) -> dict:
    """Inputs, reference, one forward into poisoned buffers: {stage key: rel err}."""
    inputs = device_inputs(spec, seed, dtype)
    ref = reference_of(spec, inputs)
    got = run_stages(spec, inputs, dtype, config)
    return {key: rel_err(got[key], ref[key]) for key in got}


# ------------------------------------------------------------------------------------------
# Injected faults


#: The mistakes :func:`inject_fault` can put into correct outputs, and what each models.
FAULTS = {
    "tile-unwritten": "one tile of one output never written (it keeps the NaN it was poisoned "
                      "with)",
    "tile-zero": "one tile of one output written as zeros (a skipped block, a stale buffer)",
    "decay-off-by-one": "stages 2 and 3 read one chunk's cumulative decay one position late",
    "carry-dropped": "one (batch, head)'s state not carried across one chunk border",
    "padding-leak": "the last partial chunk's padded positions get a step dt' > 0 (one batch "
                    "row and head), so the state decays past the sequence end",
}
#: The faults that hit one tile of one output (the output is named with ``target``).
TILE_FAULTS = ("tile-unwritten", "tile-zero")


def requested_faults(env: str | None = None) -> tuple:
    """The faults ``SSD_INJECT_FAULT`` asks for: "" or unset -> none; "all" -> every one in
    :data:`FAULTS`; otherwise a comma-separated list of names (an unknown name raises)."""
    value = (os.environ.get("SSD_INJECT_FAULT", "") if env is None else env).strip()
    if not value:
        return ()
    if value == "all":
        return tuple(FAULTS)
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [v for v in names if v not in FAULTS]
    if unknown:
        raise ValueError(f"SSD_INJECT_FAULT: unknown fault {unknown[0]!r}; one of "
                         f"{', '.join(FAULTS)} or 'all'")
    return names


@dataclass(frozen=True)
class Injected:
    """Outputs with one fault in them (float64 arrays keyed as the outputs given), the outputs
    that changed, the tile the fault sits in (axes ``tile_axes``), and ``wrong``: what the
    changed outputs would be with the fault and no rounding at all (the float64 reference with
    the same mistake)."""

    fault: str
    outputs: dict
    changed: tuple
    tile: tuple
    tile_axes: tuple
    wrong: dict


def _with_tile(key: str, a: np.ndarray, tile: tuple, value: float, q: int) -> np.ndarray:
    """A copy of output ``a`` with tile ``tile`` (see :data:`TILE_AXES`) set to ``value``."""
    view = _tiled(key, a.copy(), q, fill=0.0)
    view[tile] = value
    if key == "y":
        b, l, h, p = a.shape
        c = view.shape[1]
        return view.reshape(b, c, h, q, p).transpose(0, 1, 3, 2, 4).reshape(b, c * q, h, p)[:, :l]
    return view.reshape(a.shape)


def _stages_from(spec: ProblemSpec, host: dict, dt_out, dA_cumsum, states=None) -> dict:
    """Stages 2 and 3 of the float64 reference from the given stage-1 outputs (and states)."""
    from .reference import chunk_scan, chunk_state, state_passing

    get = host.get
    if states is None:
        states = chunk_state(host["B"], host["x"], dt_out, dA_cumsum, get("seq_idx"))
    prev, final = state_passing(states, dA_cumsum, get("initial_states"), get("seq_idx"),
                                spec.chunk_size)
    y = chunk_scan(host["B"], host["C"], host["x"], dt_out, dA_cumsum, prev, get("D"), get("z"),
                   get("seq_idx"))
    return {"dt_out": dt_out, "dA_cumsum": dA_cumsum, "states": states, "prev_states": prev,
            "final_states": final, "y": y}


def inject_fault(fault: str, spec: ProblemSpec, host: dict, ref: dict, got: dict, seed: int = 0,
                 target: str = "y") -> Injected | None:
    """``got`` with ``fault`` (a name in :data:`FAULTS`) put in, or None where the problem
    cannot show it (padding-leak without a partial chunk, carry-dropped with nothing to carry).

    The non-tile faults recompute the float64 reference with the mistake and add its difference
    from ``ref`` to ``got``, so the outputs keep the kernels' own rounding.

    Args:
        host: the inputs as float64 arrays (:func:`host_inputs`); ref: their reference.
        got: the outputs (torch tensors or arrays), keyed as :data:`STAGE_KEYS`.
        seed: picks the tile a tile fault hits (among those whose RMS is at least
            :data:`SCALE_FLOOR` of the output's) and the (batch, head) of padding-leak.
            decay-off-by-one hits the chunk that decays most, carry-dropped the border and
            (batch, head) whose carry is the largest share of the state.
        target: the output a tile fault hits.
    """
    if fault not in FAULTS:
        raise ValueError(f"fault: unknown {fault!r}; one of {', '.join(FAULTS)}")
    rng = np.random.default_rng(seed)
    out = {k: as_float64(v) for k, v in got.items()}
    b, l, h, p, n, g = spec.dims
    q, c = spec.chunk_size, spec.nchunks
    if fault in TILE_FAULTS:
        if target not in out:
            return None
        rms = np.sqrt(np.nanmean(np.square(_tiled(target, ref[target], q)), axis=-1))
        live = np.argwhere(rms > SCALE_FLOOR * np.sqrt(np.mean(np.square(ref[target]))))
        if not len(live):
            return None
        tile = tuple(int(i) for i in live[rng.integers(len(live))])
        value = np.nan if fault == "tile-unwritten" else 0.0
        out[target] = _with_tile(target, out[target], tile, value, q)
        return Injected(fault, out, (target,), tile, TILE_AXES[target],
                        {target: _with_tile(target, ref[target], tile, value, q)})
    dt_out, dA = ref["dt_out"], ref["dA_cumsum"]
    if fault == "decay-off-by-one":
        ci = int(np.argmax(np.abs(dA[..., -1]).sum(axis=(0, 1))))  # the chunk that decays most
        late = dA.copy()
        late[:, :, ci, 1:] = dA[:, :, ci, :-1]
        late[:, :, ci, 0] = 0.0
        wrong = _stages_from(spec, host, dt_out, late)
        wrong["dA_cumsum"] = dA                          # chunk_cumsum itself was right
        tile, axes = (ci,), ("c",)
    elif fault == "carry-dropped":
        # prev_states[k] = carry + states[k - 1] (k = c: final_states): take the carry out of
        # chunk k - 1's state and let the scan run on from there. At the border and (batch,
        # head) that lose the largest share of their entering state: a head whose state decays
        # to nothing within a chunk carries nothing to lose.
        entering = np.concatenate([ref["prev_states"][:, 1:], ref["final_states"][:, None]],
                                  axis=1)                # (b, c, h, p, n): entering chunk k = 1..c
        carried = entering - ref["states"]
        size = np.linalg.norm(entering, axis=(3, 4))      # (b, c, h), floored as tile_scale
        size = np.maximum(size, SCALE_FLOOR * np.sqrt(np.mean(np.square(size))))
        share = np.linalg.norm(carried, axis=(3, 4)) / np.maximum(size, 1e-300)
        bi, k1, hi = (int(i) for i in np.unravel_index(np.argmax(share), share.shape))
        if not share[bi, k1, hi] > 0:
            return None
        states = ref["states"].copy()
        states[bi, k1, hi] -= carried[bi, k1, hi]
        wrong = _stages_from(spec, host, dt_out, dA, states=states)
        wrong["states"] = ref["states"]                  # chunk_state itself was right
        tile, axes = (bi, k1 + 1, hi), ("b", "c", "h")
    elif fault == "padding-leak":
        bi, hi = int(rng.integers(b)), int(rng.integers(h))
        valid = l - (c - 1) * q
        if valid == q:
            return None
        leak = dt_out.copy()
        leak[bi, hi, c - 1, valid:] = dt_out[(bi + 1) % b, hi, 0, : q - valid]
        if not leak[bi, hi, c - 1, valid:].any():
            return None
        dA_leak = np.cumsum(leak * host["A"][None, :, None, None], axis=-1)
        wrong = _stages_from(spec, host, leak, dA_leak)
        tile, axes = (bi, hi, c - 1), ("b", "h", "c")
    changed = [key for key in out if np.abs(wrong[key] - ref[key]).max() > 0]
    if not changed:
        return None
    for key in changed:
        out[key] = out[key] + (wrong[key] - ref[key])
    return Injected(fault, out, tuple(changed), tile, axes, {k: wrong[k] for k in changed})


def check_faults(spec: ProblemSpec, host: dict, ref: dict, got: dict, dtype: str,
                 faults=tuple(FAULTS), state_dtype: str | None = None, seed: int = 0) -> list:
    """Put each of ``faults`` into correct outputs ``got`` (a tile fault into each output in
    turn) and run both criteria (:func:`check_outputs`) on the result.

    Returns one dict per fault and target: fault, target (the output a tile fault hit, or
    "stages"), applicable (False where the problem cannot show the fault; nothing else then),
    changed (the outputs it changed), tile (where it was put), visible (whether the fault breaks
    the elementwise bound even with no rounding: the float64 reference with the fault; a
    carry that decays to 1e-9 within a chunk, dropped, is not), caught_norm, caught_elem,
    caught_by (the outputs whose elementwise check failed), elem_ratio and elem_tile (the worst
    element's ratio to its bound, and its tile, over the outputs), and for a tile fault named
    (whether the target's worst tile is the one the fault hit)."""
    rows = []
    clean = check_outputs(spec, got, ref, dtype, state_dtype, z=host.get("z"))
    for fault in faults:
        targets = [k for k in STAGE_KEYS if k in got] if fault in TILE_FAULTS else ["stages"]
        for target in targets:
            injected = inject_fault(fault, spec, host, ref, got, seed=seed,
                                    target=target if fault in TILE_FAULTS else "y")
            row = dict(fault=fault, target=target, applicable=injected is not None)
            if injected is None:
                rows.append(row)
                continue
            changed = {k: injected.outputs[k] for k in injected.changed}
            checks = {**clean, **check_outputs(spec, changed, ref, dtype, state_dtype,
                                               z=host.get("z"))}
            exact = check_outputs(spec, injected.wrong, ref, dtype, state_dtype, z=host.get("z"))
            worst = max(checks.values(), key=lambda ch: ch.elem.ratio)
            row.update(changed=list(injected.changed), tile=list(injected.tile),
                       visible=any(not ch.elem.ok for ch in exact.values()),
                       caught_norm=any(not ch.ok_norm for ch in checks.values()),
                       caught_elem=any(not ch.elem.ok for ch in checks.values()),
                       caught_by=[k for k, ch in checks.items() if not ch.elem.ok],
                       elem_ratio=worst.elem.ratio, elem_tile=list(worst.elem.tile))
            if fault in TILE_FAULTS:
                row["named"] = checks[target].elem.tile == injected.tile
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------
# The decode step (ssd.kernels.state_update)

#: Norm tolerance of a decode-step output by the dtype it is stored in. Every element is one
#: fp32 result rounded once to that dtype, so its relative error is about one unit roundoff:
#: twice the unit for bf16 (3.9e-3) and fp16 (4.9e-4); for fp32, 1e-5, 168 units of fp32 for the
#: arithmetic (exp2, softplus, a sum over n), where a missing decay, a wrong group or a lost gate
#: moves the output by 1e-3 or more.
STEP_TOL = {"float32": 1e-5, "bfloat16": 8e-3, "float16": 1e-3}
#: The smallest normal number of each dtype.
SMALLEST_NORMAL = {"float32": 2.0**-126, "bfloat16": 2.0**-126, "float16": 2.0**-14}


@dataclass(frozen=True)
class StepBounds:
    """Per-element bounds on |out − ref| of the decode step: y (b, h, p); state (b, h, p, n),
    of the state rows the batch entries advance (``rows``, -1 for padding, whose y bound is 0:
    the kernel stores an exact 0)."""

    y: np.ndarray
    state: np.ndarray
    rows: np.ndarray


def step_bounds(host: dict, dt_softplus: bool, dt_limit, dtype: str,
                state_dtype: str) -> StepBounds:
    """The elementwise bounds of the decode step whose float64 inputs are ``host`` (the keyword
    arguments of :func:`ssd.reference.selective_state_update`), y stored in ``dtype`` and the
    state in ``state_dtype``.

    Derived, not fitted: the kernel reads the inputs exactly and computes in fp32 (u = 2^-24),
    each exp2 / exp / log / division within FN_UNITS units. Worst case per element:

    * dt': the bias add, 1 u; softplus (log(1 + e) e / ((1 + e) - 1), e = exp(v)) adds an exp,
      a log and 2 u, and passes the sum's rounding on scaled by |v| at most (v = dt + dt_bias;
      softplus(v) ≈ e^v below 0): E_d = (2 FN_UNITS + 3 + |v|) u.
    * the decay a = 2^(dt' A log2 e): its exponent is off by |dt' A| (E_d + 3 u) (two products
      and log2 e rounded), exp2 by FN_UNITS u: E_a = |dt' A| (E_d + 3 u) + FN_UNITS u.
    * the new state h = a h0 + dt' x B: E_s = |a h0| (E_a + u) + |dt' x B| (E_d + 2 u) + u |h|;
      stored: u_s |h| + (1 + u_s) E_s.
    * y = Σ_n h_n C_n + D x, from the fp32 state: Σ_n |C_n| E_s,n + (n + 1) u Σ_n |h_n C_n|
      (a sum of n terms) + 3 u |D x|; the gate silu(z) = z / (1 + e^-z) adds FN_UNITS + 3 u of
      |y|; stored: u_y |y| + (1 + u_y) E_y.
    * each stored value also may be off by the smallest normal number of its dtype (SMALLEST_NORMAL):
      below it a value is stored as a subnormal, or flushed to zero, an absolute error.
    """
    from . import reference as R

    u = UNIT_ROUNDOFF["float32"]
    u_y, u_s = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[state_dtype]
    ops, dims = R.step_operands(**host, dt_softplus=dt_softplus, dt_limit=dt_limit)
    h1, _ = R.recurrence_step(ops.state, ops.x, ops.dt, ops.A, ops.B, ops.C)  # (b, h, p, n)
    dt = ops.dt
    if dt_softplus:
        E_d = (2 * FN_UNITS + 3 + np.abs(ops.v)) * u
    else:
        E_d = np.full(dt.shape, u)
    dtA = np.abs(dt[..., None] * ops.A)  # (b, h, p, n)
    E_a = dtA * (E_d[..., None] + 3 * u) + FN_UNITS * u
    decayed = np.abs(np.exp(dt[..., None] * ops.A) * ops.state)
    written = np.abs((dt * ops.x)[..., None] * ops.B[:, :, None, :])
    E_s = decayed * (E_a + u) + written * (E_d[..., None] + 2 * u) + u * np.abs(h1)
    state = u_s * np.abs(h1) + (1 + u_s) * E_s + SMALLEST_NORMAL[state_dtype]
    C = np.abs(ops.C)[:, :, None, :]  # (b, h, 1, n)
    y_pre = np.einsum("bhpn,bhn->bhp", h1, ops.C)
    E_y = (np.sum(C * E_s, axis=-1) + (dims["n"] + 1) * u * np.sum(np.abs(h1) * C, axis=-1))
    if ops.D is not None:
        skip = ops.D * ops.x
        E_y = E_y + 3 * u * np.abs(skip)
        y_pre = y_pre + skip
    if ops.z is not None:
        gate = np.abs(R.silu(ops.z))
        E_y = gate * E_y + (FN_UNITS + 3) * u * gate * np.abs(y_pre)
        y_pre = y_pre * R.silu(ops.z)
    y = u_y * np.abs(y_pre) + (1 + u_y) * E_y + SMALLEST_NORMAL[dtype]
    y[ops.rows < 0] = 0.0
    return StepBounds(y=y, state=state, rows=ops.rows)


@dataclass(frozen=True)
class StepCheck:
    """Both criteria on one output of the decode step: the norm (``rel_err`` <= ``tol``) and
    every element within its bound (``ratio``, the worst |out − ref| / bound, <= 1; inf for a
    non-finite element), the worst at ``index``."""

    key: str
    rel_err: float
    tol: float
    ratio: float
    index: tuple
    out: float
    ref: float

    @property
    def ok(self) -> bool:
        return self.rel_err <= self.tol and self.ratio <= 1.0

    def failure(self) -> str:
        """What failed ('' if nothing did)."""
        parts = []
        if self.rel_err > self.tol:
            parts.append(f"{self.key}: rel err {self.rel_err:.3e} > {self.tol:.0e}")
        if self.ratio > 1.0:
            parts.append(f"{self.key}{list(self.index)} = {self.out:.6g}, reference "
                         f"{self.ref:.6g}: {self.ratio:.3g}x its bound")
        return "; ".join(parts)

    def fields(self) -> dict:
        """The entries a GPU test records for this check (JSON-ready)."""
        return dict(rel_err=self.rel_err, tol=self.tol, elem_ratio=self.ratio,
                    elem_index=list(self.index))


def check_step(key: str, out, ref: np.ndarray, bound: np.ndarray, dtype: str) -> StepCheck:
    """Compare one decode-step output (torch tensor or array) with its float64 reference:
    the norm against STEP_TOL[``dtype``] (its storage dtype) and each element against
    ``bound`` (:func:`step_bounds`)."""
    o = as_float64(out)
    if o.shape != ref.shape:
        raise ValueError(f"{key}: output shape {o.shape} != reference shape {ref.shape}")
    err = np.abs(o - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / bound)  # 0 / 0: exact; x / 0: inf
    ratio = np.where(np.isfinite(o), ratio, np.inf)
    flat = int(np.argmax(ratio)) if ratio.size else 0
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape)) if ratio.size else ()
    return StepCheck(key, rel_err(o, ref), STEP_TOL[dtype], float(ratio[index]) if ratio.size
                     else 0.0, index, float(o[index]) if o.size else 0.0,
                     float(ref[index]) if ref.size else 0.0)
