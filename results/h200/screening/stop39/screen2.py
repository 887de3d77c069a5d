"""stop 39 screen 2, one process per shape (SSD_QUICK_FIRST_CALL=0, empty cuTile cache), the
forward (graph replay, L2 flushed, median of 30, two alternating rounds):
  main     main's shipped code (e6f9595, imported as ssd_main) at its default;
  rows     this branch with stage 1 as its own kernel (inline_cumsum=False): the walk reads whole
           dt'/dA_cumsum rows a chunk and slices them per K block (main: a row per K block);
  rule     small-state only: main's code with next/small-state-rule's config (128: occupancy 2;
           256: 64-row tiles, neither whole-chunk nor shared).
Usage, from the repository root: python screen2.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import dataclasses, json, sys, time, torch
sys.path.insert(0, ".scratch/s39/mainpkg")
import ssd_main.api as mapi
from ssd import bench, api
name, b, l, h, p, n, g, q = json.loads(sys.argv[1])
s = bench.Shape(name, b, l, h, p, n, g)
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)
rep = dataclasses.replace
mcfg = mapi.resolve_config(None, q, x, B)
bcfg = api.resolve_config(None, q, x, B)
cfgs = {"main": (mapi, mcfg), "rows": (api, rep(bcfg, state=rep(bcfg.state, inline_cumsum=False)))}
if name == "small-state" and q == 128:
    cfgs["rule"] = (mapi, rep(mcfg, scan=rep(mcfg.scan, occupancy=2)))
if name == "small-state" and q == 256:
    cfgs["rule"] = (mapi, rep(mcfg, scan=rep(mcfg.scan, whole_chunk=False, shared=False)))
fns = {k: (lambda m=m, cfg=cfg: m.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                           dt_softplus=True, config=cfg))
       for k, (m, cfg) in cfgs.items()}
firsts, errs = {}, {}
for k, fn in fns.items():
    torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
    firsts[k] = time.perf_counter() - t
    errs[k] = bench.gate(s, inputs, y)
times = {k: [] for k in fns}
for rnd in range(2):
    for k, fn in fns.items():
        times[k].append(bench.time_fn(fn, mode="graph", l2="flushed", reps=30))
for k in fns:
    r = dict(shape=name, chunk_size=q, point=k, first_s=firsts[k], gate_rel_err=errs[k],
             config=dataclasses.asdict(cfgs[k][1]),
             medians_ms=[t["median_ms"] for t in times[k]],
             q20_ms=[t["q20_ms"] for t in times[k]], q80_ms=[t["q80_ms"] for t in times[k]])
    print("ROW " + json.dumps(r), flush=True)
'''
SHAPES = [("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("130m", 8, 2048, 24, 64, 128, 1, 64),
          ("long-16k", 1, 16384, 80, 64, 128, 1, 64), ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64),
          ("small-state", 16, 1024, 32, 64, 64, 1, 128)]


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), script="screen2.py"))


def main(out_path):
    rows = []
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache, "SSD_QUICK_FIRST_CALL": "0"}
            try:
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps(shape)], env=env,
                                   capture_output=True, text=True, timeout=100)
                out = p.stdout
            except subprocess.TimeoutExpired as e:
                print(shape[0], "TIMEOUT", flush=True)
                out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            for line in out.splitlines():
                if line.startswith("ROW "):
                    rows.append(json.loads(line[4:]))
            if not any(r["shape"] == shape[0] and r["chunk_size"] == shape[7] for r in rows):
                print(shape[0], "FAILED", (p.stderr or "")[-1500:] if 'p' in dir() else "", flush=True)
        write(out_path, rows)
    for r in rows:
        base = next(min(x["medians_ms"]) for x in rows if x["shape"] == r["shape"]
                    and x["chunk_size"] == r["chunk_size"] and x["point"] == "main")
        m = min(r["medians_ms"])
        print(f"{r['point']:5s} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:5.1f} s "
              f"gate {r['gate_rel_err']:.1e} fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms "
              f"x main {m / base:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
