"""Forward + backward benchmark: ``python -m ssd.tools.backward_bench`` (library + command line).

For each shape of the models suite (``ssd.tools.bench.SUITES["models"]``: the Mamba-2 layer's SSD
call, bf16, D per head, dt_bias and softplus; ``bench.make_inputs``), ours
(``ssd.mamba_chunk_scan_combined``: the cuTile forward inside ``ssd.autograd``, the backward
of ``ssd.backward``: its cuTile stage kernels on a GPU), mamba_ssm's Triton SSD and TileGym's
cuTile forward and backward (``ssd.tools.peers.tilegym_training_adapter``: dt_bias and softplus
in PyTorch, timed with it), on the same inputs and the same upstream gradient dy ~ N(0, 1), at
each chunk size of ``bench.SUITE_CHUNKS`` (each implementation counted at its fastest), TileGym
at its chunk size 64 only, as the forward suite runs it. ``tilegym`` is TileGym untuned (each
kernel's first candidate, ``TILEGYM_DISABLE_AUTOTUNE=1``); ``tilegym_tuned`` (not a default:
minutes a shape) lets its autotuner search every kernel's candidates in the first call. Either
way the configurations it ran with are recorded, per shape (``tilegym_configs``). ``ssd_stages``
(not a default) is ours with chunk_state's backward in kernels of its own, not folded into
chunk_scan's.

1. **Gate.** One forward + backward of each (its first call: compilation or autotuning
   included, ``first_call_s``). The gradients of x, dt, A, D and dt_bias on the last
   ``GATE_HEADS`` heads, every batch row, against the float64 reference of those heads alone
   (``ProblemSpec.reference_backward``; a head's gradients depend only on its own inputs and its
   group's B and C), both criteria of ``ssd.validate.check_gradient`` for bf16. An implementation
   that fails is recorded, not timed. mamba_ssm's autotuning is reset before each shape
   (``ssd.tools.peers.retune_mamba_ssm``), and TileGym's (``retune_tilegym``).
2. **Memory.** The extra peak of one eager forward + backward over what was allocated before it
   (inputs, dy): ``torch.cuda.max_memory_allocated``, the returned gradients included.
3. **Timing** with ``bench.time_fn`` (CUDA events around each call, the median and the 20/80 %
   quantiles after a warm-up): the forward alone, no gradient required (what inference runs), and
   forward + backward (``torch.autograd.grad`` of y with dy), each as one CUDA-graph replay
   (host launch overhead removed; where capture fails, the failure is recorded) and eager
   (a training loop that is not captured pays the host path), with L2 flushed before each call
   (``--l2 warm`` keeps it).

It prints one line a shape and implementation at its fastest chunk size (forward + backward,
graph): forward and forward + backward times, the backward's share (their ratio), the extra peak
memory, and on each peer's line its time over ours; then, per peer, the geometric mean of that
speedup. The payload (records, failures, skipped peers, settings, mamba_ssm's and TileGym's
configurations and the
environment, ``ssd.tools.env``) goes to ``results/<gpu>/backward.json`` or ``--out``. With
``--merge`` a run of some shapes merges into that file when it was made at the same revision on
the same GPU with the same settings (``ssd.tools.bench.merge_runs``), so that several commands,
each within a time limit, record the whole suite.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from .bench import SUITE_CHUNKS, SUITES, Shape, make_inputs, merge_runs, time_fn
from .env import RESULTS, environment, gpu_slug, write_json

#: The inputs that get gradients (the layer's SSD call: no z, no initial states).
LEAVES = ("x", "dt", "A", "B", "C", "D", "dt_bias")
#: Heads whose gradients the gate checks, and which ones.
GATE_HEADS = 2
GATED = ("dx", "ddt", "dA", "dD", "ddt_bias")
WHATS = ("forward", "forward+backward")
#: Every implementation, and those run by default (TileGym tuned searches for minutes a shape).
#: ``ssd_stages``: ours with chunk_state's backward in its own kernels
#: (``ssd.backward.cutile_backwards(fold=False)``), beside the default to compare the two.
IMPLS = ("ssd", "ssd_stages", "mamba_ssm", "tilegym", "tilegym_tuned")
DEFAULT_IMPLS = ("ssd", "mamba_ssm", "tilegym")
#: The peers, in the order the table reports them.
PEERS = IMPLS[1:]


def leaves_of(inputs: dict) -> dict:
    """Fresh leaves that require grad, one per input of :data:`LEAVES`."""
    return {k: inputs[k].detach().clone().requires_grad_() for k in LEAVES}


def upstream(shape: Shape, dtype="bfloat16", seed=1, device="cuda"):
    """dy (b, l, h, p) ~ N(0, 1) in y's dtype."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, h, p, _, _ = shape.dims
    return torch.randn(b, l, h, p, device=device, generator=gen).to(getattr(torch, dtype))


