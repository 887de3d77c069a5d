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
    records = aot.capture_forward("bfloat16", features="all", fused=False)
    names = [r.kernel._pyfunc.__name__ for r in records]
    assert names == ["chunk_cumsum_kernel", "chunk_state_kernel", "state_passing_kernel",
                     "chunk_scan_kernel"]


def test_resource_line_is_parsed():
    text = ("Resource usage:\n Common:\n  GLOBAL:0\n Function chunk_scan_kernel:\n"
            "  REG:255 STACK:24 SHARED:102920 LOCAL:0 CONSTANT[0]:944 TEXTURE:0 SURFACE:0\n")
    assert aot.parse_resource_usage(text) == dict(registers=255, stack_bytes=24,
                                                  shared_bytes=102920, local_bytes=0)
    with pytest.raises(ValueError, match="one function"):
        aot.parse_resource_usage("no resources here")


def test_recorded_resources_are_what_this_compiler_makes():
    """results/compile/sm_90_resources.json (read by the layout chapter) against a fresh
    compile of its first and most-spilling points. Different tileiras: re-record it with
    ``python -m ssd.aot --resources``."""
    import json

    from ssd import bench, doctor

    recorded = json.loads(aot.RESOURCES.read_text())
    if recorded["environment"]["tileiras"] != doctor.locate_toolchain().tileiras.version:
        pytest.skip("recorded with another tileiras; re-record with python -m ssd.aot --resources")
    space = bench.config_space()
    worst = max(recorded["rows"], key=lambda r: r["stack_bytes"])
    points = [space[0], next(p for p in space if bench.config_label(p[1], p[2]) == worst["label"])]
    fresh = aot.resource_table(points, progress=lambda line: None)
    want = [r for r in recorded["rows"] if r["label"] in {bench.config_label(q, c) for _, q, c in points}]
    assert fresh == want


def test_capture_names_the_feature_sets_it_knows():
    with pytest.raises(ValueError, match="features: expected one of"):
        aot.capture_forward("bfloat16", features=True, fused=True)
