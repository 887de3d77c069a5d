"""stop 38: does the quick first call's per-launch key cost host time? 130m at chunk 64, one process:
eager forward (L2 flushed, median of 200) with chunk_scan's quick path on (key per launch) and off
(QUICK_OCCUPANCY patched to the config's hint: no QuickFirst, no key), alternating, plus the host
time of 500 back-to-back calls without synchronising."""
import json, sys, time, torch
from ssd import bench, api, chunk_scan, _tiered
s = next(x for x in bench.SUITES["models"] if x.name == "130m")
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)
fn = lambda: api.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, dt_bias=bias, dt_softplus=True)
first = bench.first_call(fn)
print("first call", round(first[0], 2), "tuned", first[1] and round(first[1], 2), flush=True)
rows = []
for rep in range(2):
    for mode in ("key", "nokey"):
        chunk_scan.QUICK_OCCUPANCY = 1 if mode == "key" else 2
        e = bench.time_fn(fn, mode="eager", l2="flushed", reps=200)["median_ms"]
        g = bench.time_fn(fn, mode="graph", l2="flushed", reps=100)["median_ms"]
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(500): fn()
        host = (time.perf_counter() - t) / 500 * 1e3
        torch.cuda.synchronize()
        rows.append(dict(mode=mode, rep=rep, eager_ms=e, graph_ms=g, host_ms_per_call=host))
        print(rows[-1], flush=True)
from ssd.env import environment, write_json
write_json(sys.argv[1], dict(rows=rows, first=first[:2], environment=environment()))
