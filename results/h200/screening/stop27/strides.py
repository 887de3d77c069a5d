"""Why ours took 6.8 % longer inside the codestral-7b mixer than in the suite (stop 27): the same
SSD call on the mixer's strided views, on contiguous copies of them, and on the suite's inputs,
in one process (graph replay, L2 flushed, bench.time_fn), twice; 2.7b as the control."""
import json, os, sys
import torch
from ssd import bench, endtoend
from ssd.mamba2 import Mamba2Mixer, capture_ssd_calls, config_for_shape

out = {}
for name in sys.argv[1:]:
    shape = next(s for s in bench.SUITES["models"] if s.name == name)
    cfg = config_for_shape(shape)
    mixer = Mamba2Mixer(cfg, "cutile", device="cuda", seed=0)
    u = endtoend._inputs(cfg, shape.b, shape.l, torch.device("cuda"), 1)
    with torch.no_grad():
        _, calls = capture_ssd_calls(mixer, u)
    args = calls[0]
    contig = tuple(a.contiguous() for a in args)
    suite = bench.make_inputs(shape)
    sx, sdt, sA, sB, sC, sD, sbias = bench._forward_args(suite)
    rows = {}
    for backend, q in (("cutile", 64), ("mamba_ssm", 256)):
        mixer.ssd.set_backend(backend, q)
        step = mixer.ssd
        cases = {"mixer views": lambda: step(*args), "contiguous copies": lambda: step(*contig),
                 "suite inputs": lambda: step(sx, sdt, sA, sB, sC, sD, sbias)}
        with torch.no_grad():
            for rep in range(2):
                for case, fn in cases.items():
                    t = bench.time_fn(fn, mode="graph", l2="flushed", reps=30)["median_ms"]
                    rows.setdefault(f"{backend} {case}", []).append(t)
    strides = {n: list(a.stride()) for n, a in zip(("x", "dt", "A", "B", "C", "D", "dt_bias"), args)}
    out[name] = dict(rows=rows, strides=strides)
    print(name, strides)
    for k, v in rows.items():
        print(f"  {k:32s} " + "  ".join(f"{t:.4f}" for t in v))
    del mixer, suite, calls, args, contig
    torch.cuda.empty_cache()
from ssd.env import environment
json.dump(dict(results=out, environment=environment()), open(os.path.join(os.environ["OUT"], "strides.json"), "w"), indent=1)
