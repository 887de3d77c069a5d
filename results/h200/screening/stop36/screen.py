"""stop 36 screen, prepared for the next device session: variants of chunk_scan's persistent loop
(a branch around the whole-chunk tile, see README.md) against this tree's, each in a fresh process
with an empty cuTile cache: first call (compilation included), the correctness gate, the forward
(graph replay, L2 flushed) and each stage alone, on the shapes whose chunk_scan compiled slowly
(long-16k, a grouped full-chunk sequence, small-state at 128 and 256, a state 256 wide at 64) and
on 2.7b at 64, which no variant changes (the run's noise). Every process is a fresh interpreter, so the trees alternate.

Usage, from the repository root: python screen.py OUT.json NAME=TREE ... [--rounds N]
(TREE: a folder holding a patched copy of ssd/; this tree runs as "main")."""
import json, os, subprocess, sys, tempfile

CODE = r'''
import json, sys, time, torch
from ssd import bench, api
out = []
for name, b, l, h, p, n, g, q in json.loads(sys.argv[1]):
    s = bench.Shape(name, b, l, h, p, n, g)
    inputs = bench.make_inputs(s)
    x, dt, A, B, C, D, bias = bench._forward_args(inputs)
    fn = lambda: api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias, dt_softplus=True)
    torch.cuda.synchronize(); t = time.perf_counter(); y = fn(); torch.cuda.synchronize()
    first = time.perf_counter() - t
    err = bench.gate(s, inputs, y)
    stats = bench.time_fn(fn, mode="graph", l2="flushed", reps=30)
    out.append(dict(shape=name, chunk_size=q, first_s=first, gate_rel_err=err, median_ms=stats["median_ms"],
                    stages=bench.stage_times(inputs, chunk_size=q)))
    del inputs; torch.cuda.empty_cache()
print("RESULT " + json.dumps(out))
'''
SHAPES = [("long-16k", 1, 16384, 80, 64, 128, 1, 64), ("1x12288-full", 1, 12288, 64, 64, 128, 1, 64),
          ("small-state", 16, 1024, 32, 64, 64, 1, 128), ("small-state", 16, 1024, 32, 64, 64, 1, 256),
          ("n256", 8, 2048, 32, 64, 256, 1, 64), ("2.7b", 4, 4096, 80, 64, 128, 1, 64)]


def main(out_path, variants, rounds):
    trees = {"main": os.getcwd(), **dict(v.split("=", 1) for v in variants)}
    rows = []
    for rnd in range(rounds):
        for name, root in trees.items():
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache,
                       "PYTHONPATH": os.path.abspath(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
                p = subprocess.run([sys.executable, "-c", CODE, json.dumps(SHAPES)], env=env,
                                   capture_output=True, text=True, timeout=400, cwd=root)  # cwd first on sys.path
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if not line:
                print(name, "FAILED", p.stderr[-1500:], flush=True)
                continue
            for r in json.loads(line[0][7:]):
                rows.append(dict(r, tree=name, round=rnd))
                print(f"{name:6s} r{rnd} {r['shape']:12s} q{r['chunk_size']:<3d} first {r['first_s']:6.2f} s  "
                      f"gate {r['gate_rel_err']:.2e}  fwd {r['median_ms']:.4f} ms  "
                      + "  ".join(f"{k} {v:.4f}" for k, v in r["stages"].items()), flush=True)
    from ssd.env import environment, write_json
    write_json(out_path, dict(rows=rows, environment=environment(), trees=list(trees),
                              tree_note="main = this checkout; the others = main + screening/stop36 diffs"))


if __name__ == "__main__":
    args = sys.argv[1:]
    rounds = int(args[args.index("--rounds") + 1]) if "--rounds" in args else 1
    names = [a for a in args if "=" in a]
    main(args[0], names, rounds)
