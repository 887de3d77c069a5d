"""A NumPy stand-in for the part of ``cuda.tile`` the ``ssd`` kernels use: runs a kernel's
Python body on the CPU, block by block, on torch CPU tensors (test infrastructure, not the
library).

:func:`run` calls ``kernel._pyfunc`` once for every block of the grid, in row-major block
order, with the name ``ct`` bound to this module's stand-in ops (:data:`ct`) in the kernel's
module and in every module that imports ``cuda.tile`` as ``ct`` (the tile helpers it calls,
e.g. ``ssd.kernels.tiles``), restored afterwards (not thread-safe). :func:`emulated` runs every
launch of ``ssd.launch.launch`` that way (through ``ssd.launch.intercept``; the launchers' host
code runs unchanged, with the real ``cuda.tile``), and :func:`replay` runs a list of launches
recorded by ``ssd.launch.capture``. Tiles are NumPy arrays; arrays are NumPy views of the
tensors, so stores land in the tensors.

What it checks, per the cuTile docs (``cuda.tile`` docstrings of ``load``, ``store``,
``mma``, ``gather``, ``extract``):

* index arithmetic: every load and store goes through the tile space of its shape and order
  (``order`` a permutation, "C" or "F"); a tile wholly outside the array, a negative tile
  index, an index tuple of the wrong rank and a tile dimension that is not a power of two
  raise;
* padding: a partially out-of-bounds load fills per ``padding_mode``; UNDETERMINED padding
  (the default) fills floats with NaN, so a kernel that lets such a value reach an output shows
  it, and raises for integer arrays (no value would be safe);
* masks and which elements are written: a partially out-of-bounds store drops the outside
  elements; with outputs poisoned with NaN before the run, an element no block writes stays
  NaN. Within one launch, an element written by two blocks, or read by one block and written
  by another, raises (the result would depend on the blocks' order on a GPU);
* aliasing: two array arguments that share memory raise (cuTile forbids it);
* dtypes: ``mma`` takes operands of one dtype and an accumulator of the dtype the docs' table
  allows (f16 -> f16 or f32, bf16 -> f32, f32 -> f32, f64 -> f64); a store casts only where the cast is
  implicit in cuTile (the tile's dtype promotes to the array's), a narrowing store raises.

What it cannot check: the rounding of real tensor-core MMAs (here: float64 products and sums,
rounded once to the accumulator's dtype; fp32 operands may run as TF32 or split products on a
GPU), the order of floating-point reductions, flush-to-zero beyond ``exp``/``exp2``'s flag,
int32 overflow of index arithmetic (Python ints here), scheduling, memory-model races beyond the
two above (atomics are not emulated), compile errors (the AOT tests), performance, resource
limits.

bfloat16 tiles and arrays are ``ml_dtypes.bfloat16`` NumPy arrays (a bfloat16 tensor is read
and written through an int16 view of its memory). Strict where unsure: ops not listed in
:data:`OPS` raise instead of guessing (the tile helpers must not silently run with real ``cuda.tile`` ops), ``check_bounds=
False`` raises for a tile not wholly inside the array, and integer ``//`` and ``%`` are
Python's (floor) on scalars; the kernels only divide non-negative indices.
"""
from __future__ import annotations

import builtins
import contextlib
import inspect
import sys
import types

import ml_dtypes
import numpy as np

import cuda.tile as real_ct

from ssd import launch as _launch

PaddingMode = real_ct.PaddingMode
_PAD_VALUE = {PaddingMode.ZERO: 0.0, PaddingMode.NEG_ZERO: -0.0, PaddingMode.NAN: np.nan,
              PaddingMode.POS_INF: np.inf, PaddingMode.NEG_INF: -np.inf}
#: mma: operand dtype -> the accumulator dtypes the cuTile docs allow
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
_MMA_ACC = {np.dtype(np.float16): (np.dtype(np.float16), np.dtype(np.float32)),
            BFLOAT16: (np.dtype(np.float32),),
            np.dtype(np.float32): (np.dtype(np.float32),),
            np.dtype(np.float64): (np.dtype(np.float64),)}


class EmulationError(AssertionError):
    """A kernel did something the cuTile docs leave undefined, or that the emulator refuses."""


