"""Stop 31's screens share this runner: each script builds its points (``space``: a function of
the shape and the GPU's SM count returning (factor, chunk size, SSDConfig) triples, the first
named "default") and :func:`run` times them on the named models shapes in one process
(``ssd.bench.run_study``: graph replay, L2 flushed, each kernel alone too), writes the file, and
prints each point's time as a multiple of its shape's default."""
import json
from dataclasses import replace

from ssd import bench


def shipped(shape, sms, chunk_size, **scan):
    """What the API ships for ``shape`` at ``chunk_size`` (``bench.shape_default``), with the
    ScanConfig fields ``scan`` changed."""
    d = bench.shape_default(shape.dims, sms, chunk_size=chunk_size)
    return replace(d, scan=replace(d.scan, **scan))


def run(names, space, out, reps=20):
    res = bench.run_study([s for s in bench.SUITES["models"] if s.name in names], space=space,
                          reps=reps, stages=True)
    res["environment"] = bench.environment()
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    for shape, rows in bench.study_ratios(res["rows"]).items():
        for factor, label, r, st in rows:
            print(f"{shape:12s} {factor:20s} {r:6.3f}  "
                  + " ".join(f"{k[:10]} {v:5.3f}" for k, v in st.items()))
    return res
