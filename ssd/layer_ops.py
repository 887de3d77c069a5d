"""The Mamba-2 layer's operations around the SSD, in cuTile: the public entry points.

* :func:`causal_conv1d` -- the depthwise causal conv1d with bias and SiLU over xBC
  (:mod:`ssd.kernels.causal_conv1d`), reading xBC where in_proj wrote it and writing the
  contiguous buffer that the SSD reads x, B and C from as views;
* :func:`gated_rmsnorm` -- the gated RMSNorm per group, y * silu(z) normalised and scaled, in
  one pass (:mod:`ssd.kernels.gated_rmsnorm`);
* :func:`conv_step` -- the conv one token further in generation (:mod:`ssd.kernels.conv_step`),
  its state rolled in place, optionally rows of a paged cache (``state_batch_indices``, as the
  SSM's decode step :func:`ssd.selective_state_update`).

Each checks its arguments (errors name the argument; shapes by the same contract as the float64
references of :mod:`ssd.layer_reference`), then launches its kernel on the inputs' device and
current stream. Like the SSD's forward, they check no values (that would synchronise).
``ssd.layer.Mamba2Mixer(kernels="cutile")`` calls them.

Training: where a gradient is required (grad mode on and an input requiring grad),
:func:`causal_conv1d` and :func:`gated_rmsnorm` run their kernel inside the autograd Functions
of :mod:`ssd.layer_autograd`, whose backward is PyTorch (what each saves and recomputes is
documented there); otherwise they launch the kernel alone and record nothing. :func:`conv_step`
updates its state in place and has no backward: it raises NotImplementedError when a gradient
is required, rather than detach.

How they differ from mamba_ssm's: its ``causal_conv1d_fn`` takes x as (b, c, l) (a transposed
view of in_proj's output) and refuses seq_idx with initial_states together; here x is (b, l, c)
and the two combine as in the SSD (the initial state feeds sequence 0). Its fused
``mamba_split_conv1d_scan_combined`` also splits in_proj's output and runs the conv, the SSD and
the norm in one call; here each is a call of its own.
"""
from __future__ import annotations

import torch

from . import layer_autograd
from .api import check_tensor
from .autograd import requires_grad
from .config import Conv1dConfig, ConvStepConfig, GatedNormConfig
from .kernels import causal_conv1d as _conv
from .kernels import conv_step as _step
from .kernels import gated_rmsnorm as _norm
from .launch import flattens
from .layer_reference import conv1d_dims, conv_step_dims, norm_dims

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = _conv.MAX_WIDTH
MAX_GROUP = _norm.MAX_GROUP


def _check_tensors(device, specs, differentiable: bool, op: str):
    """Each (name, tensor or None, dtypes, optional): a tensor of one of ``dtypes`` on
    ``device`` (the first input's). An op that is not ``differentiable`` refuses a gradient to
    compute; one that is refuses ``out`` then (autograd owns the output it records)."""
    for name, t, dtypes, optional in specs:
        check_tensor(name, t, device, dtypes, optional, first="the first input")
    tensors = [t for _, t, _, _ in specs]
    if not requires_grad(*tensors):
        return
    first = next(name for name, t, _, _ in specs if t is not None and t.requires_grad)
    if not differentiable:
        raise NotImplementedError(
            f"{first}: requires grad, but {op} has no backward (it updates its state in "
            "place); run it under torch.no_grad() / torch.inference_mode()")
    if dict((name, t) for name, t, _, _ in specs).get("out") is not None:
        raise ValueError(f"out: not accepted where a gradient is required ({first} requires "
                         "grad): autograd records the output the call allocates")


def _bare(*tensors):
    """The tensors detached (views, no copy): a launch takes its arrays through DLPack or
    __cuda_array_interface__, which refuse a tensor that requires grad, as a trained layer's
    weights do under torch.no_grad()."""
    return [None if t is None else t.detach() for t in tensors]


