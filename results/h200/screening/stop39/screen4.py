"""stop 39 screen 4: stage 1 with several chunks a block (CumsumConfig.block_c), one process per
shape (empty cuTile cache): the forward at the shipped default with block_c 1 (shipped), 4, 16,
and 4 with 16 heads a block; graph replay, L2 flushed, median of 30, two alternating rounds; and
stage 1 alone (bench.stage_times: eager, L2 flushed).
Usage, from the repository root: python screen4.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import dataclasses, json, sys, time, torch
from ssd import bench, api, wait_tuned
name, b, l, h, p, n, g, q = json.loads(sys.argv[1])
s = bench.Shape(name, b, l, h, p, n, g)
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)
rep = dataclasses.replace
base = api.resolve_config(None, q, x, B)
cfgs = {f"c{bc}h{bh}": rep(base, cumsum=rep(base.cumsum, block_c=bc, block_h=bh))
        for bc, bh in ((1, 8), (4, 8), (16, 8), (4, 16))}
fns = {k: (lambda cfg=cfg: api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                        dt_softplus=True, config=cfg))
       for k, cfg in cfgs.items()}
errs = {}
for k, fn in fns.items():
    y = fn()
    errs[k] = bench.gate(s, inputs, y)
times = {k: [] for k in fns}
for rnd in range(2):
    for k, fn in fns.items():
        times[k].append(bench.time_fn(fn, mode="graph", l2="flushed", reps=30))
for k in fns:
    st = bench.stage_times(inputs, chunk_size=q, config=cfgs[k])
    r = dict(shape=name, chunk_size=q, point=k, gate_rel_err=errs[k],
             medians_ms=[t["median_ms"] for t in times[k]], stage1_ms=st["chunk_cumsum"],
             q20_ms=[t["q20_ms"] for t in times[k]], q80_ms=[t["q80_ms"] for t in times[k]])
    print("ROW " + json.dumps(r), flush=True)
'''
SHAPES = [("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("130m", 8, 2048, 24, 64, 128, 1, 64),
          ("long-16k", 1, 16384, 80, 64, 128, 1, 64), ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64),
          ("small-state", 16, 1024, 32, 64, 64, 1, 128)]


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), script="screen4.py"))


def main(out_path):
    rows = []
    for shape in SHAPES:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache}
            out, err = "", ""
            try:
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps(shape)], env=env,
                                   capture_output=True, text=True, timeout=80)
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
        base = next(min(x["medians_ms"]) for x in rows if x["shape"] == r["shape"] and x["point"] == "c1h8")
        m = min(r["medians_ms"])
        print(f"{r['point']:6s} {r['shape']:12s} q{r['chunk_size']:<3d} gate {r['gate_rel_err']:.1e} "
              f"fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms x shipped {m / base:.3f} "
              f"stage1 {r['stage1_ms'] * 1e3:.1f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
