"""Screen of cheaper completions of the grouped walk's entering states in chunk_scan (branch
next/decay-row; argv[1] = out), for the next session: each shape against the narrow slices in one
process, as rule.json and rule2.json timed the grouped walk of f5f8598 (whose chunk_scan loaded the
carry as one element, a cp.async, and added the group's state in registers: 1.22-1.28x its time).
Points: four groups with the carry as a TMA row (the branch's GROUP_ADD), the same with the group's
part by an MMA of its own (ScanConfig.group_mma), and eight groups by MMA."""
import sys
from dataclasses import replace

from rule import run  # this folder's runner

from ssd import bench
from ssd.config import NARROW_STATE, StateConfig

SHAPES = [s for s in bench.SUITES["models"] if s.name == "long-16k"] + [
    bench.Shape(f"1x{l}", 1, l, 80, 64, 128, 1) for l in (8192, 65536)]


def space(shape, sms):
    d = bench.shape_default(shape.dims, sms, chunk_size=64)
    narrow = replace(d, state=replace(StateConfig(), **NARROW_STATE))
    # below GROUPED_MIN_CHUNKS the default is the narrow slices: the grouped points by hand
    grouped = d if d.state.groups > 1 else replace(d, state=bench.shape_default(
        next(s for s in bench.SUITES["models"] if s.name == "long-16k").dims, sms, chunk_size=64).state)
    mma = replace(grouped, scan=replace(grouped.scan, group_mma=True))
    pts = [("default", 64, d)]
    pts += [("narrow", 64, narrow)] if narrow != d else []
    pts += [("g4 add", 64, grouped)] if grouped != d else []
    return pts + [("g4 group mma", 64, mma),
                  ("g8 group mma", 64, replace(mma, state=replace(mma.state, groups=8)))]


if __name__ == "__main__":
    run(SHAPES, space, sys.argv[1])
