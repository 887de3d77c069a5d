"""The fused-walk prototype (ssd.fused_walk, branch next/fused) compiles for every target
architecture, and at the screen's points for sm_90 (the H200 is what times it)."""
import pytest

pytest.importorskip("cuda.tile")
torch = pytest.importorskip("torch")

from ssd import _launch, aot  # noqa: E402
from ssd.fused_walk import fused_walk  # noqa: E402


def record(dims, q=64, **kw):
    b, l, h, p, n, g = dims
    bf = dict(dtype=torch.bfloat16)
    args = (torch.zeros(b, l, g, n, **bf), torch.zeros(b, l, g, n, **bf), torch.zeros(b, l, h, p, **bf),
            torch.zeros(b, h, l // q, q), torch.zeros(b, h, l // q, q))
    with _launch.capture() as recs:
        fused_walk(*args, D=torch.zeros(h), **kw)
    (r,) = recs
    return r


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_100"])
def test_compiles_for_every_arch(arch):
    assert aot.export_cubin(record((2, 256, 8, 64, 128, 1)), arch)


@pytest.mark.parametrize("block_p,occupancy", [(64, 2), (32, 3), (16, 4)])
def test_screen_points_compile_for_sm_90(block_p, occupancy):
    usage = aot.resource_usage(aot.export_cubin(
        record((4, 256, 80, 64, 128, 1), block_p=block_p, occupancy=occupancy), "sm_90"))
    assert usage["registers"] <= 65536 // (128 * occupancy)


def test_rejects_what_the_prototype_does_not_cover():
    with pytest.raises(ValueError, match="full chunks"):
        record((1, 100, 2, 64, 128, 1), q=64)
