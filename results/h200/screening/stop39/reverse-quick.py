"""Written in stop 39 for the next device session (branch next/reverse-scan): chunk_scan's
persistent tiles in the reverse of the walk's order (ScanConfig.reverse), so that its first tiles
read the entering states and x the walk touched last, which L2 may still hold. One process per
shape (empty cuTile cache, SSD_QUICK_FIRST_CALL=0): the shipped default against the same config
with reverse=True, the forward by graph replay with L2 flushed (median of 30, two alternating
rounds); stop 39's last call ran it without the stage times, 2.7b and small-state first. Usage: python reverse.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import dataclasses, json, sys, time, torch
from ssd import bench, api
name, b, l, h, p, n, g, q = json.loads(sys.argv[1])
s = bench.Shape(name, b, l, h, p, n, g)
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)
rep = dataclasses.replace
base = api.resolve_config(None, q, x, B)
cfgs = {"shipped": base, "reverse": rep(base, scan=rep(base.scan, reverse=True))}
fns = {k: (lambda cfg=cfg: api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                        dt_softplus=True, config=cfg))
       for k, cfg in cfgs.items()}
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
             config=dataclasses.asdict(cfgs[k]),
             medians_ms=[t["median_ms"] for t in times[k]],
             q20_ms=[t["q20_ms"] for t in times[k]], q80_ms=[t["q80_ms"] for t in times[k]])
    print("ROW " + json.dumps(r), flush=True)
'''
SHAPES = [("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("small-state", 16, 1024, 32, 64, 64, 1, 128),
          ("130m", 8, 2048, 24, 64, 128, 1, 64), ("long-16k", 1, 16384, 80, 64, 128, 1, 64),
          ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64)]


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), script="reverse-quick.py"))


def main(out_path):
    rows = []
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache, "SSD_QUICK_FIRST_CALL": "0"}
            try:
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps(shape)], env=env,
                                   capture_output=True, text=True, timeout=60)
                out, err = p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err = "TIMEOUT"
            got = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            if not got:
                print(shape[0], "FAILED", err[-1500:], flush=True)
            rows += got
        write(out_path, rows)
    for r in rows:
        base = next(min(x["medians_ms"]) for x in rows if x["shape"] == r["shape"]
                    and x["chunk_size"] == r["chunk_size"] and x["point"] == "shipped")
        m = min(r["medians_ms"])
        print(f"{r['point']:7s} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:5.1f} s "
              f"gate {r['gate_rel_err']:.1e} fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms "
              f"x shipped {m / base:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
