"""The public entry point: ``mamba_chunk_scan_combined``, a drop-in for mamba_ssm's.

It validates the arguments (shapes, dtypes, devices: errors name the argument), then runs the
three cuTile stages on the inputs' device and current stream::

    chunk_cumsum  ->  chunk_state + state_passing (fused by default)  ->  chunk_scan

or, where the default finds it fills the GPU (:func:`ssd.config.fused_scan_fills`), the last
three in one kernel (:mod:`ssd.kernels.fused_scan`)::

    chunk_cumsum  ->  chunk_state + state_passing + chunk_scan

Packed prompts (mamba_ssm's varlen interface): ``seq_idx`` resets the state where each
sequence starts; with ``cu_seqlens`` and ``return_varlen_states`` a fourth kernel
(:mod:`ssd.kernels.chunk_state_varlen`) also gives each sequence's final state, from the chunk
where it ends and the state stage 2 stored for that chunk.

Where a gradient is required, the same forward runs inside a ``torch.autograd.Function``
(:mod:`ssd.autograd`, which says what it saves for the backward and what the backward
recomputes); the backward is :mod:`ssd.backward`, the stages' gradients, in cuTile kernels
where one exists (``ssd.kernels.<stage>_backward``) and PyTorch for the others.

Value checks that would need the GPU to report back (A <= 0, finite inputs, seq_idx
non-decreasing, cu_seqlens' offsets) would force a device synchronisation and break CUDA-graph capture, so they run
only with ``check_values=True``. Inputs may be non-contiguous (kernels take strides); a tensor
whose last dimension is strided is copied once to make it contiguous.
"""
from __future__ import annotations

import math

import torch

from . import autograd as _autograd
from .kernels import chunk_cumsum as _cumsum
from .kernels import chunk_scan as _scan
from .kernels import chunk_state as _state
from .kernels import chunk_state_varlen as _varlen
from .kernels import fused_scan as _fused_scan
from .kernels import state_passing as _passing
from .config import CHUNK_SIZES, MAX_DSTATE, SSDConfig, default_config
from .launch import chunk_seq_last
from .reference import check_cu_seqlens, check_shapes, check_varlen_shapes

STAGES = ("chunk_cumsum", "chunk_state", "state_passing", "chunk_scan")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name, t, device, dtypes=FLOAT_DTYPES, optional=False, first="x"):
    """``t`` (argument ``name``) is a tensor of one of ``dtypes`` on ``device``, the device of the
    argument ``first``; None passes where ``optional``. Raises TypeError or ValueError naming
    the argument."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but {first} is on {device}; all inputs must "
                         "share one CUDA device")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")


def _last_dim_contiguous(t):
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def validate(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
             seq_idx=None, dt_limit=(0.0, math.inf), check_values=False, cu_seqlens=None,
             return_varlen_states=False) -> dict:
    """Check every argument of the forward; return the sizes (b, l, h, p, n, g, c, q).

    cu_seqlens is checked only with return_varlen_states, the one call that reads it (as in
    mamba_ssm, which ignores it otherwise).

    Raises TypeError / ValueError whose message starts with the argument's name.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    for name, t, opt in (("dt", dt, False), ("A", A, False), ("B", B, False), ("C", C, False),
                         ("D", D, True), ("z", z, True), ("dt_bias", dt_bias, True),
                         ("initial_states", initial_states, True)):
        check_tensor(name, t, x.device, optional=opt)
    check_tensor("x", x, x.device)
    check_tensor("seq_idx", seq_idx, x.device, dtypes=(torch.int32, torch.int64), optional=True)
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states: needs cu_seqlens, the (num_sequences + 1,) "
                             "offsets of the packed sequences")
        check_tensor("cu_seqlens", cu_seqlens, x.device, dtypes=(torch.int32, torch.int64))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: the cuTile kernels take a power of two in {CHUNK_SIZES} "
                         f"(one chunk is one tile), got {chunk_size!r}")
    dims = check_shapes(chunk_size=chunk_size, **{
        name: None if t is None else tuple(t.shape)
        for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                        ("dt_bias", dt_bias), ("initial_states", initial_states),
                        ("seq_idx", seq_idx))})
    if return_varlen_states:
        check_varlen_shapes(tuple(cu_seqlens.shape), dims, seq_idx is not None)
    if dims["n"] > MAX_DSTATE:
        raise ValueError(f"B: dstate n={dims['n']} is larger than the {MAX_DSTATE} the kernels "
                         "keep on chip")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dt_limit: expected a pair (lo, hi), got {dt_limit!r}") from exc
    if math.isnan(lo) or math.isnan(hi) or not 0.0 <= lo <= hi:
        raise ValueError(f"dt_limit: expected 0 <= lo <= hi, got {tuple(dt_limit)!r}")
    if check_values:
        if not torch.isfinite(A).all() or (A > 0).any():
            raise ValueError("A: must be finite and <= 0 so that every decay exp(dt*A) is <= 1")
        for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z)):
            if t is not None and not torch.isfinite(t).all():
                raise ValueError(f"{name}: contains NaN or inf")
        if seq_idx is not None and ((seq_idx[:, 1:] < seq_idx[:, :-1]).any() or (seq_idx < 0).any()):
            raise ValueError("seq_idx: must be >= 0 and non-decreasing along the sequence")
        if return_varlen_states:  # offsets from 0 to l, rising, where seq_idx changes
            check_cu_seqlens(cu_seqlens.cpu().numpy(), dims["l"], seq_idx.cpu().numpy())
    # The device last, so that every other error reads the same on any machine (and is tested
    # on the CPU).
    if x.device.type != "cuda":
        raise ValueError(f"x: must be a CUDA tensor (got device {x.device}); the cuTile kernels "
                         "run on NVIDIA GPUs only. On the CPU use ssd.reference.ssd_chunked.")
    return dims


