"""Every cuTile kernel compiles ahead of time for sm_80, sm_90 and sm_100, on the CPU.

Runs the real stage launchers on CPU tensors under ``ssd._launch.capture()`` and exports each
recorded launch with ``cuda.tile.compilation.export_kernel`` (needs ``cuda-tile[tileiras]``,
no GPU and no driver). A kernel that no longer compiles for one target fails here, in CI.
"""
import pytest

pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd import aot  # noqa: E402

KERNELS = {"chunk_cumsum_kernel", "chunk_state_kernel", "state_passing_kernel",
           "chunk_scan_kernel"}


@pytest.mark.parametrize("dtype", aot.DTYPES)
def test_every_kernel_compiles_for_every_arch(dtype):
    done = aot.compile_all(aot.ARCHS, (dtype,), progress=lambda line: None)
    built = {(c.kernel, c.arch) for c in done}
    assert built == {(k, a) for k in KERNELS for a in aot.ARCHS}
    assert all(c.cubin_bytes > 1000 for c in done)


def test_capture_records_instead_of_launching():
    records = aot.capture_forward("bfloat16", features=True, fused=False)
    names = [r.kernel._pyfunc.__name__ for r in records]
    assert names == ["chunk_cumsum_kernel", "chunk_state_kernel", "state_passing_kernel",
                     "chunk_scan_kernel"]
