"""Screen of the grouped walk's rule (argv[1] = out): the shapes of every suite that the rule
GROUPED_WALK sends to four groups of whole states, at chunk 64, in one process, each against
the walk they took before it (NARROW_STATE's slices, groups 1) and with two and eight groups.
long-16k was screened in stop 33 (groups.json); the others had not been timed grouped."""
import json
import sys
from dataclasses import replace

from ssd import bench
from ssd.config import NARROW_STATE, StateConfig

NAMES = ("long-16k", "prompt-512", "2.7b-l65536", "unseen-2x1536-full")
SHAPES = [s for s in {s.name: s for suite in (*bench.SUITES.values(), bench.FIRST_CALL_SHAPES)
                      for s in suite}.values() if s.name in NAMES]


def space(shape, sms):
    d = bench.shape_default(shape.dims, sms, chunk_size=64)
    assert d.state.groups == 4, (shape.name, d.state)
    before = replace(d, state=replace(StateConfig(), **NARROW_STATE))
    return [("default", 64, d), ("narrow (before)", 64, before)] + [
        (f"g{g} whole", 64, replace(d, state=replace(d.state, groups=g))) for g in (2, 8)]


def run(shapes, space, out):
    """Time ``space``'s points on ``shapes`` in this process (graph replay, L2 flushed, each stage
    alone too), write the file, print each point against its shape's default."""
    res = bench.run_study(shapes, space=space, reps=20, stages=True)
    res["environment"] = bench.environment()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for shape, rows in bench.study_ratios(res["rows"]).items():
        for factor, label, r, st in rows:
            print(f"{shape:18s} {factor:16s} {r:6.3f}  "
                  + " ".join(f"{k[:10]} {v:5.3f}" for k, v in st.items()))


if __name__ == "__main__":
    run(SHAPES, space, sys.argv[1])