class _State:
    """The block being run and, per array, which block last wrote and read each element in the
    current launch (-1: none, -2: several blocks read it)."""

    def __init__(self):
        self.grid = (1, 1, 1)
        self.bid = (0, 0, 0)
        self.block = 0
        self.writers = {}
        self.readers = {}

    def maps(self, array, order):
        """The writer and reader maps of kernel argument ``array``, in the tile space's
        ``order``."""
        key = id(array)
        if key not in self.writers:
            self.writers[key] = np.full(array.shape, -1, np.int32)
            self.readers[key] = np.full(array.shape, -1, np.int32)
        return _view(self.writers[key], order), _view(self.readers[key], order)


_state = _State()


def _pow2(shape, what):
    for d in shape:
        if d < 1 or d & (d - 1):
            raise EmulationError(f"{what}: tile shape {tuple(shape)} has a dimension that is not "
                                 "a power of two")


def _view(array, order):
    if order == "C":
        return array
    if order == "F":
        return array.transpose(tuple(range(array.ndim))[::-1])
    order = tuple(order)
    if sorted(order) != list(range(array.ndim)):
        raise EmulationError(f"order {order} is not a permutation of {array.ndim} axes")
    return array.transpose(order)


def _region(array, index, shape, what, check_bounds):
    """The slices of ``array`` (already permuted) that tile ``index`` of ``shape`` covers, and
    the slices of the tile that lie inside the array."""
    if isinstance(index, (int, np.integer)):
        index = (index,)
    index = tuple(int(i) for i in index)
    if len(index) != array.ndim or len(shape) != array.ndim:
        raise EmulationError(f"{what}: index {index} / shape {tuple(shape)} for a rank "
                             f"{array.ndim} array")
    inside, part = [], []
    for axis, (i, s, n) in enumerate(zip(index, shape, array.shape)):
        start = i * s
        if i < 0 or start >= n:
            raise EmulationError(f"{what}: tile {index} of shape {tuple(shape)} lies wholly "
                                 f"outside the {tuple(array.shape)} array (axis {axis}): "
                                 "undefined in cuTile")
        stop = builtins.min(start + s, n)
        if stop - start < s and not check_bounds:
            raise EmulationError(f"{what}: check_bounds=False but tile {index} of shape "
                                 f"{tuple(shape)} crosses the end of axis {axis}")
        inside.append(slice(start, stop))
        part.append(slice(0, stop - start))
    return tuple(inside), tuple(part)


def _race_on_read(array, order, inside, what):
    writers, readers = _state.maps(array, order)
    w = writers[inside]
    other = (w >= 0) & (w != _state.block)
    if other.any():
        raise EmulationError(f"{what}: block {_state.bid} reads elements block "
                             f"{_block_of(int(w[other].flat[0]))} wrote in the same launch")
    r = readers[inside]
    readers[inside] = np.where((r == -1) | (r == _state.block), _state.block, -2)


def _race_on_write(array, order, inside, what):
    writers, readers = _state.maps(array, order)
    w, r = writers[inside], readers[inside]
    other = (w >= 0) & (w != _state.block)
    if other.any():
        raise EmulationError(f"{what}: block {_state.bid} writes elements block "
                             f"{_block_of(int(w[other].flat[0]))} wrote in the same launch")
    read = (r == -2) | ((r >= 0) & (r != _state.block))
    if read.any():
        raise EmulationError(f"{what}: block {_state.bid} writes elements another block read in "
                             "the same launch")
    writers[inside] = _state.block


