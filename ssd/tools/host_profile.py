"""Where an eager forward's host time goes: ``python -m ssd.tools.host_profile``.

Called eagerly, ``ssd.mamba_chunk_scan_combined`` costs its GPU time plus the host's: Python
checks the arguments, resolves the configuration, allocates the outputs, builds each launch's
arguments, and cuTile's launcher reads them and queues the kernel. On one 512-token prompt with
the 2.7b layer's heads (the default problem: three kernels, tens of µs of GPU time) the host's
part decides the call's time. Each phase below is timed alone with ``time.perf_counter``, the
median of ``--reps`` repetitions after a warm-up, in µs.

A signature's first call (every call, before the API kept plans; :mod:`ssd.api`):

* ``checks``: :func:`ssd.api.validate`; ``config``: :func:`ssd.api.resolve_config`;
* ``stages``: :func:`ssd.api.run_stages` with launches recorded (``ssd.launch.capture``):
  the launchers' allocations, argument dicts and parameter order, no cuTile launch;
* ``launch_key``: the quick-first key of each launch that has one (computed at every launch);
* ``total``: ``checks`` + ``config`` + ``stages`` + ``launch_key``.

A repeated call (its :class:`ssd.api.Plan` replayed):

* ``key``: :func:`ssd.api.plan_key`; ``prepare``: :func:`ssd.api.prepare`;
* ``allocate``: the fresh outputs and intermediates; ``arguments``: each launch's tuple;
* ``launch``: :func:`ssd.launch.run`, on a GPU the cuTile launches (device, stream, the
  quick-first check); on the CPU, the records;
* ``cutile`` (GPU only): ``cuda.tile.launch`` alone for the same launches, the floor of
  cuTile's launcher;
* ``call``: the whole ``mamba_chunk_scan_combined`` call.

On a GPU the same call is also timed with CUDA events (:func:`ssd.tools.bench.time_fn`, L2 warm)
eagerly and as a CUDA-graph replay, and its signature's first-call path (``validate`` and
``forward_stages``) eagerly: eager minus graph is the host overhead the graph hides. On the CPU
everything runs under ``ssd.launch.capture()`` on CPU tensors, which stand for the sm_90 GPU
the defaults are tuned on (:data:`ssd.launch.CAPTURE_GPU`).

``--cprofile N`` adds the N functions a repeated call spends most time in (cProfile). The
record goes to ``--out`` (default on a GPU ``results/<gpu>/host_profile.json``; on the CPU
only with ``--out``) with the environment (:mod:`ssd.tools.env`).
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

from .env import RESULTS, environment, gpu_slug, write_json

#: The default problem: one 512-token prompt on the 2.7b layer's heads (b, l, h, p, n, g).
PROMPT_512 = (1, 512, 80, 64, 128, 1)
CHUNK_SIZE = 64
FIRST_CALL = ("checks", "config", "stages", "launch_key")
REPEATED_CALL = ("key", "prepare", "allocate", "arguments", "launch", "cutile", "call")


def median_us(fn, reps: int, warmup: int = 20, after=None) -> float:
    """Median wall time of ``fn()`` in µs over ``reps`` calls after ``warmup``; ``after()`` runs
    after each call, outside the timed region (clearing records, synchronising the GPU)."""
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if after is not None:
            after()
    return statistics.median(times) * 1e6


def profile(dims=PROMPT_512, dtype="bfloat16", chunk_size=CHUNK_SIZE, device=None,
            reps: int = 2000, cprofile: int = 0) -> dict:
    """Time the host path of ``mamba_chunk_scan_combined`` on a problem of ``dims`` (b, l, h, p,
    n, g) called as a Mamba-2 layer calls it (D per head, dt_bias, softplus:
    :func:`ssd.tools.bench.make_inputs`), per phase (see the module docstring); ``device`` None:
    CUDA where there is a GPU, else the CPU under capture. ``cprofile``: also the costliest
    functions of ``reps`` repeated calls under cProfile, that many (as text, key "cprofile").
    Returns the record."""
    import torch

    from .. import api, launch
    from .bench import Shape, make_inputs

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.device(device).type == "cuda"
    inputs = make_inputs(Shape("host", *dims), dtype=dtype, device=device)
    x, dt, A, B, C, D, bias = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    limit = (0.0, float("inf"))

    def call():
        return api.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias,
                                             dt_softplus=True)

    def first_call():
        api.validate(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias)
        return api.forward_stages(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias,
                                  dt_softplus=True)

    with launch.capture() as records:
        clear = records.clear
        call()  # the signature's first call: its checks and configuration kept
        call()  # the second: its plan traced
        clear()
        key = api.plan_key(x, dt, A, B, C, chunk_size, D, None, bias, None, None, None, True,
                           limit, False, None)
        plan = api._plans[key]
        config = api.resolve_config(None, chunk_size, x, B)
        prepared = api.prepare(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias)
        with launch.trace() as seen:
            api.run_stages(prepared, chunk_size, True, limit, config)
        quick = [(r.kernel, r.args) for r, q in seen.launches if q is not None]
        first = dict(
            checks=median_us(lambda: api.validate(x, dt, A, B, C, chunk_size, D=D,
                                                  dt_bias=bias), reps),
            config=median_us(lambda: api.resolve_config(None, chunk_size, x, B), reps),
            stages=median_us(lambda: api.run_stages(prepared, chunk_size, True, limit, config),
                             reps, after=clear),
            launch_key=median_us(lambda: [launch.launch_key(k, a) for k, a in quick], reps))
        first["total"] = sum(first.values())
        blanks = plan.allocate(x.device)
        arguments = plan.arguments(prepared, blanks)
        repeated = dict(
            key=median_us(lambda: api.plan_key(x, dt, A, B, C, chunk_size, D, None, bias, None,
                                               None, None, True, limit, False, None), reps),
            prepare=median_us(lambda: api.prepare(x, dt, A, B, C, chunk_size, D=D,
                                                  dt_bias=bias), reps),
            allocate=median_us(lambda: plan.allocate(x.device), reps),
            arguments=median_us(lambda: plan.arguments(prepared, blanks), reps))
        if not gpu:
            repeated["launch"] = median_us(lambda: launch.run(plan.steps, arguments, x.device),
                                           reps, after=clear)
            repeated["call"] = median_us(call, reps, after=clear)
    record = dict(tool="host_profile", device="cuda" if gpu else "cpu (under capture)",
                  problem=dict(zip("blhpng", dims), dtype=dtype, chunk_size=chunk_size),
                  call="D per head, dt_bias, dt_softplus (a Mamba-2 layer's call)", reps=reps,
                  kernels=[s.kernel._pyfunc.__name__.removesuffix("_kernel") for s in plan.steps],
                  first_call_us=first, repeated_call_us=repeated)
    if gpu:
        record.update(gpu_timings(plan, arguments, x.device, call, first_call, reps, record))
    if cprofile:  # after gpu_timings: the kernels are compiled, the plan made
        with contextlib.nullcontext([]) if gpu else launch.capture() as records:
            record["cprofile"] = profiled(call, reps, cprofile,
                                          torch.cuda.synchronize if gpu else records.clear)
    return record


def profiled(call, reps: int, top: int, after) -> str:
    """The ``top`` functions of ``reps`` calls of ``call`` (``after()`` after each) by their own
    time under cProfile, as pstats prints them."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(reps):
        prof.enable()
        call()
        prof.disable()
        after()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def gpu_timings(plan, arguments, device, call, first_call, reps: int, record: dict) -> dict:
    """On a GPU: the phases that launch (into ``record``: the repeated call's ``launch``,
    ``cutile`` and ``call``, the first call's ``call``, each followed by a synchronisation
    outside the timed region), and the call's eager and graph times (CUDA events, L2 warm)."""
    import cuda.tile as ct
    import torch

    from .. import launch
    from .bench import time_fn

    sync = torch.cuda.synchronize
    call()  # compiles (or loads) every kernel; the quick build runs meanwhile
    first_call()
    launch.wait_tuned()
    call()  # the tuned builds from now on
    sync()
    stream = torch.cuda.current_stream()

    def cutile():
        for step, args in zip(plan.steps, arguments):
            ct.launch(stream, step.grid, step.kernel, args)

    record["repeated_call_us"].update(
        launch=median_us(lambda: launch.run(plan.steps, arguments, device), reps, after=sync),
        cutile=median_us(cutile, reps, after=sync), call=median_us(call, reps, after=sync))
    record["first_call_us"]["call"] = median_us(first_call, reps, after=sync)
    events = min(reps, 200)  # CUDA event pairs: each rep keeps its own
    eager = time_fn(call, mode="eager", l2="warm", reps=events)
    graph = time_fn(call, mode="graph", l2="warm", reps=events)
    first = time_fn(first_call, mode="eager", l2="warm", reps=events)
    return dict(eager_ms=eager, graph_ms=graph, first_call_eager_ms=first,
                host_overhead_us=(eager["median_ms"] - graph["median_ms"]) * 1e3,
                first_call_host_overhead_us=(first["median_ms"] - graph["median_ms"]) * 1e3)


