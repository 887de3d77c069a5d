"""Screen: chunk_scan whole-chunk tiles that load every tile once (ScanConfig.shared), against
what ships, on the five models shapes (one process per shape: argv[1] = shape, argv[2] = out)."""
import json
import sys
from dataclasses import replace

import torch

from ssd import bench
from ssd.config import default_config

SHAPE, OUT = sys.argv[1], sys.argv[2]
FASTEST = {"small-state": 128}  # ours' fastest chunk size in models.json; 64 elsewhere


def space(shape, sms):
    b, l, h, p, n, g = shape.dims
    shipped = lambda q: default_config((9, 0), problem=(b, h, p, n), sms=sms, chunk_size=q)  # noqa: E731
    sc = lambda q, **kw: replace(shipped(q), scan=replace(shipped(q).scan, **kw))  # noqa: E731
    q0 = FASTEST.get(shape.name, 64)
    pts = [("default", q0, shipped(q0))]
    if shape.name == "small-state":
        pts += [("q128 sh h1", 128, sc(128, shared=True)),
                ("q128 sh h2 o2", 128, sc(128, shared=True, block_h=2, occupancy=2)),
                ("q64 default", 64, shipped(64)),
                ("q64 sh h1", 64, sc(64, shared=True)),
                ("q64 sh h2", 64, sc(64, shared=True, block_h=2)),
                ("q64 sh h4", 64, sc(64, shared=True, block_h=4)),
                ("q64 h2 non-wc", 64, sc(64, block_h=2, whole_chunk=False))]
    else:
        pts += [(f"q64 wc sh h{hb} o{o}", 64, sc(64, whole_chunk=True, shared=True, block_h=hb, occupancy=o))
                for hb in (2, 4) for o in (2, 3)]
    return pts


res = bench.run_study([s for s in bench.SUITES["models"] if s.name == SHAPE], space=space,
                      reps=20, stages=True)
res["environment"] = bench.environment()
json.dump(res, open(OUT, "w"), indent=1)
for shape, rows in bench.study_ratios(res["rows"]).items():
    for factor, label, r, st in rows:
        print(f"{shape:12s} {factor:18s} {r:6.3f}  " + " ".join(f"{k[:10]} {v:5.3f}" for k, v in st.items()))
