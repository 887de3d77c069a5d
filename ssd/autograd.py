"""``mamba_chunk_scan_combined`` as a ``torch.autograd.Function``: a forward of stages, the
backward of :mod:`ssd.backward`.

:class:`ChunkScanCombined` runs an injected forward -- any function with the signature and the
result of :func:`ssd.api.forward_stages` (the cuTile stages on a GPU; in the CPU tests
:func:`reference_stages`, the float64 NumPy ladder, or :func:`torch_stages`, the same in
PyTorch) -- and differentiates it with :func:`ssd.backward.ssd_chunked_backward`, each stage's
backward from a :class:`ssd.backward.StageBackwards` table: by default the one for the inputs'
device (:func:`ssd.backward.default_backwards`: the cuTile kernels on a GPU, PyTorch on the
CPU); ``backwards=ssd.backward.TORCH_BACKWARDS`` forces PyTorch (to compare the two, or where
the book shows the PyTorch rungs). :func:`chunk_scan_combined` wraps it with
mamba_ssm's signature and return convention; ``ssd.api.mamba_chunk_scan_combined`` calls it only
where a gradient is required (grad mode on and some input requiring grad), so a call without one
saves nothing and runs exactly as before.

Saved versus recomputed
-----------------------
The backward reads the forward's inputs, its stage-1 outputs and the state entering every chunk.

* **Saved**: the inputs (references to the caller's tensors: no memory of their own), dt_out and
  dA_cumsum (b, h, c, q) fp32 (2 x 4 bytes a position and head, against x's p elements: about 6 %
  of x in bf16 at p = 64), and prev_states (b, c, h, p, n) as stage 2 stores them (x's dtype by
  default, :class:`ssd.config.StateConfig`), where the forward stores them. prev_states is
  the largest intermediate (n / q of x's size: half of x at q = 256, twice x at q = 64) and the
  costliest to rebuild: chunk_state's MMAs and the sequential walk over chunks. Saving it costs
  the forward nothing (the three-stage forward writes it anyway) and spares the backward a
  second stage 2. A grouped stage-2 walk stores each group's states from its start: the
  entering states are completed here (:func:`entering_states`) and saved in fp32.
* **Recomputed**: where the forward ran stages 2 and 3 as one kernel (``ssd.kernels.fused_scan``,
  which never stores prev_states), the backward rebuilds them with chunk_state and state_passing
  (:func:`ssd.backward.chunk_state_torch`, :func:`ssd.backward.state_passing_torch`), the cost
  mamba_ssm's backward pays on every call. Only a caller's config takes that path, or the
  grouped walk: on a GPU a recorded call's default is ``default_config(stores_states=True)``
  (:func:`ssd.api.problem_default`), which takes neither. The output before the z gate, which dz
  needs (mamba_ssm saves it as ``out_x``), is recomputed by the chunk_scan backward from the
  diagonal block's weights it builds anyway plus the entering states' term: two einsums, and no
  (b, l, h, p) tensor held between the passes. The dt transform's clamp mask and softplus slope are
  recomputed from dt and dt_bias (elementwise).

Gradients come back in each input's dtype, computed in fp32 (fp64 for fp64 inputs, the CPU
tests); the backward is differentiable once (no second derivatives). varlen_states (cu_seqlens
with return_varlen_states) are returned, but a gradient flowing into them raises
NotImplementedError.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch.autograd.function import once_differentiable

from .backward import StageBackwards, ssd_chunked_backward

INF = float("inf")
#: The differentiable inputs, in the Function's argument order.
INPUTS = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


class Options(NamedTuple):
    """The non-tensor arguments of one call, and the forward to run."""

    chunk_size: int
    dt_softplus: bool
    dt_limit: tuple
    stages: Callable  # ssd.api.forward_stages' signature and result
    config: object = None  # handed to ``stages`` (an ssd.SSDConfig for the cuTile forward)
    cu_seqlens: torch.Tensor | None = None  # with return_varlen_states only
    backwards: StageBackwards | None = None  # each stage's backward (None: for the device)


def requires_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (None entries skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def entering_states(r: dict):
    """The state entering every chunk, (b, c, h, p, n), from a forward's result ``r``
    (:func:`ssd.api.forward_stages`): its prev_states; completed with each group's entering
    state after a grouped stage-2 walk (``ssd.kernels.state_passing.Groups``: prev_states[c] +
    chunk_decay[c] group_enter[c // chunks_per_group], in fp32); None where the forward stored
    none (stages 2 and 3 as one kernel)."""
    prev = r.get("prev_states")
    if prev is None or "group_enter" not in r:
        return prev
    enter = r["group_enter"]  # (b, G, h, p, n)
    c, G = prev.shape[1], enter.shape[1]
    group = torch.arange(c, device=prev.device) // -(-c // G)  # (c,) the group of each chunk
    carry = r["chunk_decay"][..., 0].transpose(1, 2)[..., None, None]  # (b, c, h, 1, 1)
    return prev.float() + carry * enter[:, group].float()


class ChunkScanCombined(torch.autograd.Function):
    """(opts, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx) -> (y, final_states) and,
    with ``opts.cu_seqlens``, varlen_states; the gradients of every tensor input but seq_idx."""

    @staticmethod
    def forward(ctx, opts: Options, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx):
        # detached views (no copy): the inputs keep requires_grad inside forward, and DLPack
        # and __cuda_array_interface__, which a kernel launch may take them through, refuse that
        bare = [None if t is None else t.detach() for t in (x, dt, A, B, C, D, z, dt_bias,
                                                             initial_states)]
        r = opts.stages(*bare[:5], opts.chunk_size, D=bare[5], z=bare[6], dt_bias=bare[7],
                        initial_states=bare[8], seq_idx=seq_idx, dt_softplus=opts.dt_softplus,
                        dt_limit=opts.dt_limit, config=opts.config, cu_seqlens=opts.cu_seqlens)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
                              r["dt_out"], r["dA_cumsum"], entering_states(r))
        ctx.opts = opts
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        out = (r["y"], r["final_states"])
        return out + (r["varlen_states"],) if opts.cu_seqlens is not None else out

    @staticmethod
    @once_differentiable  # the saved intermediates carry no graph: no second derivatives
    def backward(ctx, dy, dfinal_states, dvarlen_states=None):
        if dvarlen_states is not None:
            raise NotImplementedError(
                "varlen_states: no gradient flows through the per-sequence final states "
                "(return_varlen_states) yet; use seq_idx with y, or final_states of one "
                "sequence a row, for training")
        *inputs, seq_idx, dt_out, dA_cumsum, prev_states = ctx.saved_tensors
        if dy is None and dfinal_states is None:
            return (None,) * (len(INPUTS) + 2)
        named = dict(zip(INPUTS, inputs))
        opts = ctx.opts
        grads = ssd_chunked_backward(
            dy, *(named[k] for k in ("x", "dt", "A", "B", "C")), opts.chunk_size,
            D=named["D"], z=named["z"], dt_bias=named["dt_bias"],
            initial_states=named["initial_states"], seq_idx=seq_idx,
            dt_softplus=opts.dt_softplus, dt_limit=opts.dt_limit, dfinal_states=dfinal_states,
            dt_out=dt_out, dA_cumsum=dA_cumsum, prev_states=prev_states,
            backwards=opts.backwards, dx_dtype=named["x"].dtype)
        out = [grads["d" + k].to(t.dtype) if t is not None and ctx.needs_input_grad[i + 1] else None
               for i, (k, t) in enumerate(named.items())]
        return (None, *out, None)


def chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                        initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
                        dt_limit=(0.0, INF), return_final_states=False,
                        return_varlen_states=False, *, stages, config=None, backwards=None):
    """The differentiable SSD with mamba_ssm's signature and return convention, its forward
    ``stages`` (:func:`ssd.api.forward_stages` or one with its signature and result).

    Args:
        (as ``ssd.mamba_chunk_scan_combined``; the arguments are not validated here), plus
        stages: the forward to run; config: handed to it; backwards: the
            :class:`ssd.backward.StageBackwards` to differentiate it with (None: the default
            for the inputs' device).
    Returns:
        y, or (y, final_states), with varlen_states last under return_varlen_states.
    """
    opts = Options(chunk_size, dt_softplus, tuple(dt_limit), stages, config,
                   cu_seqlens if return_varlen_states else None, backwards)
    out = ChunkScanCombined.apply(opts, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx)
    y, final_states = out[:2]
    result = (y, final_states) if return_final_states else (y,)
    if return_varlen_states:
        result += (out[2],)
    return result if len(result) > 1 else y


def torch_stages(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                 seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF), config=None, outputs=None,
                 cu_seqlens=None) -> dict:
    """The forward stages of :mod:`ssd.backward` in PyTorch (fp32, or fp64 for fp64 x) behind
    :func:`ssd.api.forward_stages`' signature and result, on any device: a fast float64
    forward for gradcheck. config and outputs are ignored; no cu_seqlens.

    Returns:
        dict of dt_out, dA_cumsum (b, h, c, q), states, prev_states (b, c, h, p, n),
        final_states (b, h, p, n) in the compute dtype, and y (b, l, h, p) in x's dtype.
    """
    from . import backward as TB

    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: torch_stages has no varlen_states; use reference_stages")
    f = TB.compute_dtype(x)
    r = {}
    r["dt_out"], r["dA_cumsum"] = TB.chunk_cumsum_torch(dt, A, chunk_size, dt_bias, dt_softplus,
                                                        dt_limit, f)
    r["states"] = TB.chunk_state_torch(B, x, r["dt_out"], r["dA_cumsum"], seq_idx)
    r["prev_states"], r["final_states"] = TB.state_passing_torch(r["states"], r["dA_cumsum"],
                                                                 initial_states, seq_idx)
    r["y"] = TB.chunk_scan_torch(B, C, x, r["dt_out"], r["dA_cumsum"], r["prev_states"], D, z,
                                 seq_idx).to(x.dtype)
    return r


def reference_stages(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                     initial_states=None, seq_idx=None, dt_softplus=False, dt_limit=(0.0, INF),
                     config=None, outputs=None, cu_seqlens=None) -> dict:
    """The float64 NumPy stages (``ssd.reference``) behind :func:`ssd.api.forward_stages`'
    signature and result, on torch tensors of any device and float dtype: the forward the CPU
    tests inject into :func:`chunk_scan_combined`. config and outputs are ignored.

    Returns:
        dict of float64 tensors on x's device: dt_out, dA_cumsum (b, h, c, q), states,
        prev_states (b, c, h, p, n), final_states (b, h, p, n); y (b, l, h, p) in x's dtype;
        with cu_seqlens, varlen_states (num_sequences, h, p, n).
    """
    from . import reference as R

    def host(t):
        if t is None:
            return None
        t = t.detach().cpu()
        return (t if not t.is_floating_point() else t.double()).numpy()

    a = {k: host(v) for k, v in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                                      initial_states=initial_states, seq_idx=seq_idx).items()}
    r = {}
    r["dt_out"], r["dA_cumsum"] = R.chunk_cumsum(a["dt"], a["A"], chunk_size, a["dt_bias"],
                                                 dt_softplus, dt_limit)
    r["states"] = R.chunk_state(a["B"], a["x"], r["dt_out"], r["dA_cumsum"], a["seq_idx"])
    r["prev_states"], r["final_states"] = R.state_passing(
        r["states"], r["dA_cumsum"], a["initial_states"], a["seq_idx"], chunk_size)
    r["y"] = R.chunk_scan(a["B"], a["C"], a["x"], r["dt_out"], r["dA_cumsum"], r["prev_states"],
                          a["D"], a["z"], a["seq_idx"])
    if cu_seqlens is not None:
        r["varlen_states"] = R.chunk_state_varlen(a["B"], a["x"], r["dt_out"], r["dA_cumsum"],
                                                  r["prev_states"], host(cu_seqlens), a["seq_idx"])
    out = {k: torch.from_numpy(v).to(x.device) for k, v in r.items()}
    out["y"] = out["y"].to(x.dtype)
    return out


__all__ = ["ChunkScanCombined", "Options", "chunk_scan_combined", "entering_states",
           "reference_stages", "requires_grad", "torch_stages"]
