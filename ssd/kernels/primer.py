"""Three small cuTile kernels for the primer chapter (notebook 04); the SSD never calls them.

Each one shows an idea the SSD stages rely on, in isolation:

* :func:`scale_add` -- ``out = alpha * x + y`` on a 2-D array, one [TILE_M, TILE_N] tile per
  block: load and store by *tile-space* index, a ragged edge handled by padding on load and
  clipping on store, a runtime scalar next to compile-time tile sizes, and 32- vs 64-bit
  indexing chosen by the launcher.
* :func:`row_stats` -- per row of a 2-D array its sum (``ct.sum``), its maximum (``ct.max``)
  and its running sum (``ct.cumsum``): reductions and scans along a tile axis, and why the
  padding value must be the identity of the operation (0 for a sum, -inf for a max).
* :func:`matmul` -- ``c = a @ b`` with a K loop of ``ct.mma`` into an fp32 accumulator,
  the pattern of every matrix product in ``chunk_state`` and ``chunk_scan``.

Host launchers end in :func:`ssd.launch.launch`, so under :func:`ssd.launch.capture` they
record instead of running and :func:`compile_primer` can export cubins on a CPU-only machine.
"""

import functools
import io
import time
from dataclasses import dataclass

import cuda.tile as ct

from ..launch import array_type, capture, index_dtype_for, launch, signature
from ..config import next_pow2
from .tiles import ConstInt, ZERO

NEG_INF = ct.PaddingMode.NEG_INF
ARCHS = ("sm_80", "sm_90", "sm_100")


def kernel_source(kernel) -> str:
    """The Python source of a ``@ct.kernel`` (or of any function), decorator included."""
    import inspect

    return inspect.getsource(getattr(kernel, "_pyfunc", kernel))


def constant_params(kernel) -> list:
    """Names of a kernel's ``ct.Constant`` parameters: the values it is specialised on."""
    import inspect

    from ..launch import _param_kinds

    names = inspect.signature(kernel._pyfunc).parameters
    return [name for name, (kind, _) in zip(names, _param_kinds(kernel)) if kind == "const"]


# ----------------------------------------------------------------------------- scale_add

@functools.lru_cache(maxsize=None)
def build_scale_add_kernel(index_dtype=ct.int32):
    """The scale-and-add kernel for arrays indexed with ``index_dtype`` (one kernel object per
    index type, so each keeps its own compile cache)."""
    Array = array_type(index_dtype)

    @ct.kernel
    def scale_add_kernel(x: Array, y: Array, out: Array, alpha: float,
                         TILE_M: ConstInt, TILE_N: ConstInt):
        """out = alpha * x + y.  Grid: (cdiv(M, TILE_M), cdiv(N, TILE_N)).

        Args:
            x, y: (M, N) input arrays (any float dtype, the same for both).
            out: (M, N) output, x's dtype.
            alpha: runtime scalar (a new value does not recompile).
            TILE_M, TILE_N: tile extents, compile-time constants (powers of two).
        """
        i = ct.bid(0)  # tile row: this block covers rows i*TILE_M ... i*TILE_M + TILE_M - 1
        j = ct.bid(1)  # tile column
        # index=(i, j) counts tiles, not elements. On the ragged edge part of the tile lies
        # outside the array; ZERO padding makes those lanes read 0 (harmless here).
        a = ct.load(x, index=(i, j), shape=(TILE_M, TILE_N), padding_mode=ZERO)  # [TM, TN]
        b = ct.load(y, index=(i, j), shape=(TILE_M, TILE_N), padding_mode=ZERO)  # [TM, TN]
        # Compute in fp32 whatever the storage dtype, round once on the way out.
        r = alpha * a.astype(ct.float32) + b.astype(ct.float32)  # [TM, TN]
        # Stores clip to the array bounds: lanes outside it are simply not written.
        ct.store(out, index=(i, j), tile=r.astype(out.dtype))

    return scale_add_kernel


