"""stop 36 screen: the grouped whole-chunk chunk_scan with a branch around the tile (the fix tree,
.scratch/s36/fix) against this tree's, in alternating fresh processes with empty cuTile caches:
first call (compilation included), the correctness gate, the forward (graph replay, L2 flushed)
and each stage alone. Usage: python screen.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import json, time, torch
from ssd import bench, api
out = []
for s in [bench.Shape("long-16k", 1, 16384, 80, 64, 128, 1), bench.Shape("1x12288-full", 1, 12288, 64, 64, 128, 1)]:
    inputs = bench.make_inputs(s)
    x, dt, A, B, C, D, bias = bench._forward_args(inputs)
    fn = lambda: api.mamba_chunk_scan_combined(x, dt, A, B, C, 64, D=D, dt_bias=bias, dt_softplus=True)
    torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
    first = time.perf_counter() - t
    err = bench.gate(s, inputs, y)
    stats = bench.time_fn(fn, mode="graph", l2="flushed", reps=30)
    out.append(dict(shape=s.name, first_s=first, gate_rel_err=err, median_ms=stats["median_ms"],
                    stages=bench.stage_times(inputs, chunk_size=64)))
    del inputs; torch.cuda.empty_cache()
print("RESULT " + json.dumps(out))
'''
here = os.path.dirname(os.path.abspath(__file__))
trees = {"main": os.getcwd(), "branch": os.path.join(here, "fix")}
rows = []
for rnd in range(2):
    for name, root in trees.items():
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
            p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, cwd=root, timeout=200)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(name, "FAILED", p.stderr[-1500:]); continue
        for r in json.loads(line[0][7:]):
            rows.append(dict(r, tree=name, round=rnd))
            print(f"{name:7s} r{rnd} {r['shape']:13s} first {r['first_s']:6.2f} s  gate {r['gate_rel_err']:.2e}  fwd {r['median_ms']:.4f} ms  "
                  + "  ".join(f"{k} {v:.4f}" for k, v in r["stages"].items()), flush=True)
from ssd.env import environment, write_json
write_json(sys.argv[1], dict(rows=rows, environment=environment(),
                             tree_note="branch = main + results/h200/screening/stop36/compile-branch.diff"))
