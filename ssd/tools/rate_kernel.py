"""The fp32 fused multiply-add chain that :func:`ssd.tools.bench.measure_ceilings` times: the
GPU's measured rate for elementwise arithmetic on its CUDA cores, the rate a scan would run at
(chapter 3, "why not a scan").

Kept in its own module: cuTile reads a kernel's source file, and the ceilings import it only
when they are measured on a GPU.
"""

import cuda.tile as ct

from ..kernels.tiles import ConstInt

#: Elements per block; each thread of the block owns several, independent chains, so the FMA
#: pipes never wait on the previous result of one chain.
TILE = 1024
#: FMAs per element: 2 * STEPS FLOPs against the 8 bytes each element moves, so the chain is
#: bound by arithmetic, not memory, by three orders of magnitude.
STEPS = 4096


@ct.kernel
def fma_chain(x: ct.Array, out: ct.Array, STEPS: ConstInt, TILE: ConstInt):
    """out = STEPS steps of t <- t * 0.999 + 0.001 from t = x, one TILE-long tile a block.

    tileiras contracts each step into one FFMA (checked in the sm_90 machine code), so the
    kernel does 2 * STEPS FLOPs an element with nothing else in its loop.

    Args:
        x: (n,) float32, n a multiple of TILE.
        out: (n,) float32.
    """
    i = ct.bid(0)
    t = ct.load(x, index=(i,), shape=(TILE,))  # [TILE]
    for _ in range(STEPS):
        t = t * 0.999 + 0.001
    ct.store(out, index=(i,), tile=t)


def launch_fma_chain(x, out, steps: int = STEPS) -> int:
    """Launch :func:`fma_chain` over ``x`` (n,) float32 into ``out``; returns its FLOPs."""
    from ..launch import launch

    if x.numel() % TILE:
        raise ValueError(f"x: expected a multiple of {TILE} elements, got {x.numel()}")
    launch(fma_chain, (x.numel() // TILE,), dict(x=x, out=out, STEPS=steps, TILE=TILE),
           device=x.device)
    return 2 * steps * x.numel()
