"""Decode-step benchmark: ``python -m ssd.tools.decode_bench`` (library + command line).

For each head shape (2.7b, codestral-7b), batch (1, 8, 64, 256) and state dtype, ours
(:func:`ssd.selective_state_update`) and mamba_ssm's Triton ``selective_state_update`` on the
same inputs, as mamba_ssm's Mamba-2 layer calls it (:func:`layer_inputs`):

1. **Gate.** One call of each on a copy of the state; y and the new state of 16 batch entries
   against the float64 reference step with both criteria of the GPU tests
   (:func:`ssd.validate.check_step`). An implementation that fails is recorded, not timed.
2. **Timing.** One call captured in a CUDA graph and replayed ``reps`` times after a warm-up, each
   replay between two CUDA events; the median and the 20/80 % quantiles
   (:func:`ssd.tools.bench.time_fn`). Every replay updates the state in place (its values stay
   bounded: the decays are below 1). By default a 512 MiB buffer is zeroed before each replay,
   outside the timed region: in a model every other layer runs between two steps of one layer,
   so the state comes from HBM, not from L2 (``--l2 warm`` keeps it there).
3. **Bandwidth.** The step reads each state once and writes it once: its state traffic is
   2·b·h·p·n·(state bytes), and traffic / median time is the bandwidth it reaches on it, shown
   beside the device-to-device copy bandwidth measured in the same run
   (:func:`ssd.tools.bench.measure_ceilings`). The other inputs (x, dt, B, C; a few hundred bytes
   an entry and head) are not counted.

``--block-p 4,8,16`` also times ours at those channel slices
(:class:`ssd.config.StateUpdateConfig`), for choosing the default. Results go to
``results/<gpu>/decode.json`` (or ``--out``): records, ceilings, settings, failures, skipped
peers and the environment (``ssd.tools.env``).
"""
from __future__ import annotations

import argparse
import math
import sys
import zlib

import numpy as np

from .env import RESULTS, environment, gpu_slug, write_json

#: (nheads, headdim, dstate, ngroups) of the model shapes the decode step is timed on.
HEADS = {"2.7b": (80, 64, 128, 1), "codestral-7b": (128, 64, 128, 8)}
BATCHES = (1, 8, 64, 256)
STATE_DTYPES = ("float32", "bfloat16")
GATE_ENTRIES = 16


def layer_inputs(heads, batch: int, dtype="bfloat16", state_dtype="float32", seed=0,
                 device="cuda") -> dict:
    """One decode step's keyword arguments as mamba_ssm's Mamba-2 layer passes them: A, dt,
    dt_bias and D per head, expanded over the head dim (and the state for A) as strided views;
    B, C (b, g, n); no z (the layer gates in its norm); softplus. x, B, C ~ N(0, 1) and the state
    ~ N(0, 1); dt' = softplus(dt + dt_bias) in Mamba-2's initialisation range [1e-3, 1e-1];
    A = -exp(U(0, log 16)) (as ``ssd.tools.bench.make_inputs``)."""
    import torch

    h, p, n, g = heads
    b, t = batch, getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, device=device, generator=gen)  # noqa: E731
    target = torch.exp(torch.empty(h, device=device).uniform_(math.log(1e-3), math.log(1e-1),
                                                              generator=gen))
    A = -torch.exp(torch.empty(h, device=device).uniform_(0, math.log(16), generator=gen))
    return dict(state=randn(b, h, p, n).to(getattr(torch, state_dtype)), x=randn(b, h, p).to(t),
                dt=(0.5 * randn(b, h)).to(t)[..., None].expand(b, h, p),
                A=A[:, None, None].expand(h, p, n), B=randn(b, g, n).to(t), C=randn(b, g, n).to(t),
                D=randn(h)[:, None].expand(h, p),
                dt_bias=torch.log(torch.expm1(target))[:, None].expand(h, p))