def resolve_config(config: SSDConfig | None, chunk_size: int, x, B) -> SSDConfig:
    """``config`` (None: the default for x's GPU, this problem's batch, length, heads and state
    and the chunk size, see :func:`ssd.config.default_config`) fitted to the problem: tiles clamped to
    the chunk, head and state sizes, the head block to the heads per group, and the entering
    states' dtype resolved against x's (see :meth:`SSDConfig.for_problem`).

    Args: x (b, l, h, p), B (b, l, g, n)."""
    if config is None:
        gpu = torch.cuda.get_device_properties(x.device)
        problem = (x.shape[0], x.shape[2], x.shape[3], B.shape[3])  # (b, h, p, n)
        config = default_config((gpu.major, gpu.minor), problem=problem,
                                sms=gpu.multi_processor_count, chunk_size=chunk_size,
                                seqlen=x.shape[1])
    return config.for_problem(chunk_size, x.shape[-1], B.shape[-1], x.shape[2] // B.shape[2],
                              input_dtype=x.dtype)


def takes_fused_scan(config: SSDConfig, seq_idx) -> bool:
    """Whether the forward runs stages 2 and 3 as one kernel (:mod:`ssd.kernels.fused_scan`): where the
    config enables it, except for packed sequences (seq_idx), which it does not cover."""
    return config.fused_scan.enabled and seq_idx is None


def forward_stages(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                   initial_states=None, seq_idx=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), config: SSDConfig | None = None,
                   outputs: dict | None = None, cu_seqlens=None) -> dict:
    """Run the stages and return every intermediate, named as in ``ssd.reference``.

    Args:
        (as :func:`mamba_chunk_scan_combined`), plus
        cu_seqlens: optional (num_sequences + 1,) int offsets of the sequences packed along a
            batch of one row (with seq_idx): then also varlen_states, each one's final state.
        config: tile sizes and layout choices; None picks :func:`ssd.config.default_config`.
        outputs: optional preallocated tensors keyed like the result (tests fill them with NaN
            so that an element a kernel fails to write is caught).
    Returns:
        dict with dt_out, dA_cumsum (b, h, c, q) fp32; final_states (b, h, p, n) fp32; y
        (b, l, h, p) in x's dtype; and, unless stages 2 and 3 ran as one kernel
        (:func:`takes_fused_scan`), which stores no entering state: states (b, c, h, p, n) fp32 (split
        stage 2 only); prev_states (b, c, h, p, n), with ``StateConfig.groups > 1`` from each
        group's start, then also chunk_decay (b, h, c, DECAY_ROW) fp32 and group_enter (b, G, h, p, n)
        (:class:`ssd.kernels.state_passing.Groups`); with cu_seqlens, varlen_states
        (num_sequences, h, p, n) fp32.
    """
    config = resolve_config(config, chunk_size, x, B)
    out = outputs or {}
    x, z, B, C, dt = (_last_dim_contiguous(t) for t in (x, z, B, C, dt))
    seq_last = None
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
        seq_last = chunk_seq_last(seq_idx, chunk_size)
    r = {}
    r["dt_out"], r["dA_cumsum"] = _cumsum.chunk_cumsum(
        dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        config=config.cumsum, out=_pair(out, "dt_out", "dA_cumsum"))
    if takes_fused_scan(config, seq_idx):
        r["y"], r["final_states"] = _fused_scan.fused_scan(
            B, C, x, r["dt_out"], r["dA_cumsum"], D=D, z=z, initial_states=initial_states,
            config=config.fused_scan, out=_pair(out, "y", "final_states"))
        return r
    stage2_out = None
    if "prev_states" in out and "final_states" in out:
        buffers = (_passing.Groups(out["chunk_decay"], out["group_enter"],
                                   _passing.chunks_per_group(r["dA_cumsum"].shape[2],
                                                             config.state.groups))
                   if "chunk_decay" in out and "group_enter" in out else None)
        stage2_out = _passing.StageTwo(out["prev_states"], out["final_states"], buffers)
    if config.state.fused and config.state.groups > 1:
        stage2 = _passing.grouped_chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], initial_states=initial_states, seq_idx=seq_idx,
            seq_last=seq_last, config=config.state, out=stage2_out)
        r["chunk_decay"], r["group_enter"] = stage2.groups.chunk_decay, stage2.groups.group_enter
    elif config.state.fused:
        stage2 = _passing.chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], initial_states=initial_states, seq_idx=seq_idx,
            seq_last=seq_last, config=config.state, out=stage2_out)
    else:
        r["states"] = _state.chunk_state(B, x, r["dt_out"], r["dA_cumsum"], seq_idx=seq_idx,
                                         seq_last=seq_last, config=config.state,
                                         out=out.get("states"))
        stage2 = _passing.state_passing(
            r["states"], r["dA_cumsum"], initial_states=initial_states, seq_last=seq_last,
            config=config.state, out=stage2_out)
    r["prev_states"], r["final_states"] = stage2.prev_states, stage2.final_states
    r["y"] = _scan.chunk_scan(B, C, x, r["dt_out"], r["dA_cumsum"], r["prev_states"], D=D, z=z,
                              seq_idx=seq_idx, seq_last=seq_last, config=config.scan,
                              out=out.get("y"), groups=stage2.groups)
    if cu_seqlens is not None:
        r["varlen_states"] = _varlen.chunk_state_varlen(
            B, x, r["dt_out"], r["dA_cumsum"], r["prev_states"],
            cu_seqlens.to(torch.int32).contiguous(), seq_idx, seq_last, config=config.state,
            out=out.get("varlen_states"), groups=stage2.groups)
    return r


