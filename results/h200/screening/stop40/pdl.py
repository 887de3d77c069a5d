"""Written in stop 40 (branch next/pdl): programmatic dependent launch. The walk and chunk_scan
are launched with cuTile's programmatic_dependent_launch; every stage triggers its dependents at
its start and waits (ct.grid_dependency_control_wait) before touching memory, so the next
kernel's launch and block dispatch overlap the tail of the one before it.

One process per shape (empty cuTile cache, SSD_QUICK_FIRST_CALL=0). Points, all at ours' fastest
chunk size in the models run of 1565a44:
  main     main's shipped code (bc44211, imported as ssd_main) at its default
  off      this branch, PDL off (the grid-dependency ops compiled in, launched without PDL)
  pdl      this branch, PDL on
  pdl-h2   PDL on, two heads a chunk_scan tile (block_h=2; chunk 64, ungrouped walks)
  pdl-ss   PDL on, the small-state rule's hint of 2 at chunk 128 (small-state only)
The forward by graph replay, L2 flushed, median of 30, three alternating rounds; then eager once.
Usage: python pdl.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import dataclasses, json, sys, time, torch
sys.path.insert(0, ".scratch/s40/mainpkg")
import ssd_main.api as mapi
from ssd import bench, api, _launch
name, b, l, h, p, n, g, q = json.loads(sys.argv[1])
s = bench.Shape(name, b, l, h, p, n, g)
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)
rep = dataclasses.replace
base = api.resolve_config(None, q, x, B)
pts = {"main": (mapi, None, False), "off": (api, base, False), "pdl": (api, base, True)}
if q == 64 and base.state.groups == 1:
    pts["pdl-h2"] = (api, rep(base, scan=rep(base.scan, block_h=2)), True)
if name == "small-state" and q == 128:
    pts["pdl-ss"] = (api, rep(base, scan=rep(base.scan, occupancy=2)), True)

def make(mod, cfg, on):
    def f():
        _launch.PDL = on
        return mod.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                             dt_softplus=True, config=cfg)
    return f
fns = {k: make(*v) for k, v in pts.items()}
firsts, errs = {}, {}
for k, fn in fns.items():
    torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
    firsts[k] = time.perf_counter() - t
    errs[k] = bench.gate(s, inputs, y)
    print(f"first {k} {firsts[k]:.1f} s gate {errs[k]:.2e}", flush=True)
times = {k: [] for k in fns}
for rnd in range(3):
    for k, fn in fns.items():
        times[k].append(bench.time_fn(fn, mode="graph", l2="flushed", reps=30))
eager = {k: bench.time_fn(fn, mode="eager", l2="flushed", reps=30) for k, fn in fns.items()}
for k in fns:
    r = dict(shape=name, chunk_size=q, point=k, first_s=firsts[k], gate_rel_err=errs[k],
             config=None if pts[k][1] is None else dataclasses.asdict(pts[k][1]), pdl=pts[k][2],
             medians_ms=[t["median_ms"] for t in times[k]],
             q20_ms=[t["q20_ms"] for t in times[k]], q80_ms=[t["q80_ms"] for t in times[k]],
             eager_median_ms=eager[k]["median_ms"])
    print("ROW " + json.dumps(r), flush=True)
'''
SHAPES = [("130m", 8, 2048, 24, 64, 128, 1, 64), ("small-state", 16, 1024, 32, 64, 64, 1, 128),
          ("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64),
          ("long-16k", 1, 16384, 80, 64, 128, 1, 64)]


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), script="pdl.py"))


def main(out_path):
    rows = []
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache, "SSD_QUICK_FIRST_CALL": "0"}
            try:
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps(shape)], env=env,
                                   capture_output=True, text=True, timeout=90)
                out, err = p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err = "TIMEOUT"
            got = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            if not got:
                print(shape[0], "FAILED", out[-800:], err[-1500:], flush=True)
            rows += got
        write(out_path, rows)
        for r in got:
            base = next(min(x["medians_ms"]) for x in got if x["point"] == "main")
            m = min(r["medians_ms"])
            print(f"{r['point']:7s} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:5.1f} s "
                  f"gate {r['gate_rel_err']:.1e} fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms "
                  f"x main {m / base:.3f} eager {r['eager_median_ms']:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