def scale_add(x, y, alpha: float, tile=(64, 64), out=None):
    """Launch ``out = alpha * x + y``.

    Args:
        x, y: (M, N) tensors of one float dtype on one device.
        alpha: Python float.
        tile: (TILE_M, TILE_N), powers of two.
        out: optional (M, N) output tensor (x's dtype).
    Returns:
        out (M, N), x's dtype.
    """
    import torch

    if x.shape != y.shape or x.dim() != 2:
        raise ValueError(f"y: expected the shape of x, a 2-D {tuple(x.shape)}, got {tuple(y.shape)}")
    if out is None:
        out = torch.empty_like(x)
    m, n = x.shape
    tm, tn = tile
    kernel = build_scale_add_kernel(index_dtype_for(x, y, out))
    launch(kernel, (-(-m // tm), -(-n // tn)),
           dict(x=x, y=y, out=out, alpha=float(alpha), TILE_M=tm, TILE_N=tn), device=x.device)
    return out


# ----------------------------------------------------------------------------- row_stats

@ct.kernel
def row_stats_kernel(x: ct.Array, sums: ct.Array, maxes: ct.Array, cumsums: ct.Array,
                     BLOCK_M: ConstInt, N_PAD: ConstInt):
    """Per row of x: its sum, its maximum and its running sum.  Grid: (cdiv(M, BLOCK_M),).

    Args:
        x: (M, N) float array; N <= N_PAD.
        sums, maxes: (M,) fp32 outputs.
        cumsums: (M, N) fp32 output, cumsums[i, k] = x[i, 0] + ... + x[i, k].
        BLOCK_M: rows per block; N_PAD: the row length rounded up to a power of two.
    """
    i = ct.bid(0)
    # One tile holds BLOCK_M whole rows; columns N..N_PAD-1 lie outside x. The padding value
    # must be the identity of the operation it feeds: 0 for sums and scans ...
    r0 = ct.load(x, index=(i, 0), shape=(BLOCK_M, N_PAD), padding_mode=ZERO)  # [BM, NP]
    r0 = r0.astype(ct.float32)
    # ... -inf for a maximum (a 0 would win over a row of negative numbers).
    rinf = ct.load(x, index=(i, 0), shape=(BLOCK_M, N_PAD), padding_mode=NEG_INF)  # [BM, NP]
    ct.store(sums, index=(i,), tile=ct.sum(r0, axis=1))  # [BM], fp32 tree reduction
    ct.store(maxes, index=(i,), tile=ct.max(rinf.astype(ct.float32), axis=1))  # [BM]
    # Inclusive prefix sum along the row: the scan chunk_cumsum uses for the decay.
    ct.store(cumsums, index=(i, 0), tile=ct.cumsum(r0, axis=1))  # [BM, NP], clipped to N


def row_stats(x, block_m: int = 16, out=None):
    """Launch the row statistics.

    Args:
        x: (M, N) float tensor.
        block_m: rows per block (power of two).
        out: optional (sums (M,), maxes (M,), cumsums (M, N)) fp32 tensors.
    Returns:
        sums (M,), maxes (M,), cumsums (M, N), all fp32.
    """
    import torch

    m, n = x.shape
    if out is None:
        f32 = dict(dtype=torch.float32, device=x.device)
        out = (torch.empty(m, **f32), torch.empty(m, **f32), torch.empty(m, n, **f32))
    sums, maxes, cumsums = out
    launch(row_stats_kernel, (-(-m // block_m),),
           dict(x=x, sums=sums, maxes=maxes, cumsums=cumsums, BLOCK_M=block_m, N_PAD=next_pow2(n)),
           device=x.device)
    return sums, maxes, cumsums


# ----------------------------------------------------------------------------- matmul

@ct.kernel
def matmul_kernel(a: ct.Array, b: ct.Array, c: ct.Array, TM: ConstInt, TN: ConstInt, TK: ConstInt):
    """c = a @ b.  Grid: (cdiv(M, TM), cdiv(N, TN)); each block owns one [TM, TN] tile of c.

    Args:
        a: (M, K), b: (K, N), same float dtype; c: (M, N) output (any float dtype).
        TM, TN, TK: tile extents (powers of two); K is walked TK at a time.
    """
    i = ct.bid(0)
    j = ct.bid(1)
    acc = ct.zeros((TM, TN), dtype=ct.float32)  # [TM, TN]: fp32 accumulator, on chip
    for k in range(ct.num_tiles(a, axis=1, shape=(TM, TK))):  # cdiv(K, TK) steps
        # A ragged K tail must read zeros: padding that is not 0 would add garbage products.
        ak = ct.load(a, index=(i, k), shape=(TM, TK), padding_mode=ZERO)  # [TM, TK]
        bk = ct.load(b, index=(k, j), shape=(TK, TN), padding_mode=ZERO)  # [TK, TN]
        # Tensor-core multiply-accumulate: operands in their own dtype (bf16, fp16, or fp32
        # in full fp32), products summed into the fp32 accumulator.
        acc = ct.mma(ak, bk, acc)  # [TM, TN]
    ct.store(c, index=(i, j), tile=acc.astype(c.dtype))


def matmul(a, b, tiles=(64, 64, 32), out_dtype=None, out=None):
    """Launch ``c = a @ b``.

    Args:
        a: (M, K), b: (K, N) tensors of one float dtype.
        tiles: (TM, TN, TK), powers of two.
        out_dtype: dtype of c (default: a's dtype).
        out: optional (M, N) output tensor.
    Returns:
        c (M, N).
    """
    import torch

    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"b: expected {k} rows to match a's columns, got {k2}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or a.dtype, device=a.device)
    tm, tn, tk = tiles
    launch(matmul_kernel, (-(-m // tm), -(-n // tn)), dict(a=a, b=b, c=out, TM=tm, TN=tn, TK=tk),
           device=a.device)
    return out


# ----------------------------------------------------------------------------- AOT

@dataclass
class Exported:
    kernel: str
    variant: str
    arch: str
    output_format: str
    data: bytes
    seconds: float


def capture_primer(dtype: str = "bfloat16"):
    """Run every primer launcher on small CPU tensors under ``capture()``.

    Returns:
        dict variant name -> recorded :class:`ssd.launch.Launch`.
    """
    import torch

    t = getattr(torch, dtype)
    with capture() as rec:
        scale_add(torch.empty(100, 70, dtype=t), torch.empty(100, 70, dtype=t), 2.0)
        row_stats(torch.empty(100, 70, dtype=t))
        matmul(torch.empty(100, 70, dtype=t), torch.empty(70, 90, dtype=t), out_dtype=torch.float32)
    names = ("scale_add", "row_stats", "matmul")
    return {f"{name}/{dtype}": r for name, r in zip(names, rec, strict=True)}


def export(record, arch: str | None, output_format: str = "cubin") -> Exported:
    """Compile one captured launch ahead of time (``cuda.tile.compilation.export_kernel``).

    Args:
        record: an :class:`ssd.launch.Launch` from :func:`ssd.launch.capture`.
        arch: "sm_80", "sm_90", ... (None only for architecture-free "tileir_bytecode").
        output_format: "cubin" (machine code for ``arch``) or "tileir_bytecode".
    Returns:
        :class:`Exported` with the bytes and the wall-clock seconds the export took (on this
        machine's CPU: no GPU is involved).
    """
    from cuda.tile import compilation

    buf = io.BytesIO()
    start = time.perf_counter()
    compilation.export_kernel(record.kernel, [signature(record)], buf, gpu_code=arch,
                              output_format=output_format)
    seconds = time.perf_counter() - start
    return Exported(record.kernel._pyfunc.__name__, "", arch or "-", output_format,
                    buf.getvalue(), seconds)


def compile_primer(archs=ARCHS, dtypes=("bfloat16",)) -> list[Exported]:
    """Export a cubin of every primer kernel for every arch and dtype."""
    done = []
    for dtype in dtypes:
        for variant, record in capture_primer(dtype).items():
            for arch in archs:
                item = export(record, arch)
                item.variant = variant
                done.append(item)
    return done


__all__ = ["kernel_source", "constant_params", "scale_add", "row_stats", "matmul", "build_scale_add_kernel", "row_stats_kernel",
           "matmul_kernel", "capture_primer", "export", "compile_primer", "Exported", "ARCHS"]