def implementations(names=("ssd", "mamba_ssm"), block_ps=()) -> tuple[dict, dict]:
    """({label: f(state, **inputs) -> y}, {name: why skipped}): ours at the default and at each
    of ``block_ps`` ("ssd[block_p=8]"), mamba_ssm's where it imports."""
    from .. import decode
    from ..config import StateUpdateConfig
    from . import peers

    out, skipped = {}, {}
    if "ssd" in names:
        out["ssd"] = lambda state, **kw: decode.selective_state_update(state, dt_softplus=True,
                                                                       **kw)
        for bp in block_ps:
            cfg = StateUpdateConfig(block_p=bp)
            out[f"ssd[block_p={bp}]"] = lambda state, cfg=cfg, **kw: decode.selective_state_update(
                state, dt_softplus=True, config=cfg, **kw)
    if "mamba_ssm" in names:
        try:
            theirs = peers.mamba_ssm_state_update()
            out["mamba_ssm"] = lambda state, **kw: theirs(state, dt_softplus=True, **kw)
        except peers.PeerUnavailable as exc:
            skipped["mamba_ssm"] = str(exc)
    return out, skipped


def gate(fn, inputs: dict, dtype: str, state_dtype: str) -> dict:
    """One call of ``fn`` on a copy of the state, checked on GATE_ENTRIES batch entries (the first,
    the last and evenly spread ones) against the float64 reference: {y_rel_err, state_rel_err,
    y_elem_ratio, state_elem_ratio, ok}."""
    import torch

    from .. import reference as R
    from ..validate import check_step, host_inputs, step_bounds

    state = inputs["state"].clone()
    rest = {k: v for k, v in inputs.items() if k != "state"}
    y = fn(state, **rest)
    torch.cuda.synchronize()
    b = inputs["x"].shape[0]
    pick = np.unique(np.linspace(0, b - 1, min(b, GATE_ENTRIES)).round().astype(int))
    idx = torch.as_tensor(pick, device=state.device)
    host = host_inputs({k: (v[idx] if k in ("state", "x", "dt", "B", "C") else v)
                        for k, v in inputs.items()})
    y_ref, state_ref = R.selective_state_update(**host, dt_softplus=True)
    bounds = step_bounds(host, True, None, dtype, state_dtype)
    checks = {"y": check_step("y", y[idx], y_ref, bounds.y, dtype),
              "state": check_step("state", state[idx], state_ref, bounds.state, state_dtype)}
    out = {f"{k}_rel_err": c.rel_err for k, c in checks.items()}
    out.update({f"{k}_elem_ratio": c.ratio for k, c in checks.items()})
    return dict(out, ok=all(c.ok for c in checks.values()))


def state_traffic(dims, state_bytes: int) -> int:
    """Bytes of state one step moves: each (b, h, p, n) element read once and written once."""
    b, h, p, n, _ = dims
    return 2 * b * h * p * n * state_bytes


def run(shapes=tuple(HEADS), batches=BATCHES, state_dtypes=STATE_DTYPES,
        impls=("ssd", "mamba_ssm"), block_ps=(), dtype="bfloat16", reps=50, l2="flushed",
        ceilings=None) -> dict:
    """Gate, then time every implementation on every (shape, batch, state dtype); return the
    payload (records, failures, skipped, ceilings, settings)."""
    import torch

    from .bench import measure_ceilings, time_fn

    ceilings = ceilings or measure_ceilings()
    table, skipped = implementations(impls, block_ps)
    records, failures = [], []
    for shape in shapes:
        for batch in batches:
            for state_dtype in state_dtypes:
                dims = (batch, *HEADS[shape])
                inputs = layer_inputs(HEADS[shape], batch, dtype, state_dtype,
                                      seed=zlib.crc32(f"{shape}/{batch}".encode()))
                traffic = state_traffic(dims, inputs["state"].element_size())
                for impl, fn in table.items():
                    where = dict(shape=shape, dims=list(dims), impl=impl, dtype=dtype,
                                 state_dtype=state_dtype)
                    try:
                        checked = gate(fn, inputs, dtype, state_dtype)
                    except Exception as exc:  # a peer that crashes is a result
                        failures.append(dict(where, error=f"{type(exc).__name__}: {exc}"[:400]))
                        continue
                    if not checked.pop("ok"):
                        failures.append(dict(where, error="correctness gate", **checked))
                        continue
                    state = inputs["state"]
                    rest = {k: v for k, v in inputs.items() if k != "state"}
                    stats = time_fn(lambda: fn(state, **rest), mode="graph", l2=l2, reps=reps)
                    per_s = traffic / (stats["median_ms"] * 1e-3)
                    records.append(dict(where, mode="graph", l2=l2, **stats,
                                        state_bytes=traffic, state_bytes_per_s=per_s,
                                        copy_fraction=per_s / ceilings["copy_bytes_per_s"],
                                        **checked))
                del inputs
                torch.cuda.empty_cache()
    settings = dict(reps=reps, warmup=5, mode="graph", l2=l2, timer="CUDA events",
                    statistic="median", inputs="mamba_ssm's Mamba-2 layer call", dtype=dtype,
                    flush_bytes=512 * 2**20 if l2 == "flushed" else 0)
    return dict(records=records, failures=failures, skipped=skipped, ceilings=ceilings,
                settings=settings)


