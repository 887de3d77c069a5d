"""The decode step: ``selective_state_update``, a drop-in for mamba_ssm's Triton one.

After a prefill (:func:`ssd.mamba_chunk_scan_combined` with ``return_final_states``), a serving
engine generates one token at a time: each token advances every sequence's state by one step of
the recurrence and reads its output from it (:func:`ssd.reference.recurrence_step`). This
validates the arguments (errors name the argument), then launches one cuTile kernel
(:mod:`ssd.kernels.state_update`) on the inputs' device and current stream, which updates the
state in place.

Forms accepted (mamba_ssm's, with heads; the shorter form of each argument is per head):

* state (b, h, p, n), or (s, h, p, n) rows of a paged cache with ``state_batch_indices``;
  fp32, bf16 or fp16, its last dimension contiguous (it is written in place, so never copied);
* x, z (b, h, p); dt (b, h, p) or (b, h); A (h, p, n) or (h,); B, C (b, g, n), h % g == 0;
  D, dt_bias (h, p) or (h,); any of fp32, bf16, fp16, each its own;
* a full form that is a broadcast view (stride 0 along p, or along p and n for A, as
  mamba_ssm's Mamba-2 layer passes them) is read as the per-head value it repeats;
* state_batch_indices (b,) int32 or int64: each entry's state row; a negative entry is padding
  (its y is 0 and no state row is touched), as mamba_ssm.

Not accepted: mamba_ssm's head-less form (state (batch, dim, dstate)): add a head axis of 1.
Like the forward, ``check_values=True`` also checks the values (finite inputs, state rows in
range and each named once), which needs a device synchronisation.
"""
from __future__ import annotations

import torch

from .api import MAX_DSTATE, check_tensor, _last_dim_contiguous
from .config import StateUpdateConfig, state_update_config
from .kernels import state_update as _state_update
from .reference import _check_dt_limit, check_step_shapes

INDEX_DTYPES = (torch.int32, torch.int64)


