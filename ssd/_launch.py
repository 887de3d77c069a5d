"""One place where cuTile kernels are launched, so the same host code can also be compiled
ahead of time on a machine without a GPU.

Every stage launcher in ``ssd`` ends in :func:`launch`. Normally that queues the kernel on
the current CUDA stream of the tensors' device. Inside :func:`capture` it records the
``(kernel, grid, args)`` triple instead, and :mod:`ssd.aot` turns each record into an
explicit :class:`cuda.tile.compilation.KernelSignature` and exports a cubin. Launchers
therefore run unchanged on CPU tensors under ``capture()``: that is how CI proves that every
kernel still compiles for sm_80 / sm_90 / sm_100.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
import typing
from dataclasses import dataclass

import cuda.tile as ct

from . import _tiered

INT32_MAX = 2**31 - 1


def index_dtype_for(*tensors) -> "ct.DType":
    """int64 indexing only where a tensor has 2**31 elements or more (address arithmetic would
    overflow in int32 there); int32 everywhere else because it is cheaper."""
    big = any(t is not None and t.numel() > INT32_MAX for t in tensors)
    return ct.int64 if big else ct.int32


def array_type(index_dtype) -> typing.Any:
    """The kernel-parameter annotation for an array indexed with ``index_dtype``."""
    return typing.Annotated[ct.Array, ct.ArrayAnnotation(index_dtype=index_dtype)]


@dataclass(frozen=True)
class Launch:
    kernel: "ct.kernel"
    grid: tuple
    args: tuple


_captured: list | None = None


@contextlib.contextmanager
def capture():
    """Record launches instead of running them (for ahead-of-time compilation)."""
    global _captured
    previous, _captured = _captured, []
    try:
        yield _captured
    finally:
        _captured = previous


_launched: set = set()  # kernels launched at least once in this process


def launch(kernel, grid: tuple, args: tuple, device=None, quick=None) -> None:
    """Launch ``kernel`` over ``grid`` on the current stream of ``device`` (or record it).

    quick: an :class:`ssd._tiered.QuickFirst` for a kernel whose tuned build compiles for long;
    until that build is ready the quick one runs in its place (see :mod:`ssd._tiered`).
    """
    grid, args = tuple(grid), tuple(args)
    if _captured is not None:
        _captured.append(Launch(kernel, grid, args))
        return
    import torch

    with torch.cuda.device(device):
        if quick is not None and (key := _tiered.launch_key(kernel, args)) not in _tiered.settled:
            arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
            kernel = _tiered.pick(key, quick, Launch(kernel, grid, args), arch,
                                  torch.cuda.is_current_stream_capturing())
        if kernel in _launched:
            ct.launch(torch.cuda.current_stream(), grid, kernel, args)
            return
        # A first launch compiles (seconds, in silence otherwise); later ones of other
        # signatures compile too, and say nothing.
        name = kernel._pyfunc.__name__.removesuffix("_kernel")
        _tiered.log.info("%s: first launch in this process (compiles unless cached)", name)
        start = time.perf_counter()
        ct.launch(torch.cuda.current_stream(), grid, kernel, args)
        _launched.add(kernel)
        _tiered.log.info("%s: launched after %.1f s", name, time.perf_counter() - start)


@functools.lru_cache(maxsize=None)
def _param_kinds(kernel) -> tuple:
    """For each kernel parameter: ('const', None), ('array', index_dtype) or ('scalar', None)."""
    kinds = []
    hints = typing.get_type_hints(kernel._pyfunc, include_extras=True)
    for name in inspect.signature(kernel._pyfunc).parameters:
        hint = hints.get(name)
        meta = getattr(hint, "__metadata__", ())
        if any(isinstance(m, ct.ConstantAnnotation) for m in meta):
            kinds.append(("const", None))
        elif any(isinstance(m, ct.ArrayAnnotation) for m in meta):
            ann = next(m for m in meta if isinstance(m, ct.ArrayAnnotation))
            kinds.append(("array", ann.index_dtype))
        elif typing.get_origin(hint) is None and hint is ct.Array:
            kinds.append(("array", ct.int32))
        else:
            kinds.append(("scalar", None))
    return tuple(kinds)


_TORCH_TO_CT = {
    "torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
    "torch.float64": "float64", "torch.int32": "int32", "torch.int64": "int64",
}


# cuTile's launcher specialises a kernel on every array argument: a stride of 1 and a size of 1
# become constants, strides and sizes are marked divisible where they are (strides by 16 bytes'
# worth of elements, sizes by 16), and the base address is taken as 16-byte aligned. The
# compiled code depends on these (on sm_90 they decide whether loads go through TMA), so an
# ahead-of-time compile must make the same marks to get the kernel a GPU run would get.
DIVISOR = 16


def array_constraint(tensor, index_dtype):
    """The ArrayConstraint cuTile's launcher derives from ``tensor`` (shape, strides, dtype)."""
    from cuda.tile import compilation as C

    per_16_bytes = DIVISOR // tensor.element_size()
    unit = [s == 1 for s in tensor.stride()]
    return C.ArrayConstraint(
        dtype=getattr(ct, _TORCH_TO_CT[str(tensor.dtype)]), ndim=tensor.dim(),
        index_dtype=index_dtype, alias_groups=(), may_alias_internally=False,
        stride_lower_bound_incl=tuple(None if u else 0 for u in unit),
        stride_constant=tuple(1 if u else None for u in unit),
        stride_divisible_by=tuple(1 if u or s % per_16_bytes else per_16_bytes
                                  for u, s in zip(unit, tensor.stride())),
        shape_constant=tuple(1 if d == 1 else None for d in tensor.shape),
        shape_divisible_by=tuple(DIVISOR if d % DIVISOR == 0 else 1 for d in tensor.shape),
        base_addr_divisible_by=DIVISOR)


def signature(record: Launch):
    """The KernelSignature a GPU launch of ``record`` would compile (no GPU or driver needed)."""
    from cuda.tile import compilation as C

    params = []
    for (kind, index_dtype), arg in zip(_param_kinds(record.kernel), record.args, strict=True):
        if kind == "const":
            params.append(arg)
        elif kind == "array":
            params.append(array_constraint(arg, index_dtype))
        elif isinstance(arg, bool):
            params.append(C.ScalarConstraint(dtype=ct.bool_))
        elif isinstance(arg, int):
            params.append(C.ScalarConstraint(dtype=ct.int32))
        else:
            params.append(C.ScalarConstraint(dtype=ct.float32))
    return C.KernelSignature(parameters=params,
                             calling_convention=C.CallingConvention.cutile_python_v2())


def optional(tensor, ndim: int, dtype, device):
    """``tensor``, or a one-element stand-in when it is None (the kernel's flag for it is off).

    Kernels take a fixed parameter list; passing another argument in its place would alias
    two kernel arrays, which cuTile forbids even when one of them is never touched. Never
    touched, its contents do not matter: ``empty`` allocates without launching a fill kernel
    (``zeros`` launched one per absent input per forward).
    """
    import torch

    if tensor is not None:
        return tensor
    return torch.empty((1,) * ndim, dtype=dtype, device=device)
