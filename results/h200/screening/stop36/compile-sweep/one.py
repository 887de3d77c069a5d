import os, sys, time, json
os.environ["CUDA_TILE_CACHE_DIR"] = "off"
sys.path.insert(0, ".")  # run from the repository root
from ssd import aot
from ssd.config import default_config
b, l, h, p, n, g = map(int, sys.argv[1:7]); q = int(sys.argv[7]) if len(sys.argv) > 7 else 64
tag = sys.argv[8] if len(sys.argv) > 8 else ""
cfg = default_config((9, 0), problem=(b, h, p, n), sms=132, chunk_size=q, seqlen=l)
t0 = time.perf_counter()
feat = os.environ.get("FEATURES", "layer")
recs = aot.capture_forward("bfloat16", feat, cfg.state.fused, chunk_size=q, config=cfg, dims=(b, l, h, p, n, g))
cap = time.perf_counter() - t0
out = {}
for r in recs:
    t = time.perf_counter(); cub = aot.export_cubin(r, "sm_90")
    name = r.kernel._pyfunc.__name__
    while name in out: name += "+"
    out[name] = dict(s=round(time.perf_counter() - t, 3), **aot.resource_usage(cub))
sc = cfg.scan
print(json.dumps(dict(dims=[b, l, h, p, n, g], q=q, tag=tag, features=feat, groups=cfg.state.groups, state=str(cfg.state), scan=str(cfg.scan),
    whole_chunk=sc.whole_chunk, shared=sc.shared, ragged=bool(l % q), capture_s=round(cap, 3),
    total_s=round(sum(v["s"] for v in out.values()), 3),
    scan_s=out.get("chunk_scan_kernel", {}).get("s"),
    max_stack=max(v.get("stack_bytes", 0) for v in out.values()),
    loadavg=os.getloadavg()[0], kernels=out)))