def implementations(leaves: dict, names=DEFAULT_IMPLS, chunks=SUITE_CHUNKS):
    """({name: {chunk_size: zero-argument forward returning y}}, {name: why skipped}): ours and
    mamba_ssm's at each of ``chunks``, TileGym's at ``peers.TILEGYM_CHUNK`` only."""
    import functools

    from .. import api
    from ..backward import cutile_backwards
    from . import peers

    x, dt, A, B, C, D, bias = (leaves[k] for k in LEAVES)
    table, skipped = {}, {}
    fns = {}
    if "ssd" in names:
        fns["ssd"] = api.mamba_chunk_scan_combined
    if "ssd_stages" in names:
        fns["ssd_stages"] = functools.partial(api.mamba_chunk_scan_combined,
                                              backwards=cutile_backwards(fold=False))
    if "mamba_ssm" in names:
        try:
            fns["mamba_ssm"] = peers.mamba_ssm_forward()
        except peers.PeerUnavailable as exc:
            skipped["mamba_ssm"] = str(exc)
    for name in ("tilegym", "tilegym_tuned"):
        if name in names:
            try:
                fns[name] = peers.tilegym_training_adapter(tuned=name == "tilegym_tuned")
            except peers.PeerUnavailable as exc:
                skipped[name] = str(exc)
    for name, f in fns.items():
        sizes = (peers.TILEGYM_CHUNK,) if name.startswith("tilegym") else chunks
        table[name] = {q: (lambda f=f, q=q: f(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                              dt_softplus=True)) for q in sizes}
    return table, skipped


def training_step(forward, leaves: dict, dy):
    """forward + backward: a zero-argument callable returning every leaf's gradient."""
    import torch

    def run():
        return torch.autograd.grad(forward(), list(leaves.values()), dy)

    return run


def inference(forward):
    """The forward alone, no gradient required."""
    import torch

    def run():
        with torch.no_grad():
            return forward()

    return run


class GradGate:
    """The float64 reference gradients of the last :data:`GATE_HEADS` heads (every batch row),
    computed once per shape, then compared with each implementation's."""

    def __init__(self, shape: Shape, inputs: dict, dy, heads=GATE_HEADS):
        from ..problem import ProblemSpec
        from ..validate import as_float64

        b, l, h, p, n, g = shape.dims
        if heads > h // g:
            raise ValueError(f"heads: the gate checks heads of one group (at most {h // g})")
        self.heads = slice(h - heads, h)
        group = slice(g - 1, g)  # the last heads read the last group's B and C
        spec = ProblemSpec(b, l, heads, p, n, 1, chunk_size=256, D="h", dt_bias=True,
                           dt_softplus=True, name=shape.name)
        hs = self.heads
        host = dict(x=as_float64(inputs["x"][:, :, hs]), dt=as_float64(inputs["dt"][:, :, hs]),
                    A=as_float64(inputs["A"][hs]), B=as_float64(inputs["B"][:, :, group]),
                    C=as_float64(inputs["C"][:, :, group]), D=as_float64(inputs["D"][hs]),
                    dt_bias=as_float64(inputs["dt_bias"][hs]))
        self.ref = spec.reference_backward(host, {"dy": as_float64(dy[:, :, hs])})

    def __call__(self, grads: dict) -> dict:
        """``grads``: {"d" + leaf: gradient}. Returns {gate_rel_err, gate_elem_ratio, ok}: the
        worst over the gated gradients."""
        from ..validate import check_gradient

        hs = self.heads
        sliced = {"dx": grads["dx"][:, :, hs], "ddt": grads["ddt"][:, :, hs],
                  "dA": grads["dA"][hs], "dD": grads["dD"][hs], "ddt_bias": grads["ddt_bias"][hs]}
        checks = [check_gradient(k, sliced[k], self.ref[k], "bfloat16") for k in GATED]
        return dict(gate_rel_err=max(c.rel_err for c in checks),
                    gate_elem_ratio=max(c.elem_ratio for c in checks),
                    ok=all(c.ok for c in checks))


