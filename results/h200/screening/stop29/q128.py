"""Screen (stop 29 plan): chunk 128 with whole-chunk chunk_scan tiles loaded once, on the
state-128 models shapes, against what ships at ours' fastest chunk size (one process per
shape: argv[1] = shape, argv[2] = out). Run from next/land-shared (shared=True exists there as
the chunk-64 default; at 128 the shipped chunk_scan is 64-row tiles of two heads, o3)."""
import json
import sys
from dataclasses import replace

from ssd import bench
from ssd.config import default_config

SHAPE, OUT = sys.argv[1], sys.argv[2]


def space(shape, sms):
    b, l, h, p, n, g = shape.dims
    shipped = lambda q: default_config((9, 0), problem=(b, h, p, n), sms=sms, chunk_size=q)  # noqa: E731
    sc = lambda q, **kw: replace(shipped(q), scan=replace(shipped(q).scan, **kw))  # noqa: E731
    return [("default", 64, shipped(64)), ("q128 shipped", 128, shipped(128)),
            ("q128 wc sh h2 o2", 128, sc(128, whole_chunk=True, shared=True, block_h=2, occupancy=2)),
            ("q128 wc sh h1 o2", 128, sc(128, whole_chunk=True, shared=True, block_h=1, occupancy=2)),
            ("q128 wc sh h2 o2 w8", 128, sc(128, whole_chunk=True, shared=True, block_h=2, occupancy=2, warps=8))]


res = bench.run_study([s for s in bench.SUITES["models"] if s.name == SHAPE], space=space,
                      reps=20, stages=True)
res["environment"] = bench.environment()
json.dump(res, open(OUT, "w"), indent=1)
for shape, rows in bench.study_ratios(res["rows"]).items():
    for factor, label, r, st in rows:
        print(f"{shape:12s} {factor:20s} {r:6.3f}  " + " ".join(f"{k[:10]} {v:5.3f}" for k, v in st.items()))
