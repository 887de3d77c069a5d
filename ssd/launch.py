"""One place where cuTile kernels are launched, so the same host code can also be compiled
ahead of time on a machine without a GPU.

Every stage launcher in ``ssd`` ends in :func:`launch`. Normally that queues the kernel on
the current CUDA stream of the tensors' device. Inside :func:`capture` it records the
``(kernel, grid, args)`` triple instead, and :mod:`ssd.tools.aot` turns each record into an
explicit :class:`cuda.tile.compilation.KernelSignature` and exports a cubin. Launchers
therefore run unchanged on CPU tensors under ``capture()``: that is how CI proves that every
kernel still compiles for sm_80 / sm_90 / sm_100.

Launches of one call in a row: :func:`run` takes :class:`Step` records and their argument tuples
and enters the device once for all of them; :mod:`ssd.api` records a call's steps once per
signature with :func:`trace` and replays them (its plans), so a repeated call's host path skips
the launchers.

Quick first calls: a kernel whose compile is long runs a quick-compiling build of itself until
its tuned build, compiled in another process, is in cuTile's kernel cache.

Why: tileiras spends up to 13 s on ``chunk_scan``'s tuned build for some configurations (the
grouped walk with full chunks at 64: its search for a pipeline across tiles; the pipeline pays,
chapter 9), which is longer than a first call may take, and every cut of that search measured
cost the forward 1.1-2.3x its time. So both builds exist: the tuned one for steady
state, and one with the occupancy hint at 1 (one block a SM; tileiras compiles it in 1-3 s) for
the calls before the tuned one is ready. cuTile compiles under one process-wide lock, so a thread
could not compile beside the launches; a child process can. It rebuilds the kernel
(:class:`Rebuild`), exports the cubin for the launch's signature (the one cuTile's launcher
derives, :func:`signature`, carried as its mangled name) into cuTile's disk cache,
and exits; the first launch of the tuned kernel after that is a cache hit (cuTile's front end,
about 0.1 s). Both builds run the same tile code on the same tiles, so they compute the same
values; only the scheduling hint differs (the GPU tests compare them).

Without cuTile's disk cache (``CUDA_TILE_CACHE_DIR=off``) the child could hand nothing over, so
the tuned build compiles in the first call; ``SSD_QUICK_FIRST_CALL=0`` asks for that
too. A CUDA-graph capture waits for the tuned build, so a graph never holds the quick one.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import typing
from dataclasses import dataclass
from typing import NamedTuple

import cuda.tile as ct


INT32_MAX = 2**31 - 1


def index_dtype_for(*tensors) -> "ct.DType":
    """int64 indexing only where a tensor has 2**31 elements or more, or its elements lie that
    far apart in memory (a view such as a column slice of a wider tensor: its offsets reach past
    its element count); address arithmetic would overflow in int32 there. int32 everywhere
    else because it is cheaper."""
    def reach(t):
        if t.numel() == 0:
            return 0
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        return max(t.numel(), span)

    big = any(t is not None and reach(t) > INT32_MAX for t in tensors)
    return ct.int64 if big else ct.int32


# The GPU a CPU tensor stands for (under capture): the one the defaults are tuned on, sm_90 with
# 132 SMs (H100 SXM, H200), so that the CPU resolves the configuration a call there would.
CAPTURE_GPU = ((9, 0), 132)


def gpu_facts(device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of ``device``; CAPTURE_GPU for a CPU device."""
    if device.type == "cpu":
        return CAPTURE_GPU
    import torch

    gpu = torch.cuda.get_device_properties(device)
    return (gpu.major, gpu.minor), gpu.multi_processor_count


def chunk_seq_last(seq_idx, chunk_size: int):
    """(b, l) int -> (b, c) int32: seq_idx at the last valid position of every chunk (the
    kernels that carry a state across chunks read whether the next chunk continues it)."""
    import torch

    l = seq_idx.shape[1]
    last = torch.arange(chunk_size - 1, l + chunk_size - 1, chunk_size, device=seq_idx.device)
    return seq_idx[:, last.clamp_(max=l - 1)].to(torch.int32).contiguous()


def array_type(index_dtype) -> typing.Any:
    """The kernel-parameter annotation for an array indexed with ``index_dtype``."""
    return typing.Annotated[ct.Array, ct.ArrayAnnotation(index_dtype=index_dtype)]


@dataclass(frozen=True)
class Launch:
    kernel: "ct.kernel"
    grid: tuple
    args: tuple


_handler = None  # called with each Launch in place of running it (see intercept)


