# CPU: sm_90 compile time of each kernel of the shipped default on two grouped shapes
import os, sys, time
os.environ["CUDA_TILE_CACHE_DIR"] = "off"
from ssd import aot
from ssd.config import default_config
for name, dims in [("long-16k", (1, 16384, 80, 64, 128, 1)), ("unseen-1x17000-grouped", (1, 17000, 72, 64, 128, 1))]:
    b, l, h, p, n, g = dims
    cfg = default_config((9, 0), problem=(b, h, p, n), sms=132, chunk_size=64, seqlen=l)
    print(name, cfg.scan, cfg.state, flush=True)
    recs = aot.capture_forward("bfloat16", "layer", cfg.state.fused, chunk_size=64, config=cfg, dims=dims)
    for r in recs:
        t = time.perf_counter(); cub = aot.export_cubin(r, "sm_90")
        print(f"  {r.kernel._pyfunc.__name__:28s} {time.perf_counter()-t:6.1f} s", flush=True)
