"""Checking the cuTile stages against the float64 reference: one copy for tests and chapters.

The GPU tests (``tests/test_gpu_kernels.py``) and the GPU chapters validate a stage the same way:

1. :func:`device_inputs` -- seeded inputs of a :class:`ssd.problem.ProblemSpec` on the GPU, the
   low-precision streams (x, z, B, C, dt) cast to the dtype under test, the rest fp32;
2. :func:`reference_of` -- the float64 reference computed from exactly those (rounded) values,
   so the error measured is the kernel's and not the cast's;
3. :func:`poisoned_outputs` -- every output buffer filled with NaN before the launch, so an
   element a kernel forgets to write makes the check fail instead of passing on stale memory;
4. :func:`rel_err` -- the relative Frobenius error ‖out − ref‖ / ‖ref‖ (inf if any element is
   not finite), compared with :data:`TOL` for the input dtype (:data:`TOL_CUMSUM` for stage 1).

Tolerances (per input dtype), and why:

* float32: cuTile runs fp32 MMAs in full fp32 (not TF32: measured errors are ~2e-6). The
  error is then set by exp2 / log approximations and fp32 accumulation over a chunk
  (u = 6e-8, a few hundred terms): 2e-5 is 10x the worst error seen on the H200 and still
  10,000x below what a wrong mask, decay or missing term gives (1e-1 .. 1).
* float16: inputs and the MMA operands built on chip (decay-weighted C·Bᵀ, scaled B) are
  rounded to fp16 (u = 2^-11 ≈ 4.9e-4), accumulated in fp32; a norm-wise error of about
  one u is expected (3e-4 seen): 2e-3.
* bfloat16: u = 2^-8 ≈ 3.9e-3 for each on-chip rounding; two such roundings per term
  (operand and weight) give a few e-3 in norm (2.6e-3 seen): tolerance 1.5e-2.
* The stage-1 outputs dt_out and dA_cumsum are fp32 arithmetic on rounded inputs: 1e-5.

Only the constants import without torch; ``DTYPES`` (name -> torch dtype) and the functions
need it (imported on first use).
"""
from __future__ import annotations

import math

import numpy as np

from .problem import ProblemSpec

#: The input dtypes the kernels accept, by name.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: Relative-error tolerance of every stage-2/3 output, per input dtype (see the module doc).
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1.5e-2}
#: Tolerance of the stage-1 outputs (dt_out, dA_cumsum): fp32 arithmetic whatever the input.
TOL_CUMSUM = 1e-5
#: Inputs cast to the dtype under test; the others (A, D, dt_bias, initial_states) stay fp32.
LOW_PRECISION = ("x", "z", "B", "C", "dt")
#: Stage outputs in stage order (``states`` only exists with the split stage 2).
STAGE_KEYS = ("dt_out", "dA_cumsum", "states", "prev_states", "final_states", "y")


def __getattr__(name):  # PEP 562: DTYPES needs torch, the constants above do not
    if name == "DTYPES":
        import torch

        return {n: getattr(torch, n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tol_for(key: str, dtype: str) -> float:
    """The tolerance for stage output ``key`` with inputs of ``dtype``."""
    return TOL_CUMSUM if key in ("dt_out", "dA_cumsum") else TOL[dtype]


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


def reference_of(spec: ProblemSpec, inputs: dict) -> dict:
    """The float64 reference (every stage, see ``ProblemSpec.reference``) computed from
    exactly the values the kernels read."""
    return spec.reference({k: v.double().cpu().numpy() if v.is_floating_point() else v.cpu().numpy()
                           for k, v in inputs.items()})


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
        from .kernels.state_passing import DECAY_ROW

        out["chunk_decay"] = torch.full((b, h, c, DECAY_ROW), dtype=torch.float32, **nan)
        out["group_enter"] = torch.full((b, groups, h, p, n), dtype=getattr(torch, state_dtype), **nan)
    return out


def rel_err(out, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius; ‖ref‖ = 0 counts as 1); inf if ``out`` has a
    non-finite element (an unwritten, NaN-poisoned one or an overflow)."""
    o = out.double().cpu().numpy()
    if not np.isfinite(o).all():
        return math.inf  # an unwritten (NaN-poisoned) or overflowed element
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(o - ref) / (denom if denom > 0 else 1.0))


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