@contextlib.contextmanager
def intercept(handler):
    """Hand every launch to ``handler``, called with its :class:`Launch`, instead of running
    it: :func:`capture` records them; the tests' CPU emulator of the tile code
    (tests/tile_emulator.py) runs them."""
    global _handler
    previous, _handler = _handler, handler
    try:
        yield
    finally:
        _handler = previous


@contextlib.contextmanager
def capture():
    """Record launches instead of running them (for ahead-of-time compilation)."""
    records = []
    with intercept(records.append):
        yield records


def capturing() -> bool:
    """Whether launches go to a handler (:func:`intercept`, :func:`capture`) rather than run."""
    return _handler is not None


def on_launch_device(t) -> bool:
    """Whether the launchers take tensor ``t``: on a CUDA device, or on the CPU while launches
    are captured (recorded, nothing run: ahead-of-time builds, the host path's profile)."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and capturing())


@dataclass
class Trace:
    """What a host path did, as :func:`trace` saw it: its launches, in order, as
    ``(Launch, QuickFirst or None)`` pairs, and the stand-ins :func:`optional` made for absent
    inputs (id -> tensor: held, so that no other tensor takes an id while the trace lives)."""
    launches: list
    stand_ins: dict


_tracing = threading.local()  # .trace: the Trace this thread records into, if any


@contextlib.contextmanager
def trace():
    """Record launches with their quick builds, and the stand-ins of absent inputs, instead of
    running them, in this thread only (a serving thread beside it launches as usual). How
    :mod:`ssd.api` learns once what a call launches, to replay it on later calls. Inside
    :func:`capture` too, the trace gets the launches."""
    previous, _tracing.trace = getattr(_tracing, "trace", None), Trace([], {})
    try:
        yield _tracing.trace
    finally:
        _tracing.trace = previous


_launched: set = set()  # kernels launched at least once in this process


@functools.lru_cache(maxsize=None)
def _param_names(kernel) -> tuple:
    return tuple(inspect.signature(kernel._pyfunc).parameters)  # once a kernel: a launch is hot


def kernel_args(kernel, args: dict) -> tuple:
    """``args`` (kernel parameter name -> value) in the order of ``kernel``'s parameters: a
    launcher names every argument, so none can slip into another's place. Raises ValueError
    naming the parameters missing or unknown."""
    names = _param_names(kernel)
    if args.keys() != set(names):
        missing, unknown = sorted(set(names) - set(args)), sorted(set(args) - set(names))
        raise ValueError(f"{kernel._pyfunc.__name__}: missing {missing}, unknown {unknown}")
    return tuple(_launchable(kernel, name, args[name]) for name in names)


def _launchable(kernel, name: str, value):
    """``value`` as a launch takes it. A tensor that requires grad (a trained D or dt_bias read
    by the decode step, say) is read through a detached view where grad mode is off; with grad
    mode on, the launch would drop the gradient silently, so it raises instead (differentiable
    entry points run their kernels inside an autograd.Function, where grad mode is off)."""
    if not getattr(value, "requires_grad", False):
        return value
    import torch

    if torch.is_grad_enabled():
        raise ValueError(f"{kernel._pyfunc.__name__}: {name} requires grad, and this kernel has "
                         "no backward: call it under torch.no_grad(), or through a "
                         "differentiable entry point")
    return value.detach()


class Step(NamedTuple):
    """One launch as :func:`run` takes it: the kernel, its grid, and, for a kernel with a quick
    first build, its :class:`QuickFirst` and :func:`launch_key` (computed once by a caller that
    launches the same signature again, instead of at every launch)."""
    kernel: object  # cuda.tile kernel
    grid: tuple
    quick: QuickFirst | None = None
    key: tuple | None = None


def launch(kernel, grid: tuple, args: dict, device=None, quick=None) -> None:
    """Launch ``kernel`` over ``grid`` with ``args`` (parameter name -> value, see
    :func:`kernel_args`) on the current stream of ``device``, or record it under
    :func:`trace`, or hand it to the handler of :func:`intercept` (:func:`capture` records it).

    quick: a :class:`QuickFirst` for a kernel whose tuned build compiles for long; until that
    build is ready the quick one runs in its place (see the module docstring).
    """
    grid, args = tuple(grid), kernel_args(kernel, args)
    recording = getattr(_tracing, "trace", None)
    if recording is not None:
        recording.launches.append((Launch(kernel, grid, args), quick))
        return
    key = launch_key(kernel, args) if quick is not None else None
    run((Step(kernel, grid, quick, key),), (args,), device)


def run(steps, arguments, device) -> None:
    """Launch each of ``steps`` (:class:`Step`) with its argument tuple from ``arguments``
    (in the kernel's parameter order), in order, on the current stream of ``device``; under
    :func:`intercept`, hand them to its handler instead."""
    if _handler is not None:
        for step, args in zip(steps, arguments, strict=True):
            _handler(Launch(step.kernel, step.grid, args))
        return
    import torch

    index = device.index if isinstance(device, torch.device) else device
    if index is None or index == torch.cuda.current_device():
        _run(steps, arguments)  # entering the device would change nothing: skip its cost
        return
    with torch.cuda.device(device):
        _run(steps, arguments)


def _run(steps, arguments) -> None:
    """:func:`run` on the current device."""
    import torch

    stream = torch.cuda.current_stream()
    for step, args in zip(steps, arguments, strict=True):
        kernel = step.kernel
        if step.quick is not None and step.key not in settled:
            arch = "sm_{}{}".format(*torch.cuda.get_device_capability())
            kernel = pick(step.key, step.quick, Launch(kernel, step.grid, args), arch,
                          torch.cuda.is_current_stream_capturing())
        if kernel in _launched:
            ct.launch(stream, step.grid, kernel, args)
            continue
        # A first launch compiles (seconds, in silence otherwise); later ones of other
        # signatures compile too, and say nothing.
        name = kernel._pyfunc.__name__.removesuffix("_kernel")
        log.info("%s: first launch in this process (compiles unless cached)", name)
        start = time.perf_counter()
        ct.launch(stream, step.grid, kernel, args)
        _launched.add(kernel)
        log.info("%s: launched after %.1f s", name, time.perf_counter() - start)


@functools.lru_cache(maxsize=None)
def _param_kinds(kernel) -> tuple:
    """For each kernel parameter: ('const', None), ('array', index_dtype) or ('scalar', None)."""
    kinds = []
    hints = typing.get_type_hints(kernel._pyfunc, include_extras=True)
    for name in _param_names(kernel):
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


def check_array(name: str, tensor, shape: tuple, dtypes: tuple) -> tuple:
    """A launcher's input check: ``tensor`` (the argument ``name``) is a torch tensor of one of
    ``dtypes`` (torch dtypes) whose shape matches ``shape``, an int per axis or a letter for an
    axis of any size. Returns its shape; raises ValueError naming the argument, the shape and
    dtypes expected and what it got."""
    import torch

    want = "(" + ", ".join(str(d) for d in shape) + ")"
    expected = f"expected a {want} tensor of {' / '.join(str(d) for d in dtypes)}"
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: {expected}, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or tensor.dtype not in dtypes or any(
            isinstance(d, int) and d != got for d, got in zip(shape, tensor.shape)):
        raise ValueError(f"{name}: {expected}, got {tuple(tensor.shape)} {tensor.dtype}")
    return tuple(tensor.shape)


def flattens(tensor, rows: int, width: int) -> bool:
    """Whether ``tensor`` (..., width) views as (rows, width) without a copy, as a kernel that
    walks rows of a flat array reads it."""
    try:
        tensor.view(rows, width)
    except RuntimeError:
        return False
    return True


def optional(tensor, ndim: int, dtype, device):
    """``tensor``, or a one-element stand-in when it is None (the kernel's flag for it is off).

    Kernels take a fixed parameter list; passing another argument in its place would alias
    two kernel arrays, which cuTile forbids even when one of them is never touched. Never
    touched, its contents do not matter: ``empty`` allocates without launching a fill kernel
    (``zeros`` launched one per absent input per forward). Under :func:`trace` the stand-in is
    noted, so that a replayed call (:mod:`ssd.api`'s plans) passes the same one again instead
    of allocating another.
    """
    import torch

    if tensor is not None:
        return tensor
    stand_in = torch.empty((1,) * ndim, dtype=dtype, device=device)
    recording = getattr(_tracing, "trace", None)
    if recording is not None:
        recording.stand_ins[id(stand_in)] = stand_in
    return stand_in


# --- quick first calls ------------------------------------------------------------------------

log = logging.getLogger("ssd")


@dataclass(frozen=True)
class Rebuild:
    """How another process builds the same kernel: ``module.function(*args)`` (arguments that
    JSON can carry, cuTile dtypes among them)."""
    module: str
    function: str
    args: tuple = ()

    def encode(self) -> str:
        import cuda.tile as ct

        args = [{"dtype": a.name} if isinstance(a, ct.DType) else a for a in self.args]
        return json.dumps(dict(module=self.module, function=self.function, args=args))

    @staticmethod
    def decode(text: str):
        """The kernel that ``Rebuild.encode`` describes."""
        import cuda.tile as ct

        spec = json.loads(text)
        args = [getattr(ct, a["dtype"]) if isinstance(a, dict) else a for a in spec["args"]]
        return getattr(importlib.import_module(spec["module"]), spec["function"])(*args)


@dataclass(frozen=True)
class QuickFirst:
    """A launch's quick build and how a child process builds its tuned one."""
    quick: object  # cuda.tile kernel: the same tile code, compiled fast
    tuned: Rebuild


@dataclass
class _Build:
    name: str
    proc: subprocess.Popen
    stderr: object  # a temporary file: a pipe left unread could fill and stall the child
    started: float


_pending: dict = {}   # launch key -> the _Build of its tuned kernel
settled: set = set()  # launch keys whose tuned kernel launches as itself from now on


def launch_key(kernel, args) -> tuple:
    """What cuTile's launcher compiles ``kernel`` for with ``args``, nearly: the constants and
    scalars, and each array's dtype, shape and strides. (Not its base address: a view that is not
    16-byte aligned gets another signature, and its tuned build compiles at its first launch.) A
    shape never seen before gets its own background build even where the process has launched
    the kernel for other shapes."""
    return (kernel, *((a.dtype, a.shape, a.stride()) if hasattr(a, "stride") else a for a in args))


def cache_dir() -> str | None:
    """cuTile's kernel cache folder in this process (None: the cache is off). cuTile reads it
    from the environment once, at import; its inspector package has the same reader."""
    from cutile_cache._env import get_cache_dir_from_env

    return get_cache_dir_from_env()


def enabled() -> bool:
    return os.environ.get("SSD_QUICK_FIRST_CALL", "1") != "0" and cache_dir() is not None


def pick(key, quick: QuickFirst, record, arch: str, capturing: bool):
    """The kernel to launch for ``record`` (a :class:`Launch` of a tuned kernel, whose
    :func:`launch_key` is ``key``, not yet settled): the quick build while the tuned build compiles
    in a child process (started here at the key's first launch), the tuned kernel once that is
    done. ``capturing``: a CUDA graph is being captured, which waits for the tuned build."""
    build = _pending.get(key)
    if build is None:
        if not enabled():
            settled.add(key)
            return record.kernel
        build = _pending[key] = start(record, quick.tuned, arch, cache_dir())
        log.info("%s: compiling its tuned build in the background (pid %d); a quick build "
                 "(occupancy 1) runs until it is in the kernel cache", build.name, build.proc.pid)
    if build.proc.poll() is None and not capturing:
        return quick.quick
    _finish(key)
    return record.kernel


def start(record, tuned: Rebuild, arch: str, cache: str) -> _Build:
    """Start a child process that compiles ``tuned`` for ``record``'s signature on ``arch``
    into the cuTile kernel cache at ``cache``."""
    name = record.kernel._pyfunc.__name__
    symbol = signature(record).with_mangled_symbol(name).symbol
    # The child imports what this process imports, from where it imports it.
    env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "ssd.launch", arch, symbol, tuned.encode()],
                            env=env, stdout=subprocess.DEVNULL, stderr=err)
    return _Build(name.removesuffix("_kernel"), proc, err, time.perf_counter())


def _finish(key, timeout: float | None = None) -> None:
    build = _pending.pop(key)
    try:
        code = build.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _pending[key] = build
        raise
    seconds = time.perf_counter() - build.started
    if code:
        build.stderr.seek(0)
        tail = build.stderr.read().decode(errors="replace")[-800:]
        log.warning("%s: the background build failed (exit %d); the tuned build compiles at its "
                    "next launch instead:\n%s", build.name, code, tail)
    else:
        log.info("%s: tuned build ready after %.1f s", build.name, seconds)
    build.stderr.close()
    settled.add(key)


def wait_tuned(timeout: float | None = None) -> int:
    """Wait until every tuned build compiling in the background is in the kernel cache, so that
    every later launch runs tuned kernels (benchmarks call this before timing). Returns how many
    builds it waited for; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds a build."""
    keys = list(_pending)
    for key in keys:
        _finish(key, timeout)
    return len(keys)


def main(argv=None) -> int:
    """The child: ``python -m ssd.launch ARCH SYMBOL REBUILD``."""
    from cuda.tile import compilation

    arch, symbol, rebuild = argv if argv is not None else sys.argv[1:]
    kernel = Rebuild.decode(rebuild)
    name, signature = compilation.demangle_kernel_name(symbol)
    if name != kernel._pyfunc.__name__:
        raise SystemExit(f"ssd.launch: {rebuild} builds {kernel._pyfunc.__name__}, not {name}")
    compilation.export_kernel(kernel, [signature], io.BytesIO(), gpu_code=arch,
                              output_format="cubin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