def _pair(out, a, b):
    return (out[a], out[b]) if a in out and b in out else None


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, *,
                              config: SSDConfig | None = None, check_values: bool = False,
                              backwards=None):
    """Mamba-2 SSD with mamba_ssm's signature, shapes, dtypes and semantics.

    Differentiable: where grad mode is on and an input requires grad, the call goes through
    :class:`ssd.autograd.ChunkScanCombined` (this forward, saving what the backward reads; the
    backward of :mod:`ssd.backward`), and every float input gets its gradient in its own dtype.
    Otherwise nothing is saved and the forward runs alone.

    Args:
        x: (b, l, h, p) fp32 / bf16 / fp16 on a CUDA device.
        dt: (b, l, h); A: (h,), must be <= 0; B, C: (b, l, g, n) with h % g == 0.
        chunk_size: q, a power of two in 16..256.
        D: optional (h,) or (h, p) skip; z: optional (b, l, h, p) gate, y * silu(z).
        dt_bias: optional (h,); dt_softplus: softplus(dt + dt_bias); dt_limit: clamp (lo, hi).
        initial_states: optional (b, h, p, n); seq_idx: optional (b, l) int, packed sequences.
        cu_seqlens: (num_sequences + 1,) int32 or int64 on x's device, read only with
            return_varlen_states (as mamba_ssm): the offsets of the sequences packed along a
            batch of one row, 0 first, l last, strictly increasing, with seq_idx given and
            changing exactly at them.
        return_final_states: also return the (b, h, p, n) fp32 state after the last token.
        return_varlen_states: also return each packed sequence's state after its last token,
            (num_sequences, h, p, n) fp32 (mamba_ssm returns them in its stored states'
            dtype). The initial state enters the first sequence's where seq_idx[0, 0] == 0,
            as it does y; mamba_ssm leaves it out when that sequence ends in the first chunk.
        config: tile/layout choices (default per GPU architecture).
        check_values: also check A <= 0, finite inputs, seq_idx order and cu_seqlens' offsets
            (synchronises).
        backwards: the :class:`ssd.backward.StageBackwards` the backward composes (None: the
            cuTile kernels where one exists; ``ssd.backward.TORCH_BACKWARDS``: PyTorch alone).
    Returns:
        y (b, l, h, p) in x's dtype, or (y, final_states) with return_final_states; with
        return_varlen_states, varlen_states comes last: (y, varlen_states) or (y,
        final_states, varlen_states), mamba_ssm's order.

    A gradient flowing into varlen_states raises NotImplementedError (in the backward).

    The first call for a new shape or configuration compiles its kernels (seconds). chunk_scan's
    tuned build then compiles in a child process while a quick build computes the same values
    (:mod:`ssd.launch`); call :func:`ssd.wait_tuned` before timing this function.
    """
    validate(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
             seq_idx=seq_idx, dt_limit=dt_limit, check_values=check_values,
             cu_seqlens=cu_seqlens, return_varlen_states=return_varlen_states)
    if _autograd.requires_grad(x, dt, A, B, C, D, z, dt_bias, initial_states):
        return _autograd.chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_final_states=return_final_states, return_varlen_states=return_varlen_states,
            stages=forward_stages, config=config, backwards=backwards)
    r = forward_stages(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                       initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
                       dt_limit=dt_limit, config=config,
                       cu_seqlens=cu_seqlens if return_varlen_states else None)
    if return_varlen_states:
        return ((r["y"], r["final_states"], r["varlen_states"]) if return_final_states
                else (r["y"], r["varlen_states"]))
    return (r["y"], r["final_states"]) if return_final_states else r["y"]


__all__ = ["mamba_chunk_scan_combined", "forward_stages", "validate", "chunk_seq_last",
           "takes_fused_scan", "STAGES"]