def _check_cuda(name, t):
    # Last, so that every other error reads the same on any machine (and is tested on the CPU).
    if t.device.type != "cuda":
        raise ValueError(f"{name}: must be a CUDA tensor (got device {t.device}); the cuTile "
                         "kernels run on NVIDIA GPUs only. On the CPU use ssd.layer_reference.")


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, activation="silu", *,
                  config: Conv1dConfig | None = None, out=None):
    """Depthwise causal conv1d over time with bias and SiLU, on xBC in in_proj's layout.

    ``out[b, t, c] = act(bias[c] + sum_k weight[c, k] * x[b, t - (w-1) + k, c])``, with x read as
    0 before the sequence start (or from ``initial_states``) and across a change of ``seq_idx``.
    fp32 accumulation, one rounding to x's dtype (:func:`ssd.layer_reference.causal_conv1d`).

    Args:
        x: (b, l, c) fp32 / bf16 / fp16 on a CUDA device, any strides: in the layer, the xBC
            columns of in_proj's (b, l, d_in_proj) output, read in place.
        weight: (c, w), 1 <= w <= MAX_WIDTH (``conv1d.weight[:, 0]``), any float dtype.
        bias: optional (c,).
        seq_idx: optional (b, l) int32 / int64, >= 0 and non-decreasing (not checked: the
            check would synchronise): packed sequences, the history zeroed at a change.
        initial_states: optional (b, c, w-1), the w-1 inputs before position 0, oldest first.
        activation: "silu" (or "swish") or None.
        config: tile sizes (:class:`ssd.config.Conv1dConfig`).
        out: optional contiguous (b, l, c) tensor of x's dtype to write into.
    Returns:
        (b, l, c) contiguous, in x's dtype: the SSD's x, B and C are its column views.
    Differentiable in x, weight, bias and initial_states (:class:`ssd.layer_autograd.CausalConv1d`);
    ``out`` is refused where a gradient is required.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _check_tensors(x.device, (
        ("x", x, FLOAT_DTYPES, False), ("weight", weight, FLOAT_DTYPES, False),
        ("bias", bias, FLOAT_DTYPES, True), ("seq_idx", seq_idx, INDEX_DTYPES, True),
        ("initial_states", initial_states, FLOAT_DTYPES, True), ("out", out, (x.dtype,), True)),
        differentiable=True, op="causal_conv1d")
    b, l, c, w = conv1d_dims(**{k: None if t is None else tuple(t.shape) for k, t in dict(
        x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states).items()})
    if w > MAX_WIDTH:
        raise ValueError(f"weight: width {w} is wider than the {MAX_WIDTH} the kernel is built "
                         f"for (Mamba-2's d_conv is 4)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if out is not None and (tuple(out.shape) != (b, l, c) or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous ({b}, {l}, {c}) tensor, got shape "
                         f"{tuple(out.shape)}, strides {out.stride()}")
    _check_cuda("x", x)
    config = config or Conv1dConfig()

    def kernel(x, weight, bias, seq_idx, initial_states, activation, out=None):
        return _conv.causal_conv1d(x, weight, bias, seq_idx=seq_idx,
                                   initial_states=initial_states, silu=activation is not None,
                                   config=config, out=out)

    def kernel_backward(dout, x, weight, bias, seq_idx, initial_states, activation):
        return _conv.causal_conv1d_backward(dout, x, weight, bias, seq_idx, initial_states,
                                            silu=activation is not None, config=config)

    if requires_grad(x, weight, bias, initial_states):
        return layer_autograd.causal_conv1d(x, weight, bias, seq_idx, initial_states,
                                            activation, forward=kernel, backward=kernel_backward)
    x, weight, bias, initial_states = _bare(x, weight, bias, initial_states)
    return kernel(x, weight, bias, seq_idx, initial_states, activation, out=out)


def conv_step(conv_state, x, weight, bias=None, activation="silu", state_batch_indices=None,
              *, config: ConvStepConfig | None = None, out=None):
    """The decode step of :func:`causal_conv1d`: one token per sequence, the conv state rolled
    in place (the oldest input dropped, x appended), then the depthwise dot, bias and SiLU.

    ``out[b, c] = act(bias[c] + sum_k weight[c, k] * window[b, c, k])`` with window =
    [conv_state[r, c, :], x[b, c]] and r the state row of b, fp32 accumulation, one rounding to
    x's dtype (:func:`ssd.layer_reference.conv_step`); one launch of
    :mod:`ssd.kernels.conv_step`, which reads and writes each state element once.

    Args:
        conv_state: (b, c, w-1), or (s, c, w-1) rows of a paged cache with state_batch_indices;
            x's dtype (it holds earlier inputs exactly), 1 <= w <= MAX_WIDTH, the w-1 previous
            inputs, oldest first; updated in place, so never copied (no stride 0).
        x: (b, c) fp32 / bf16 / fp16 on a CUDA device, any strides (in the layer, the xBC
            columns of in_proj's output).
        weight: (c, w); bias: optional (c,); activation: "silu" (or "swish") or None.
        state_batch_indices: optional (b,) int32 / int64, each entry's state row, as
            :func:`ssd.selective_state_update`'s: a negative entry is padding (its out is 0 and
            no row is touched); rows in range and named once each (not checked: that would
            synchronise).
        config: the block width (:class:`ssd.config.ConvStepConfig`).
        out: optional (b, c) tensor of x's dtype to write into.
    Returns:
        (b, c) in x's dtype.
    Raises NotImplementedError where a gradient is required: the step has no backward.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _check_tensors(x.device, (
        ("conv_state", conv_state, (x.dtype,), False), ("x", x, FLOAT_DTYPES, False),
        ("weight", weight, FLOAT_DTYPES, False), ("bias", bias, FLOAT_DTYPES, True),
        ("state_batch_indices", state_batch_indices, INDEX_DTYPES, True),
        ("out", out, (x.dtype,), True)), differentiable=False, op="conv_step")
    b, c, w = conv_step_dims(**{k: None if t is None else tuple(t.shape) for k, t in dict(
        conv_state=conv_state, x=x, weight=weight, bias=bias,
        state_batch_indices=state_batch_indices).items()})
    if w > _step.MAX_WIDTH:
        raise ValueError(f"weight: width {w} is wider than the {_step.MAX_WIDTH} the conv step "
                         "kernel takes (Mamba-2's d_conv is 4)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    if conv_state.numel() and any(st == 0 and n > 1
                                  for n, st in zip(conv_state.shape, conv_state.stride())):
        raise ValueError(f"conv_state: a stride of 0 (strides {conv_state.stride()}) would "
                         "write one element from several rows; it is updated in place")
    if out is not None and tuple(out.shape) != (b, c):
        raise ValueError(f"out: expected shape ({b}, {c}), got {tuple(out.shape)}")
    _check_cuda("x", x)
    x, weight, bias = _bare(x, weight, bias)
    return _step.conv_step(conv_state, x, weight, bias, state_batch_indices,
                           silu=activation is not None, config=config or ConvStepConfig(),
                           out=out)


