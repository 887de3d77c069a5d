"""Written in stop 40 for the next device session (branch next/fused): stages 2 and 3 in one
kernel (ssd/fused_walk.py, a prototype: full chunks, no seq_idx, initial states or z). The walk's
block computes its chunk's output rows from the entering state it holds, so the entering states
are never stored and read back. Compiled for sm_90 on a CPU only (about 1 s a build).

One process per shape (empty cuTile cache). Points: main's shipped forward (the same checkout's
ssd.api at chunk 64 and at 128; the faster is the reference for the ratio) and the fused forward (stage 1,
then fused_walk) at several (chunk size, block_p, occupancy hint). Each fused point writes y
into a NaN-poisoned buffer and must pass bench.gate (float64 reference) and match the final
states of the shipped forward before it is timed: graph replay, L2 flushed, median of 30, two
alternating rounds. Usage: python fused.py OUT.json [SHAPE ...] (all five shapes if none is named)"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import json, sys, time, torch
from ssd import bench, api, chunk_cumsum
from ssd.fused_walk import fused_walk
name, b, l, h, p, n, g, q, points = json.loads(sys.argv[1])
s = bench.Shape(name, b, l, h, p, n, g)
inputs = bench.make_inputs(s)
x, dt, A, B, C, D, bias = bench._forward_args(inputs)

def shipped(sq=q):
    return api.mamba_chunk_scan_combined(x, dt, A, B, C, sq, D=D, dt_bias=bias, dt_softplus=True,
                                         return_final_states=True)

def fused(fq, bp, occ, out=None):
    def f():
        dt_out, dA = chunk_cumsum.chunk_cumsum(dt, A, fq, dt_bias=bias, dt_softplus=True)
        return fused_walk(B, C, x, dt_out, dA, D=D, block_p=bp, occupancy=occ, out=out)
    return f

fns = {"main": shipped, "main q128": lambda: shipped(128)}
y_ref, fin_ref = shipped()
torch.cuda.synchronize()
for fq, bp, occ in points:
    k = f"fused q{fq} p{bp} o{occ}"
    poisoned = torch.full_like(x, float("nan"))
    try:
        t = time.perf_counter(); y, fin = fused(fq, bp, occ, poisoned)(); torch.cuda.synchronize()
        first = time.perf_counter() - t
    except Exception as e:  # a point that fails to build or launch is reported, not fatal
        print("ROW " + json.dumps(dict(shape=name, point=k, error=repr(e)[-500:])), flush=True)
        continue
    err = bench.gate(s, inputs, y)
    fin_err = float((fin - fin_ref).abs().max() / fin_ref.abs().max())
    nan = int(torch.isnan(y).sum())
    print(f"{k}: first {first:.1f} s gate {err:.2e} final {fin_err:.2e} nan {nan}", flush=True)
    if nan or not err <= 1.5e-2 or not fin_err <= 1e-2:
        print("ROW " + json.dumps(dict(shape=name, point=k, gate_rel_err=err, final_rel_err=fin_err,
                                       nan=nan, first_s=first, failed=True)), flush=True)
        continue
    fns[k] = fused(fq, bp, occ)
times = {k: [] for k in fns}
for rnd in range(2):
    for k, fn in fns.items():
        times[k].append(bench.time_fn(fn, mode="graph", l2="flushed", reps=30))
for k in fns:
    print("ROW " + json.dumps(dict(shape=name, chunk_size=q, point=k,
                                   medians_ms=[t["median_ms"] for t in times[k]],
                                   q20_ms=[t["q20_ms"] for t in times[k]],
                                   q80_ms=[t["q80_ms"] for t in times[k]])), flush=True)
'''
# (chunk size, block_p, occupancy hint): one wave needs b * h * p / block_p blocks resident at
# once; chunk 128 spills on a CPU compile for sm_90 (368 B at block_p 64), so 64 and 32
POINTS = [(64, 64, 2), (64, 64, None), (64, 32, 3), (64, 32, 2), (64, 16, 4), (32, 64, 2),
          (32, 32, 3)]
SHAPES = [("2.7b", 4, 4096, 80, 64, 128, 1), ("130m", 8, 2048, 24, 64, 128, 1),
          ("codestral-7b", 2, 8192, 128, 64, 128, 8), ("small-state", 16, 1024, 32, 64, 64, 1),
          ("long-16k", 1, 16384, 80, 64, 128, 1)]


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), script="fused.py"))


def main(out_path, names):
    rows = []
    for shape in [s for s in SHAPES if not names or s[0] in names]:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache}
            try:
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps([*shape, 64, POINTS])],
                                   env=env, capture_output=True, text=True, timeout=180)
                out, err = p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                err = "TIMEOUT"
            print("\n".join(line for line in out.splitlines() if not line.startswith("ROW ")), flush=True)
            got = [json.loads(line[4:]) for line in out.splitlines() if line.startswith("ROW ")]
            if not got:
                print(shape[0], "FAILED", err[-1500:], flush=True)
            rows += got
        write(out_path, rows)
        timed = [r for r in got if "medians_ms" in r]
        base = min((min(r["medians_ms"]) for r in timed if r["point"].startswith("main")), default=None)
        for r in timed:
            print(f"{r['point']:20s} {r['shape']:12s} fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms "
                  f"x main best {min(r['medians_ms']) / base:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