def table(record: dict) -> str:
    """The record as a text table: one phase a line, µs."""
    lines = [f"host path of mamba_chunk_scan_combined on {record['device']}: "
             f"{record['problem']}, {record['call']}; median of {record['reps']} reps, µs"]
    for title, part in (("first call of a signature", record["first_call_us"]),
                        ("repeated call (plan replayed)", record["repeated_call_us"])):
        lines.append(f"  {title}")
        lines += [f"    {name:<12}{value:9.1f}" for name, value in part.items()]
    if "eager_ms" in record:
        lines.append(f"  eager {record['eager_ms']['median_ms'] * 1e3:.1f} µs, graph "
                     f"{record['graph_ms']['median_ms'] * 1e3:.1f} µs: host overhead "
                     f"{record['host_overhead_us']:.1f} µs (first-call path eagerly: "
                     f"{record['first_call_host_overhead_us']:.1f} µs)")
    return "\n".join(lines)


def _dims(text: str) -> tuple:
    dims = tuple(int(v) for v in text.split(","))
    if len(dims) != 6:
        raise argparse.ArgumentTypeError("expected six sizes b,l,h,p,n,g")
    return dims


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.host_profile",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=_dims, default=PROMPT_512, metavar="B,L,H,P,N,G",
                        help="problem sizes (default: one 512-token prompt, 2.7b's heads)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--chunk-size", type=int, default=CHUNK_SIZE)
    parser.add_argument("--device", choices=("cpu", "cuda"),
                        help="default: cuda where there is a GPU, else the CPU under capture")
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also print the N costliest functions of a repeated call")
    parser.add_argument("--out", help="output JSON (default on a GPU: "
                                      "results/<gpu>/host_profile.json)")
    args = parser.parse_args(argv)
    record = profile(args.dims, args.dtype, args.chunk_size, args.device, args.reps,
                     args.cprofile)
    env = environment()
    record["environment"] = env
    print(table(record))
    if args.cprofile:
        print(record["cprofile"])
    out = args.out or (RESULTS / gpu_slug(env) / "host_profile.json"
                       if record["device"] == "cuda" else None)
    if out:
        print(f"[host_profile] wrote {write_json(out, record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