def extra_peak_mb(fn) -> float:
    """MB allocated at the peak of one eager call of ``fn`` above what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - before) / 2**20


def run(shapes, *, impls=DEFAULT_IMPLS, chunks=SUITE_CHUNKS, modes=("graph", "eager"),
        l2="flushed", reps=30, dtype="bfloat16", progress=None) -> dict:
    """Gate, measure memory, then time every implementation on every shape; return the payload
    (records, failures, skipped, mamba_ssm_configs, tilegym_configs, settings). ``progress``:
    called with a line for each time taken and each failure (a run cut short still shows what
    it measured)."""
    import torch

    from . import peers

    records, failures, skipped_all, tuned, tilegym = [], [], {}, {}, {}
    say = progress or (lambda line: None)
    for shape in shapes:
        inputs = make_inputs(shape, dtype)
        dy = upstream(shape, dtype)
        gate = GradGate(shape, inputs, dy)
        leaves = leaves_of(inputs)
        table, skipped = implementations(leaves, impls, chunks)
        skipped_all.update({f"{shape.name}/{k}": v for k, v in skipped.items()})
        if "mamba_ssm" in table:
            peers.retune_mamba_ssm()  # tune on this shape, not on the suite's first one
        if any(name.startswith("tilegym") for name in table):
            peers.retune_tilegym()  # record this shape's configurations only
        for impl, by_chunk in table.items():
            for q, forward in by_chunk.items():
                where = dict(shape=shape.name, dims=list(shape.dims), impl=impl, chunk_size=q,
                             dtype=dtype)
                fns = {"forward": inference(forward),
                       "forward+backward": training_step(forward, leaves, dy)}
                try:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    grads = fns["forward+backward"]()
                    torch.cuda.synchronize()
                    first_s = time.perf_counter() - start
                    checked = gate(dict(zip(("d" + k for k in LEAVES), grads)))
                    del grads
                    extra = extra_peak_mb(fns["forward+backward"])
                except peers.PeerUnavailable as exc:  # a feature the peer lacks: not timed
                    skipped_all[f"{shape.name}/{impl}"] = str(exc)
                    continue
                except Exception as exc:  # a peer that crashes is a result, not a harness error
                    failures.append(dict(where, error=f"{type(exc).__name__}: {exc}"[:400]))
                    say(f"{shape.name} {impl} q{q}: FAILED {failures[-1]['error']}")
                    continue
                if not checked.pop("ok"):
                    failures.append(dict(where, error="correctness gate", **checked))
                    say(f"{shape.name} {impl} q{q}: FAILED the correctness gate")
                    continue
                if impl == "tilegym_tuned":
                    checked["tuning"] = "searched"  # first_call_s holds the search
                for what in WHATS:
                    for mode in modes:
                        try:
                            stats = time_fn(fns[what], mode=mode, l2=l2, reps=reps)
                        except Exception as exc:  # e.g. a backward that cannot be captured
                            failures.append(dict(where, what=what, mode=mode,
                                                 error=f"{type(exc).__name__}: {exc}"[:400]))
                            continue
                        records.append(dict(where, what=what, mode=mode, l2=l2, **stats,
                                            **checked, first_call_s=first_s,
                                            extra_peak_mb=extra))
                        say(f"{shape.name} {impl} q{q} {what} {mode}: "
                            f"{stats['median_ms']:.3f} ms, {extra:.0f} MB extra")
        if "mamba_ssm" in table:
            tuned[shape.name] = peers.mamba_ssm_configs()
        ran = {name: peers.tilegym_configs(tuned=name == "tilegym_tuned")
               for name in table if name.startswith("tilegym")}
        if ran:
            tilegym[shape.name] = ran
        del inputs, leaves, dy, gate, table
        torch.cuda.empty_cache()
    settings = dict(reps=reps, warmup=5, l2=l2, modes=list(modes), chunks=list(chunks),
                    flush_bytes=512 * 2**20 if l2 == "flushed" else 0, timer="CUDA events",
                    statistic="median", dtype=dtype, leaves=list(LEAVES),
                    dy="N(0, 1) in y's dtype", mamba_ssm_autotune="per shape",
                    tilegym_chunk_size=peers.TILEGYM_CHUNK,
                    tilegym_dt="softplus(dt + dt_bias) in PyTorch, rounded to dt's dtype, timed",
                    gate=f"dx, ddt, dA, dD, ddt_bias of the last {GATE_HEADS} heads, bf16 "
                         "GRAD_TOL, against the float64 reference")
    return dict(records=records, failures=failures, skipped=skipped_all,
                mamba_ssm_configs=tuned, tilegym_configs=tilegym, settings=settings)


def best(records, mode="graph") -> dict:
    """{(shape, impl): {"forward": record, "forward+backward": record}} at the chunk size with
    the fastest forward + backward in ``mode`` (the forward record at that chunk size)."""
    out = {}
    for r in records:
        if r["what"] != "forward+backward" or r["mode"] != mode:
            continue
        key = (r["shape"], r["impl"])
        if key not in out or r["median_ms"] < out[key]["forward+backward"]["median_ms"]:
            out[key] = {"forward+backward": r}
    for r in records:
        key = (r["shape"], r["impl"])
        if (r["what"] == "forward" and r["mode"] == mode and key in out
                and r["chunk_size"] == out[key]["forward+backward"]["chunk_size"]):
            out[key]["forward"] = r
    return out


def speedups(records, over="mamba_ssm", mode="graph") -> dict:
    """{shape: ``over``'s best forward + backward time / ours'} where both were timed."""
    top = best(records, mode)
    return {shape: top[(shape, over)]["forward+backward"]["median_ms"]
            / top[(shape, "ssd")]["forward+backward"]["median_ms"]
            for shape, impl in top if impl == "ssd" and (shape, over) in top}


def table(payload) -> str:
    """The best records of each timed mode as a text table (see the module doc), then the
    failures and skipped peers."""
    lines = []
    for mode in payload["settings"]["modes"]:
        top = best(payload["records"], mode)
        sp = {peer: speedups(payload["records"], over=peer, mode=mode) for peer in PEERS}
        lines += [f"{mode}, L2 {payload['settings']['l2']}; each implementation at its fastest "
                  "forward + backward chunk size; x ours: a peer's fwd+bwd over ours",
                  f"{'shape':13s} {'impl':13s} {'q':>4s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} "
                  f"{'fwd+bwd/fwd':>11s} {'extra MB':>9s} {'x ours':>8s}"]
        for (shape, impl), recs in top.items():
            both, fwd = recs["forward+backward"], recs.get("forward")
            fwd_ms = fwd["median_ms"] if fwd else math.nan
            s = sp.get(impl, {}).get(shape)
            lines.append(f"{shape:13s} {impl:13s} {both['chunk_size']:4d} {fwd_ms:8.3f} "
                         f"{both['median_ms']:11.3f} {both['median_ms'] / fwd_ms:11.2f} "
                         f"{both['extra_peak_mb']:9.0f} "
                         + (f"{s:7.2f}x" if s is not None else f"{'':8s}"))
        for peer, by_shape in sp.items():
            if by_shape:
                geo = math.exp(float(np.mean(np.log(list(by_shape.values())))))
                lines.append(f"{peer} / ours, forward + backward: geometric mean {geo:.2f}x "
                             f"over {len(by_shape)} shapes, lowest {min(by_shape.values()):.2f}x")
    lines += [f"FAILED {f}" for f in payload["failures"]]
    lines += [f"skipped {name}: {why}" for name, why in payload["skipped"].items()]
    return "\n".join(lines)


def merged(path, payload: dict) -> dict:
    """``payload`` merged into the recording at ``path`` when that one was made at the same
    revision on the same GPU (``ssd.tools.bench.merge_runs``, which refuses other settings);
    ``payload`` alone where there is none or it is of another revision or GPU: one recording,
    one revision."""
    path = Path(path)
    if not path.is_file():
        return payload
    old = json.loads(path.read_text())
    env = payload["environment"]
    if any(old.get("environment", {}).get(k) != env.get(k) for k in ("git_revision", "gpu")):
        return payload
    return merge_runs(old, payload)


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.backward_bench",
                                     description=__doc__.splitlines()[0])
    names = [s.name for s in SUITES["models"]]
    parser.add_argument("--shapes", default=",".join(names),
                        help=f"models shapes, comma-separated (of {', '.join(names)})")
    parser.add_argument("--impl", action="append", choices=IMPLS,
                        help=f"implementation (repeatable; default {', '.join(DEFAULT_IMPLS)})")
    parser.add_argument("--chunks", type=_ints, default=SUITE_CHUNKS, metavar="Q,Q",
                        help="chunk sizes (default %(default)s)")
    parser.add_argument("--modes", default="graph,eager",
                        help="graph and/or eager, comma-separated (default %(default)s)")
    parser.add_argument("--l2", choices=("flushed", "warm"), default="flushed")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="output JSON (default results/<gpu>/backward.json)")
    parser.add_argument("--merge", action="store_true",
                        help="merge these shapes into the recording there (same revision, GPU "
                             "and settings) instead of replacing it")
    args = parser.parse_args(argv)
    wanted = args.shapes.split(",")
    if unknown := [s for s in wanted if s not in names]:
        parser.error(f"--shapes: {', '.join(unknown)} unknown (known: {', '.join(names)})")
    modes = tuple(args.modes.split(","))
    if bad := [m for m in modes if m not in ("graph", "eager")]:
        parser.error(f"--modes: {', '.join(bad)} unknown (known: graph, eager)")
    if bad := [q for q in args.chunks if q not in (16, 32, 64, 128, 256)]:
        parser.error(f"--chunks: {bad} not in 16, 32, 64, 128, 256")
    env = environment()
    shapes = [s for s in SUITES["models"] if s.name in wanted]
    payload = run(shapes, impls=tuple(args.impl or DEFAULT_IMPLS), chunks=args.chunks,
                  modes=modes, l2=args.l2, reps=args.reps,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    payload["environment"] = env
    path = Path(args.out or RESULTS / gpu_slug(env) / "backward.json")
    if args.merge:
        payload = merged(path, payload)
    print(table(payload))
    write_json(path, payload)
    print(f"[backward_bench] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