def gated_rmsnorm(y, z, weight, group_size=None, eps=1e-5, *,
                  config: GatedNormConfig | None = None, out=None):
    """Mamba-2's gated RMSNorm per group, gate before the norm, in one pass:
    ``v = y * silu(z)``, ``out = v / sqrt(mean_group(v^2) + eps) * weight`` in fp32, returned in
    y's dtype (mamba_ssm's ``RMSNormGated(norm_before_gate=False)``;
    :func:`ssd.layer_reference.gated_rmsnorm`).

    Args:
        y: (..., d) fp32 / bf16 / fp16 on a CUDA device (in the layer, the SSD's y flattened
            to (b, l, d_inner)).
        z: (..., d), y's shape, any float dtype (in the layer, the z columns of in_proj's
            output, read in place).
        weight: (d,), any float dtype.
        group_size: channels a group, dividing d, at most MAX_GROUP (None: d, one group; the
            layer's is d_inner / ngroups).
        eps: added to the mean square, > 0.
        config: rows a block (:class:`ssd.config.GatedNormConfig`).
        out: optional contiguous tensor of y's shape and dtype to write into.
    Y and z must have a unit stride along d and leading axes that flatten without a copy.
    Returns:
        (..., d) contiguous, in y's dtype.
    Differentiable in y, z and weight (:class:`ssd.layer_autograd.GatedRMSNorm`); ``out`` is
    refused where a gradient is required.
    """
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"y: expected a torch.Tensor, got {type(y).__name__}")
    _check_tensors(y.device, (
        ("y", y, FLOAT_DTYPES, False), ("z", z, FLOAT_DTYPES, False),
        ("weight", weight, FLOAT_DTYPES + (torch.float64,), False),
        ("out", out, (y.dtype,), True)), differentiable=True, op="gated_rmsnorm")
    m, d, g, group_size = norm_dims(y=tuple(y.shape), z=tuple(z.shape),
                                    weight=tuple(weight.shape), group_size=group_size)
    if group_size > MAX_GROUP:
        raise ValueError(f"group_size: {group_size} channels a group is more than the "
                         f"{MAX_GROUP} the kernel keeps on chip")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    for name, t in (("y", y), ("z", z)):
        if d > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride along the channels, got strides "
                             f"{t.stride()}")
        if not flattens(t, m, d):
            raise ValueError(f"{name}: its leading axes do not flatten without a copy (strides "
                             f"{t.stride()}); pass .contiguous()")
    if out is not None and (out.shape != y.shape or not out.is_contiguous()):
        raise ValueError(f"out: expected a contiguous tensor of shape {tuple(y.shape)}, got "
                         f"shape {tuple(out.shape)}, strides {out.stride()}")
    _check_cuda("y", y)
    config = config or GatedNormConfig()

    def kernel(y, z, weight, group_size, eps, out=None):
        return _norm.gated_rmsnorm(y, z, weight.to(torch.float32), group_size, float(eps),
                                   config=config, out=out)

    if requires_grad(y, z, weight):
        return layer_autograd.gated_rmsnorm(y, z, weight, group_size, eps, forward=kernel,
                                            backward=_norm.gated_rmsnorm_backward)
    return kernel(*_bare(y, z, weight), group_size, eps, out=out)


__all__ = ["causal_conv1d", "conv_step", "gated_rmsnorm", "MAX_WIDTH", "MAX_GROUP"]
