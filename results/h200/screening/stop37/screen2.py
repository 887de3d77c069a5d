"""stop 37 screen 2: chunk_scan's occupancy hint. The branch of stop 36 (screen.json) took the
cross-tile pipelining away and with it up to 41 % of chunk_scan's speed; on a CPU the slow compiles
(long-16k and grouped full chunks at 64, small-state at 128, states 256 wide at 64) all compile in
1-2.3 s with the hint at 1 (one block a SM, the whole shared memory for the pipelining). Each
variant in a fresh process with an empty cuTile cache: first call (compilation included), the
correctness gate, the forward (graph replay, L2 flushed) and each stage alone.

Usage, from the repository root: python screen2.py OUT.json [VARIANT ...] (dflt, occ1)"""
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
    cfg = api.resolve_config(None, q, x, B)
    if variant == "occ1":
        cfg = dataclasses.replace(cfg, scan=dataclasses.replace(cfg.scan, occupancy=1))
    fn = lambda: api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias, dt_softplus=True, config=cfg)
    torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
    first = time.perf_counter() - t
    err = bench.gate(s, inputs, y)
    stats = bench.time_fn(fn, mode="graph", l2="flushed", reps=50)
    out.append(dict(shape=name, chunk_size=q, scan=dataclasses.asdict(cfg.scan), groups=cfg.state.groups,
                    first_s=first, gate_rel_err=err, median_ms=stats["median_ms"],
                    stages=bench.stage_times(inputs, chunk_size=q, config=cfg)))
    del inputs; torch.cuda.empty_cache()
print("RESULT " + json.dumps(out))
'''
SHAPES = [("long-16k", 1, 16384, 80, 64, 128, 1, 64), ("1x12288-full", 1, 12288, 64, 64, 128, 1, 64),
          ("small-state", 16, 1024, 32, 64, 64, 1, 128), ("n256", 8, 2048, 32, 64, 256, 1, 64),
          ("2.7b", 4, 4096, 80, 64, 128, 1, 64), ("130m", 8, 2048, 24, 64, 128, 1, 64),
          ("codestral-7b", 2, 8192, 128, 64, 128, 8, 64), ("small-state", 16, 1024, 32, 64, 64, 1, 64)]


def main(out_path, variants):
    rows = []
    for v in variants:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache}
            p = subprocess.run([sys.executable, "-c", CODE, json.dumps(SHAPES), v], env=env,
                               capture_output=True, text=True, timeout=400)
        line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        if not line:
            print(v, "FAILED", p.stderr[-1500:], flush=True)
            continue
        for r in json.loads(line[0][7:]):
            rows.append(dict(r, variant=v))
            print(f"{v:5s} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:6.2f} s  "
                  f"gate {r['gate_rel_err']:.2e}  fwd {r['median_ms']:.4f} ms  "
                  + "  ".join(f"{k} {v:.4f}" for k, v in r["stages"].items()), flush=True)
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), variants=variants))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["dflt", "occ1"])
