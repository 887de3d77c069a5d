"""stop 39 screen: stage 1 computed inside the fused walk (StateConfig.inline_cumsum) against
stage 1 as its own kernel, in one process per variant with an empty cuTile cache; and main's
shipped code (e6f9595) in a process of its own. Each point: first call, the correctness gate,
the forward (graph replay, L2 flushed, median of 50), alternating inline/stage-1 twice.

Usage, from the repository root: python screen.py OUT.json"""
import json, os, subprocess, sys, tempfile

CODE = r'''
import dataclasses, json, sys, time, torch
from ssd import bench, api
variant = sys.argv[2]
out = []
for name, b, l, h, p, n, g, q in json.loads(sys.argv[1]):
    s = bench.Shape(name, b, l, h, p, n, g)
    inputs = bench.make_inputs(s)
    x, dt, A, B, C, D, bias = bench._forward_args(inputs)
    base = api.resolve_config(None, q, x, B)
    cfgs = {"main": base} if variant == "main" else {
        "inline": dataclasses.replace(base, state=dataclasses.replace(base.state, inline_cumsum=True)),
        "stage1": dataclasses.replace(base, state=dataclasses.replace(base.state, inline_cumsum=False))}
    fns = {k: (lambda cfg=cfg: api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                            dt_softplus=True, config=cfg))
           for k, cfg in cfgs.items()}
    firsts, errs = {}, {}
    for k, fn in fns.items():
        torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
        firsts[k] = time.perf_counter() - t
        api_wait = getattr(__import__("ssd"), "wait_tuned", None)
        if api_wait: api_wait()
        errs[k] = bench.gate(s, inputs, fn())
    times = {k: [] for k in fns}
    for rnd in range(2):
        for k, fn in fns.items():
            times[k].append(bench.time_fn(fn, mode="graph", l2="flushed", reps=30))
    for k in fns:
        r = dict(shape=name, chunk_size=q, point=k, first_s=firsts[k], gate_rel_err=errs[k],
                 medians_ms=[t["median_ms"] for t in times[k]],
                 q20_ms=[t["q20_ms"] for t in times[k]], q80_ms=[t["q80_ms"] for t in times[k]])
        print("ROW " + json.dumps(r), flush=True)
    del inputs; torch.cuda.empty_cache()
'''
SHAPES = [("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("130m", 8, 2048, 24, 64, 128, 1, 64),
          ("long-16k", 1, 16384, 80, 64, 128, 1, 64), ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64),
          ("small-state", 16, 1024, 32, 64, 64, 1, 128), ("small-state", 16, 1024, 32, 64, 64, 1, 64)]


NSHAPES = int(os.environ.get("NSHAPES", "5"))


def write(out_path, rows):
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment()))


def main(out_path):
    rows = []
    here = os.getcwd()
    for v, cwd in [("branch", here), ("main", os.path.join(here, ".scratch/s39/main_ssd"))][:int(os.environ.get("NVAR", "2"))]:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache}
            p = subprocess.Popen([sys.executable, "-c", CODE, json.dumps(SHAPES[:NSHAPES]), v],
                                 env=env, cwd=cwd, stdout=subprocess.PIPE, text=True)
            for line in p.stdout:
                if line.startswith("ROW "):
                    rows.append(dict(json.loads(line[4:]), variant=v))
                    r = rows[-1]
                    print(v, r["point"], r["shape"], r["chunk_size"], f"{r['first_s']:.1f}s",
                          f"{r['gate_rel_err']:.1e}", r["medians_ms"], flush=True)
                    write(out_path, rows)
            p.wait()
    write(out_path, rows)
    ref = {(r["shape"], r["chunk_size"]): min(r["medians_ms"]) for r in rows if r["point"] == "main"}
    for r in rows:
        m = min(r["medians_ms"])
        print(f"{r['point']:7s} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:6.2f} s  "
              f"gate {r['gate_rel_err']:.2e}  fwd {' '.join(f'{t:.4f}' for t in r['medians_ms'])} ms  "
              f"x main {m / ref.get((r['shape'], r['chunk_size']), float('nan')):.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
