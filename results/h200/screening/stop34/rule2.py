"""Between rule.json's lengths (argv[1] = out): one sequence of 80 heads of 2.7b's layer at 64 and
128 chunks (4096 and 8192 tokens), below GROUPED_MIN_CHUNKS, so the default walks the narrow
slices; four and two groups of whole states beside it, in one process, chunk 64."""
import sys
from dataclasses import replace

from rule import run  # this folder's runner

from ssd import bench
from ssd.config import ONE_WAVE_STATE

SHAPES = [bench.Shape(f"1x{l}", 1, l, 80, 64, 128, 1) for l in (4096, 8192)]


def space(shape, sms):
    d = bench.shape_default(shape.dims, sms, chunk_size=64)
    assert d.state.groups == 1, (shape.name, d.state)
    return [("default", 64, d)] + [
        (f"g{g} whole", 64, replace(d, state=replace(d.state, **ONE_WAVE_STATE, groups=g)))
        for g in (4, 2)]


if __name__ == "__main__":
    run(SHAPES, space, sys.argv[1])