def _block_of(linear):
    _, gy, gz = _state.grid
    return (linear // (gy * gz), linear // gz % gy, linear % gz)


# --- the ops ----------------------------------------------------------------------------------


def bid(axis):
    return _state.bid[axis]


def num_blocks(axis):
    return _state.grid[axis]


def num_tiles(array, axis, shape, order="C"):
    view = _view(array, order)
    return -(-view.shape[axis] // tuple(shape)[axis])


def load(array, index, shape, *, order="C", padding_mode=PaddingMode.UNDETERMINED,
         check_bounds=True, latency=None, allow_tma=None, **memory):
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(shape)
    scalar = shape == ()
    view = _view(array, order)
    full_shape = (1,) * view.ndim if scalar else shape
    _pow2(full_shape, "load")
    inside, part = _region(view, index, full_shape, "load", check_bounds)
    _race_on_read(array, order, inside, "load")
    data = view[inside]
    if data.shape == full_shape:
        tile = np.array(data)
    else:
        if padding_mode is PaddingMode.UNDETERMINED:
            if data.dtype.kind != "f":
                raise EmulationError(f"load: tile {tuple(index)} of shape {shape} crosses the end "
                                     f"of an integer {tuple(view.shape)} array with undetermined "
                                     "padding")
            fill = np.nan  # any value: NaN makes a use of it visible
        else:
            fill = _PAD_VALUE[padding_mode]
            if data.dtype.kind != "f" and not np.isfinite(fill):
                raise EmulationError(f"load: padding {padding_mode} for an integer array")
        tile = np.full(full_shape, fill, dtype=data.dtype)
        tile[part] = data
    return tile.reshape(()) if scalar else tile


def store(array, index, tile, *, order="C", check_bounds=True, latency=None, allow_tma=None,
          **memory):
    view = _view(array, order)
    if isinstance(tile, (bool, int, float)):  # a Python constant takes the array's dtype
        tile = np.full((1,) * view.ndim, tile, dtype=view.dtype)
    tile = np.asarray(tile)
    if tile.ndim == 0:  # a 0-d tile is broadcast to the array's rank
        tile = tile.reshape((1,) * view.ndim)
    if tile.ndim != view.ndim:
        raise EmulationError(f"store: a rank {tile.ndim} tile into a rank {view.ndim} array")
    if np.promote_types(tile.dtype, view.dtype) != view.dtype:
        raise EmulationError(f"store: a {tile.dtype} tile into a {view.dtype} array needs an "
                             "explicit astype (not an implicit cast in cuTile)")
    _pow2(tile.shape, "store")
    inside, part = _region(view, index, tile.shape, "store", check_bounds)
    _race_on_write(array, order, inside, "store")
    view[inside] = tile[part]


def _indexed(op, array, indices, mask, check_bounds):
    """gather's and scatter's index tiles, broadcast together, and where each element is
    inside ``array`` and not masked off."""
    if not isinstance(indices, tuple):
        indices = (indices,)
    if len(indices) != array.ndim:
        raise EmulationError(f"{op}: {len(indices)} index tiles for a rank {array.ndim} array")
    idx = np.broadcast_arrays(*(np.asarray(i) for i in indices))
    ok = np.ones(idx[0].shape, dtype=bool)
    for i, n in zip(idx, array.shape):
        ok &= (i >= 0) & (i < n)
    if not check_bounds and not ok.all():
        raise EmulationError(f"{op}: check_bounds=False with an index outside the array")
    if mask is not None:
        ok = ok & np.broadcast_to(np.asarray(mask), ok.shape)
    return idx, ok


def gather(array, indices, *, mask=None, padding_value=0, check_bounds=True, latency=None):
    idx, ok = _indexed("gather", array, indices, mask, check_bounds)
    safe = tuple(np.where(ok, i, 0) for i in idx)
    _race_on_read_elements(array, safe, ok)
    out = np.where(ok, array[safe], np.asarray(padding_value, dtype=array.dtype))
    return out.astype(array.dtype)


def scatter(array, indices, value, *, mask=None, check_bounds=True, latency=None):
    """Store ``value`` at the elements ``indices`` name; an index outside the array, or
    masked off, stores nothing."""
    idx, ok = _indexed("scatter", array, indices, mask, check_bounds)
    value = np.broadcast_to(np.asarray(value), idx[0].shape)
    if np.promote_types(value.dtype, array.dtype) != array.dtype:
        raise EmulationError(f"scatter: {value.dtype} into a {array.dtype} array narrows: "
                             "astype first")
    sel = tuple(i[ok] for i in idx)
    writers, readers = _state.maps(array, "C")
    w, r = writers[sel], readers[sel]
    others_wrote = (w >= 0) & (w != _state.block)
    others_read = (r == -2) | ((r >= 0) & (r != _state.block))
    if others_wrote.any() or others_read.any():
        raise EmulationError(f"scatter: block {_state.bid} writes elements another block read or "
                             "wrote in the same launch")
    writers[sel] = _state.block
    array[sel] = value[ok]


def _race_on_read_elements(array, idx, ok):
    writers, readers = _state.maps(array, "C")
    w = writers[idx][ok]
    if ((w >= 0) & (w != _state.block)).any():
        raise EmulationError(f"gather: block {_state.bid} reads elements another block wrote in "
                             "the same launch")
    sel = tuple(i[ok] for i in idx)
    r = readers[sel]
    readers[sel] = np.where((r == -1) | (r == _state.block), _state.block, -2)


def mma(x, y, acc, *, use_fast_acc=False):
    x, y, acc = np.asarray(x), np.asarray(y), np.asarray(acc)
    if x.dtype != y.dtype:
        raise EmulationError(f"mma: operands of two dtypes, {x.dtype} and {y.dtype} (cuTile does "
                             "not promote them)")
    if acc.dtype not in _MMA_ACC.get(x.dtype, ()):
        raise EmulationError(f"mma: {x.dtype} operands with a {acc.dtype} accumulator")
    if x.ndim not in (2, 3) or y.ndim != x.ndim or x.shape[-1] != y.shape[-2]:
        raise EmulationError(f"mma: shapes {x.shape} @ {y.shape}")
    out = np.matmul(x.astype(np.float64), y.astype(np.float64)) + acc
    if out.shape != acc.shape:
        raise EmulationError(f"mma: {x.shape} @ {y.shape} into a {acc.shape} accumulator")
    return out.astype(acc.dtype)


def arange(size, *, dtype, start=0, step=1):
    _pow2((size,), "arange")
    return (start + step * np.arange(size)).astype(np.dtype(dtype))


def full(shape, fill_value, dtype):
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    _pow2(shape, "full")
    return np.full(shape, fill_value, dtype=np.dtype(dtype))


def zeros(shape, dtype):
    return full(shape, 0, dtype)


def ones(shape, dtype):
    return full(shape, 1, dtype)


def _ftz(r, flush_to_zero):
    r = np.asarray(r)
    if flush_to_zero and r.dtype.kind == "f":
        r = np.where(np.abs(r) < np.finfo(r.dtype).tiny, np.zeros((), r.dtype), r)
    return r


def exp(x, *, flush_to_zero=False):
    return _ftz(np.exp(x), flush_to_zero)


def exp2(x, *, flush_to_zero=False):
    return _ftz(np.exp2(x), flush_to_zero)


def log(x):
    return np.log(x)


def rsqrt(x, *, flush_to_zero=False):
    return _ftz(1.0 / np.sqrt(x), flush_to_zero)


def minimum(x, y, *, flush_to_zero=False, propagate_nan=False):
    return np.minimum(x, y)


def maximum(x, y, *, flush_to_zero=False, propagate_nan=False):
    return np.maximum(x, y)


def where(cond, x, y):
    return np.where(cond, x, y)


def _reduce(f, x, axis, keepdims):
    x = np.asarray(x)
    return f(x, axis=axis, keepdims=keepdims).astype(x.dtype)


def sum(x, axis=None, *, keepdims=False, rounding_mode=None, flush_to_zero=False):
    return _reduce(np.sum, x, axis, keepdims)


def max(x, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    return _reduce(np.max, x, axis, keepdims)


def min(x, axis=None, *, keepdims=False, flush_to_zero=False, propagate_nan=False):
    return _reduce(np.min, x, axis, keepdims)


def cumsum(x, axis=0, *, reverse=False, rounding_mode=None, flush_to_zero=False):
    x = np.asarray(x)
    if reverse:
        return np.flip(np.cumsum(np.flip(x, axis), axis=axis), axis).astype(x.dtype)
    return np.cumsum(x, axis=axis).astype(x.dtype)


def transpose(x, axis0=None, axis1=None):
    x = np.asarray(x)
    if axis0 is None and axis1 is None:
        if x.ndim != 2:
            raise EmulationError(f"transpose: a rank {x.ndim} tile needs axis0 and axis1")
        return x.T.copy()
    return np.swapaxes(x, axis0, axis1).copy()


def permute(x, axes):
    return np.transpose(x, tuple(axes)).copy()


def reshape(x, shape):
    return np.reshape(x, shape)


def astype(x, dtype, *, rounding_mode=None):
    return np.asarray(x).astype(np.dtype(dtype))


def extract(x, index, shape):
    x = np.asarray(x)
    if isinstance(index, (int, np.integer)):
        index = (index,)
    if len(index) != x.ndim or len(shape) != x.ndim or any(
            n % s for n, s in zip(x.shape, shape)):
        raise EmulationError(f"extract: shape {tuple(shape)} from a {x.shape} tile")
    if any(not 0 <= int(i) < n // s for i, n, s in zip(index, x.shape, shape)):
        raise EmulationError(f"extract: subtile {tuple(index)} of {tuple(shape)} outside a "
                             f"{x.shape} tile")
    return x[tuple(slice(int(i) * s, (int(i) + 1) * s) for i, s in zip(index, shape))].copy()


def cdiv(x, y):
    return -((-x) // y)


def static_iter(iterable):
    return list(iterable)


#: The names the stand-in provides, as ``ct.<name>`` in kernel code.
OPS = dict(
    bid=bid, num_blocks=num_blocks, num_tiles=num_tiles, load=load, store=store, gather=gather,
    scatter=scatter,
    mma=mma, arange=arange, full=full, zeros=zeros, ones=ones, exp=exp, exp2=exp2, log=log,
    rsqrt=rsqrt, minimum=minimum, maximum=maximum, where=where, sum=sum, max=max, min=min,
    cumsum=cumsum, transpose=transpose, permute=permute, reshape=reshape, astype=astype,
    extract=extract, cdiv=cdiv, static_iter=static_iter, PaddingMode=PaddingMode,
    Constant=real_ct.Constant, float16=np.float16, float32=np.float32, float64=np.float64,
    int32=np.int32, int64=np.int64, bool_=np.bool_, bfloat16=ml_dtypes.bfloat16,
)


class _Namespace(types.SimpleNamespace):
    def __getattr__(self, name):  # only for names not set: an op the emulator lacks
        raise EmulationError(f"ct.{name} is not emulated (tests/tile_emulator.py)")


ct = _Namespace(**OPS)


# --- running kernels --------------------------------------------------------------------------


def _as_array(value, name):
    import torch

    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise EmulationError(f"{name}: a {value.device} tensor; the emulator runs on CPU ones")
        if value.dtype == torch.bfloat16:  # NumPy has none: ml_dtypes' over the same memory
            return value.detach().view(torch.int16).numpy().view(BFLOAT16)
        return value.detach().numpy()
    return value


@contextlib.contextmanager
def _tile_modules(pyfunc):
    """``ct`` bound to the stand-in in the kernel's globals and in every module that binds it to
    ``cuda.tile`` (the tile helpers the kernel calls: ssd.kernels.tiles, a test's own)."""
    # the modules' own dicts: a module-level __getattr__ (lazy imports) is never triggered
    spaces = [pyfunc.__globals__] + [d for m in list(sys.modules.values())
                                     if (d := getattr(m, "__dict__", None)) is not None
                                     and d.get("ct") is real_ct]
    saved = []
    for space in spaces:
        if space.get("ct") is real_ct:
            saved.append((space, space["ct"]))
            space["ct"] = ct
    try:
        yield
    finally:
        for space, value in saved:
            space["ct"] = value


def run(kernel, grid, *args):
    """Run ``kernel`` (a ``cuda.tile`` kernel) over every block of ``grid`` (1 to 3 ints) with
    ``args`` (in the kernel's parameter order: torch CPU tensors or NumPy arrays for arrays,
    Python values for scalars and constants). Stores write into the tensors. Raises
    :class:`EmulationError` where the kernel leaves cuTile's defined behaviour (module
    docstring)."""
    pyfunc = kernel._pyfunc
    names = list(inspect.signature(pyfunc).parameters)
    if len(args) != len(names):
        raise EmulationError(f"{pyfunc.__name__}: {len(args)} arguments for {names}")
    arrays = [_as_array(a, n) for a, n in zip(args, names)]
    views = [(n, a) for n, a in zip(names, arrays) if isinstance(a, np.ndarray)]
    for i, (name, a) in enumerate(views):
        for other, b in views[i + 1:]:
            if np.may_share_memory(a, b):
                raise EmulationError(f"{pyfunc.__name__}: arrays {name} and {other} share memory "
                                     "(cuTile kernels take no aliased arrays)")
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    _state.grid, _state.writers, _state.readers = grid, {}, {}
    try:
        with _tile_modules(pyfunc):
            for block, coords in enumerate(np.ndindex(*grid)):
                _state.bid, _state.block = coords, block
                pyfunc(*arrays)
    finally:
        _state.writers, _state.readers = {}, {}


def replay(records):
    """Run launches recorded by ``ssd.launch.capture()``, in order."""
    for record in records:
        run(record.kernel, record.grid, *record.args)


@contextlib.contextmanager
def emulated():
    """Every ``ssd.launch.launch`` in the block runs on the emulator, at once, in place (the
    launchers' host code between and after launches sees the results)."""
    with _launch.intercept(lambda record: run(record.kernel, record.grid, *record.args)):
        yield
