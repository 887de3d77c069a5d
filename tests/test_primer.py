"""The primer's kernels (``ssd.kernels.primer``, notebook 04): compiled ahead of time on the CPU for every
target, and (``-m gpu``) checked against torch on a GPU.

The CPU part captures the launchers under ``ssd.launch.capture()`` and exports each record with
``cuda.tile.compilation.export_kernel``, as ``tests/test_aot.py`` does for the SSD stages.
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

import cuda.tile as ct  # noqa: E402

from ssd import launch  # noqa: E402
from ssd.kernels import primer  # noqa: E402
from ssd.tools import aot  # noqa: E402

KERNELS = {"scale_add_kernel", "row_stats_kernel", "matmul_kernel"}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_primer_kernel_compiles_for_every_arch(dtype):
    done = primer.compile_primer(primer.ARCHS, (dtype,))
    assert {(e.kernel, e.arch) for e in done} == {(k, a) for k in KERNELS for a in primer.ARCHS}
    assert all(e.data[:4] == b"\x7fELF" and len(e.data) > 1000 for e in done), "not a cubin"


def test_capture_records_one_launch_per_launcher():
    records = primer.capture_primer("float16")
    assert list(records) == ["scale_add/float16", "row_stats/float16", "matmul/float16"]
    grid = {name: r.grid for name, r in records.items()}
    # 100 x 70 with 64 x 64 tiles: 2 x 2 tiles, the last row and column ragged
    assert grid["scale_add/float16"] == (2, 2)
    assert grid["row_stats/float16"] == (7,)          # cdiv(100, 16) row blocks
    assert grid["matmul/float16"] == (2, 2)           # c is 100 x 90


def test_constants_specialise_the_kernel():
    """A new tile size is a new compile-time constant set: another symbol, another cubin."""
    from cuda.tile import compilation

    x = torch.empty(10, 10)
    with launch.capture() as rec:
        primer.scale_add(x, x, 1.0, out=torch.empty_like(x), tile=(32, 64))
        primer.scale_add(x, x, 3.0, out=torch.empty_like(x), tile=(32, 64))
        primer.scale_add(x, x, 1.0, out=torch.empty_like(x), tile=(64, 64))
    names = [compilation.mangle_kernel_name("scale_add_kernel", launch.signature(r)) for r in rec]
    assert names[0] == names[1] != names[2]  # alpha is a runtime scalar, the tile a constant


def test_a_launch_names_every_argument_and_only_those():
    """Launchers pass arguments by name; the launch orders them as the kernel's parameters and
    refuses a missing or an unknown name instead of shifting the rest into wrong places."""
    x = torch.empty(8, 8)
    with launch.capture() as rec:
        primer.scale_add(x, x, 2.0, out=torch.empty_like(x), tile=(8, 16))
    kernel = rec[0].kernel
    named = dict(x=1, y=2, out=3, alpha=4.0, TILE_M=5, TILE_N=6)
    assert launch.kernel_args(kernel, dict(reversed(named.items()))) == (1, 2, 3, 4.0, 5, 6)
    assert rec[0].args[3:] == (2.0, 8, 16)
    for bad, message in ((dict(named, beta=1), r"unknown \['beta'\]"),
                         ({k: v for k, v in named.items() if k != "y"}, r"missing \['y'\]")):
        with pytest.raises(ValueError, match=message):
            launch.kernel_args(kernel, bad)


def test_a_launch_reads_a_tensor_that_requires_grad_only_with_grad_mode_off():
    """A kernel has no backward: with grad mode on, a launch given a tensor that requires grad
    raises rather than drop the gradient; under no_grad it reads a detached view."""
    x = torch.empty(8, 8)
    with launch.capture() as rec:
        primer.scale_add(x, x, 2.0, out=torch.empty_like(x), tile=(8, 16))
    kernel = rec[0].kernel
    w = torch.zeros(8, 8, requires_grad=True)
    named = dict(x=w, y=x, out=x, alpha=1.0, TILE_M=8, TILE_N=16)
    with pytest.raises(ValueError, match="x requires grad"):
        launch.kernel_args(kernel, named)
    with torch.no_grad():
        args = launch.kernel_args(kernel, named)
    assert not args[0].requires_grad and args[0].data_ptr() == w.data_ptr()


def test_int64_indexing_only_past_2_31_elements():
    """A view of 2**31 + 2**16 elements (stride 0: no memory) switches the index type, and so
    does a view whose elements lie 2**31 apart."""
    small = torch.empty(4, 4, dtype=torch.bfloat16)
    big = torch.empty(1, 1, dtype=torch.bfloat16).expand(2**16, 2**15 + 1)
    assert big.numel() > launch.INT32_MAX
    assert launch.index_dtype_for(small) == ct.int32
    assert launch.index_dtype_for(small, big) == ct.int64
    # A column slice of a wider tensor: few elements, offsets past 2**31 (no memory: meta).
    columns = torch.empty(2**16, 2**15 + 8, device="meta")[:, :8]
    assert columns.numel() < launch.INT32_MAX and launch.index_dtype_for(columns) == ct.int64
    with launch.capture() as rec:
        primer.scale_add(small, small, 1.0)
        primer.scale_add(big, big, 1.0, out=big)
    assert rec[0].kernel is primer.build_scale_add_kernel(ct.int32)
    assert rec[1].kernel is primer.build_scale_add_kernel(ct.int64)
    assert len(primer.export(rec[1], "sm_90").data) > 1000
    text = aot.tileir_text(rec[1])
    if text is None:
        pytest.skip("tileirdisasm not found next to tileiras")
    assert "tile<i64>" in text and "tile<i64>" not in aot.tileir_text(rec[0])


# ----------------------------------------------------------------------------- GPU

def _rel(out, ref):
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 64), (100, 70), (1, 1000), (257, 3)])
def test_scale_add_on_gpu(shape, dtype):
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    y = torch.randn(*shape, device="cuda", dtype=dtype)
    out = torch.full_like(x, float("nan"))
    primer.scale_add(x, y, -1.5, out=out)
    ref = (-1.5 * x.double() + y.double()).to(dtype)  # one rounding of the exact result
    torch.cuda.synchronize()
    assert torch.isfinite(out).all(), "an element was not written"
    assert (out.double() - ref.double()).abs().max() <= 2 * ref.double().abs().max() * {
        torch.float32: 2**-24, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16, 64), (100, 70), (33, 1)])
def test_row_stats_on_gpu(shape):
    x = torch.randn(*shape, device="cuda") - 3.0  # mostly negative: a 0 pad would win the max
    nan = dict(fill_value=float("nan"), device="cuda")
    out = (torch.full((shape[0],), **nan), torch.full((shape[0],), **nan), torch.full(shape, **nan))
    sums, maxes, cumsums = primer.row_stats(x, out=out)
    torch.cuda.synchronize()
    xd = x.double()
    tol = shape[1] * 2**-24  # worst case of fp32 accumulation over a row
    assert _rel(sums, xd.sum(1)) <= tol
    assert torch.equal(maxes, x.max(1).values)
    assert _rel(cumsums, xd.cumsum(1)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mkn", [(128, 128, 128), (100, 90, 70), (64, 32, 1000)])
def test_matmul_on_gpu(mkn, dtype):
    """fp32 output against the float64 product of the same (rounded) inputs: with fp32
    accumulation only the accumulation error remains, whatever the input dtype; its worst
    case over K terms is K * 2^-24 (typically ~sqrt(K) times smaller)."""
    m, n, k = mkn
    tol = k * 2**-24
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(k, n, device="cuda", dtype=dtype)
    c = torch.full((m, n), float("nan"), device="cuda")
    primer.matmul(a, b, out=c)
    torch.cuda.synchronize()
    err = _rel(c, a.double() @ b.double())
    assert math.isfinite(err) and err < tol, f"rel err {err:.2e}"
    assert np.isfinite(c.cpu().numpy()).all()