def speedups(records, over="mamba_ssm") -> dict:
    """{(shape, batch, state dtype): ``over``'s median / ours'} where both were timed."""
    key = lambda r: (r["shape"], r["dims"][0], r["state_dtype"])  # noqa: E731
    theirs = {key(r): r["median_ms"] for r in records if r["impl"] == over}
    return {key(r): theirs[key(r)] / r["median_ms"] for r in records
            if r["impl"] == "ssd" and key(r) in theirs}


def table(payload) -> str:
    """The records as a text table: one line a (shape, batch, state dtype, implementation):
    time, state bandwidth, its fraction of the copy bandwidth, and ours' speedup."""
    sp = speedups(payload["records"])
    copy = payload["ceilings"]["copy_bytes_per_s"]
    lines = [f"copy bandwidth {copy / 1e9:.0f} GB/s (device to device, measured now)",
             f"{'shape':13s} {'batch':>5s} {'state':8s} {'impl':18s} {'us':>9s} {'GB/s':>7s} "
             f"{'of copy':>7s} {'speedup':>8s}"]
    for r in payload["records"]:
        s = sp.get((r["shape"], r["dims"][0], r["state_dtype"])) if r["impl"] == "ssd" else None
        lines.append(f"{r['shape']:13s} {r['dims'][0]:5d} {r['state_dtype']:8s} {r['impl']:18s} "
                     f"{r['median_ms'] * 1e3:9.2f} {r['state_bytes_per_s'] / 1e9:7.0f} "
                     f"{r['copy_fraction']:7.1%} "
                     + (f"{s:7.2f}x" if s is not None else f"{'':8s}"))
    for f in payload["failures"]:
        lines.append(f"FAILED {f}")
    for name, why in payload["skipped"].items():
        lines.append(f"skipped {name}: {why}")
    return "\n".join(lines)


def _ints(text: str) -> tuple:
    return tuple(int(v) for v in text.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.decode_bench",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(HEADS),
                        help=f"head shapes, comma-separated (of {', '.join(HEADS)})")
    parser.add_argument("--batches", type=_ints, default=BATCHES, metavar="B,B",
                        help="batch sizes (default %(default)s)")
    parser.add_argument("--state-dtype", action="append", choices=STATE_DTYPES,
                        help="state dtype (repeatable; default both)")
    parser.add_argument("--impl", action="append", choices=("ssd", "mamba_ssm"),
                        help="implementation (repeatable; default both)")
    parser.add_argument("--block-p", type=_ints, default=(), metavar="P,P",
                        help="also time ours at these channel slices (powers of two)")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--l2", choices=("flushed", "warm"), default="flushed")
    parser.add_argument("--out", help="output JSON (default results/<gpu>/decode.json)")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    if unknown := [s for s in shapes if s not in HEADS]:
        parser.error(f"--shapes: {', '.join(unknown)} unknown (known: {', '.join(HEADS)})")
    if bad := [bp for bp in args.block_p if bp < 1 or bp & (bp - 1)]:
        parser.error(f"--block-p: {bad} not powers of two")
    env = environment()
    payload = run(shapes, args.batches, tuple(args.state_dtype or STATE_DTYPES),
                  tuple(args.impl or ("ssd", "mamba_ssm")), args.block_p, reps=args.reps,
                  l2=args.l2)
    payload["environment"] = env
    print(table(payload))
    path = write_json(args.out or RESULTS / gpu_slug(env) / "decode.json", payload)
    print(f"[decode_bench] wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