def validate_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                  state_batch_indices=None, dt_limit=None, check_values=False,
                  out=None) -> dict:
    """Check every argument of the decode step; return the sizes (b, h, p, n, g, and s with
    state_batch_indices).

    Raises TypeError / ValueError / NotImplementedError whose message starts with the
    argument's name.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    for name, t, opt in (("state", state, False), ("dt", dt, False), ("A", A, False),
                         ("B", B, False), ("C", C, False), ("D", D, True), ("z", z, True),
                         ("dt_bias", dt_bias, True)):
        check_tensor(name, t, x.device, optional=opt)
    check_tensor("x", x, x.device)
    check_tensor("state_batch_indices", state_batch_indices, x.device, dtypes=INDEX_DTYPES,
                  optional=True)
    dims = check_step_shapes(**{
        name: None if t is None else tuple(t.shape)
        for name, t in (("x", x), ("state", state), ("dt", dt), ("A", A), ("B", B), ("C", C),
                        ("D", D), ("z", z), ("dt_bias", dt_bias),
                        ("state_batch_indices", state_batch_indices))})
    if dims["n"] > MAX_DSTATE:
        raise ValueError(f"B: dstate n={dims['n']} is larger than the {MAX_DSTATE} the kernel "
                         "keeps on chip")
    if state.stride(-1) != 1 and state.shape[-1] > 1:
        raise ValueError(f"state: its last dimension must be contiguous (strides "
                         f"{tuple(state.stride())}); it is updated in place, so it is never "
                         "copied")
    if dt_limit is not None:
        _check_dt_limit(dt_limit)
    if out is not None:
        check_tensor("out", out, x.device, dtypes=(x.dtype,))
        if out.shape != x.shape:
            raise ValueError(f"out: expected shape {tuple(x.shape)} (that of x), got "
                             f"{tuple(out.shape)}")
    grads = [name for name, t in (("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B),
                                  ("C", C), ("D", D), ("z", z), ("dt_bias", dt_bias))
             if t is not None and t.requires_grad]
    if grads and torch.is_grad_enabled():
        raise NotImplementedError(
            f"{grads[0]}: requires grad, but the decode step is inference only (it updates "
            "the state in place). Run under torch.no_grad() / torch.inference_mode().")
    if check_values:
        for name, t in (("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C),
                        ("D", D), ("z", z), ("dt_bias", dt_bias)):
            if t is not None and not torch.isfinite(t).all():
                raise ValueError(f"{name}: contains NaN or inf")
        if state_batch_indices is not None:
            used = state_batch_indices[state_batch_indices >= 0]
            if (used >= dims["s"]).any():
                raise ValueError(f"state_batch_indices: a row past the state's {dims['s']} "
                                 "rows")
            if used.unique().numel() < used.numel():
                raise ValueError("state_batch_indices: a state row is named twice; each batch "
                                 "entry must own its row (negative entries are padding)")
    # The device last, so that every other error reads the same on any machine (and is tested
    # on the CPU).
    if x.device.type != "cuda":
        raise ValueError(f"x: must be a CUDA tensor (got device {x.device}); the cuTile kernels "
                         "run on NVIDIA GPUs only. On the CPU use "
                         "ssd.reference.selective_state_update.")
    return dims


def resolve_config(config: StateUpdateConfig | None, x, state) -> StateUpdateConfig:
    """``config`` (None: the default) with ``block_p`` resolved for the problem on x's GPU
    (:func:`ssd.config.state_update_config`). Args: x (b, h, p), state (., h, p, n)."""
    b, h, p = x.shape
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    return state_update_config(config or StateUpdateConfig(), (b, h, p, state.shape[-1]),
                               state.element_size(), sms)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None,
                           dt_softplus=False, state_batch_indices=None, *, dt_limit=None,
                           config: StateUpdateConfig | None = None, check_values: bool = False,
                           out=None):
    """One decode step with mamba_ssm's ``selective_state_update`` signature and semantics.

        dt' = dt + dt_bias; softplus(dt') where dt' <= 20 if dt_softplus
        state <- exp(dt' A) state + dt' x Bᵀ    (in place, in the state's dtype)
        y = state C + D x;  y *= silu(z) if z is given

    Args (forms in the module docstring):
        state: (b, h, p, n), or (s, h, p, n) with state_batch_indices; updated in place.
        x: (b, h, p). dt: (b, h, p) or (b, h). A: (h, p, n) or (h,). B, C: (b, g, n).
        D: optional (h, p) or (h,). z: optional (b, h, p). dt_bias: optional (h, p) or (h,).
        dt_softplus: apply softplus to dt + dt_bias.
        state_batch_indices: optional (b,) int, the state row of each entry (negative: padding).
        dt_limit: optional (lo, hi), 0 <= lo <= hi: clamp dt' as the forward does (mamba_ssm's
            decode step clamps nothing, and neither does this one by default).
        config: the kernel's tiles (default per GPU and problem).
        check_values: also check finite inputs and the state rows (synchronises).
        out: optional preallocated y, (b, h, p) of x's dtype.
    Returns:
        y (b, h, p) in x's dtype. The state is computed in fp32 and stored in its dtype; y comes
        from the fp32 state.

    The first call for a new shape compiles the kernel (seconds); it runs on the current stream
    without a host synchronisation, so it can be captured in a CUDA graph.
    """
    validate_step(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                  state_batch_indices=state_batch_indices, dt_limit=dt_limit,
                  check_values=check_values, out=out)
    config = resolve_config(config, x, state)
    x, z, B, C = (_last_dim_contiguous(t) for t in (x, z, B, C))
    return _state_update.state_update(state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias,
                                      dt_softplus=dt_softplus,
                                      state_batch_indices=state_batch_indices,
                                      dt_limit=dt_limit, config=config, out=out)


__all__ = ["selective_state_update", "validate_step", "resolve_config"]
