"""A tiny cuTile kernel that `python -m ssd doctor` compiles to check the toolchain.

Kept in its own module: cuTile reads a kernel's source file, and importing cuda.tile is
left to the moment the doctor compiles.
"""

import cuda.tile as ct

TILE = 16


@ct.kernel
def scale_exp2(x, out):
    """out = exp2(x * log2(e)) = exp(x), one TILE-long tile per program.

    Args:
        x: (n,) float32, n a multiple of TILE.
        out: (n,) float32.
    """
    i = ct.bid(0)
    t = ct.load(x, index=(i,), shape=(TILE,))  # [TILE]
    ct.store(out, index=(i,), tile=ct.exp2(t * 1.4426950408889634))
