"""Where the backward's time goes: ``python -m ssd.tools.backward_stages`` (library + command line).

``ssd.tools.backward_bench`` times the whole forward + backward against the peers; this tool
opens ours up. For each shape of the models suite (bf16, the layer's SSD call: D per head,
dt_bias, softplus; ``bench.make_inputs``) and chunk size it runs one forward + backward through
``ssd.mamba_chunk_scan_combined`` with every stage's backward wrapped so that its arguments are
kept (:func:`stage_calls`), then times each stage's backward alone on exactly those arguments:
``chunk_scan`` (its kernels and the gate and skip around them), ``state_passing``,
``chunk_state``, ``chunk_cumsum``. Beside them: the forward, and the forward + backward, so that
"between stages" (the backward's sums and casts outside the stages) is what is left. With
``--head-splits``, ``--block-q``, ``--rows-block-q``, ``--warps`` or ``--occupancy`` it also
times ``chunk_scan``'s backward at every combination of those values of ``ScanBackwardConfig``'s
fields (the others at their defaults; head splits that do not divide a shape's heads per group
are skipped), the defaults' point marked: the knobs that trade blocks for a buffer
(``head_splits``) and registers for spills (tiles and warps; ``ScanBackwardConfig``'s docstring
says which spill). ``--state-tiles`` and ``--passing-tiles`` time ``chunk_state``'s and
``state_passing``'s backward at each given tiling, and ``--dprev`` says where dprev_states
forms: ``fold`` (the default: state_passing's walk, then chunk_scan's kernels with
chunk_state's backward folded in, ``ssd.backward.StageBackwards.fold``, timed as one call that
includes the walk), ``walk`` (the walk, chunk_state's backward in its own kernels) or
``kernel`` (chunk_scan's states kernel).

Every time is ``bench.time_fn``'s median of ``--reps`` CUDA-graph replays (host launch overhead
removed), L2 flushed before each; a call that cannot be captured is timed eager, and its record
says so (``mode``). The payload (records, settings, environment) goes to
``_build/backward_stages/<gpu>.json`` (a tuning aid: no chapter reads it, so it stays out of
``results/``) or ``--out``; a table is printed last.
"""
from __future__ import annotations

import argparse
import sys

from ..backward import StageBackwards

#: The stages in the order the backward runs them, and ``fold`` (chunk_scan's and chunk_state's
#: backward in one call, the walk inside), which a table may take in their place.
STAGES = StageBackwards._fields
#: Where dprev_states forms (and whether chunk_state's backward folds into chunk_scan's).
PLACEMENTS = ("fold", "walk", "kernel")


def stage_calls(shape, chunk_size: int, dtype="bfloat16", device="cuda", forward=None,
                backwards: StageBackwards | None = None) -> dict:
    """{stage: (function, args, kwargs)}: each stage's backward as one forward + backward of
    ``shape`` (``bench.make_inputs``, dy ~ N(0, 1)) called it.

    ``forward``: a callable with ``ssd.mamba_chunk_scan_combined``'s signature that takes
    ``backwards`` (None: that function); ``backwards``: the stages to wrap (None:
    ``ssd.backward.cutile_backwards()``)."""
    import torch

    from .. import api
    from ..backward import cutile_backwards
    from .backward_bench import LEAVES, leaves_of, upstream
    from .bench import make_inputs

    forward = forward or api.mamba_chunk_scan_combined
    inner = backwards or cutile_backwards()
    calls = {}

    def kept(name, fn):
        def call(*args, **kwargs):
            calls[name] = (fn, args, kwargs)
            return fn(*args, **kwargs)
        return call

    wrapped = StageBackwards(*(fn and kept(name, fn) for name, fn in zip(STAGES, inner)))
    leaves = leaves_of(make_inputs(shape, dtype, device=device))
    x, dt, A, B, C, D, bias = (leaves[k] for k in LEAVES)
    y = forward(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias, dt_softplus=True,
                backwards=wrapped)
    torch.autograd.grad(y, list(leaves.values()), upstream(shape, dtype, device=device))
    folded = ("chunk_scan", "chunk_state") if inner.fold else ("fold",)
    if missing := [s for s in STAGES if s not in calls and s not in folded]:
        raise RuntimeError(f"the backward never called {', '.join(missing)}")
    return calls


def head_split_choices(shape, chunk_size: int, wanted=()) -> tuple[int, list[int]]:
    """(the default rule's head_splits for ``shape`` at ``chunk_size`` on this GPU, the splits of
    ``wanted`` that divide the heads per group, in order)."""
    import torch

    from ..config import ScanBackwardConfig
    from ..kernels.chunk_scan_backward import launch_splits

    b, l, h, p, n, g = shape.dims
    config = ScanBackwardConfig().for_problem(chunk_size, n, "bfloat16")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    default = launch_splits(config, b, -(-l // chunk_size), h, g, chunk_size, device)
    return default, [s for s in wanted if (h // g) % s == 0]


def backward_call(fn, args, kwargs):
    """``fn(*args, **kwargs)`` as autograd runs a backward: without grad mode (the kept
    arguments include the forward's inputs, leaves that require grad, which a launch outside a
    backward refuses)."""
    import torch

    def call():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return call


def timed(fn, reps) -> dict:
    """``bench.time_fn`` of ``fn`` as a CUDA-graph replay, L2 flushed; eager where the capture
    fails (``mode`` and ``graph_error`` say so)."""
    from .bench import time_fn

    try:
        return dict(time_fn(fn, mode="graph", reps=reps), mode="graph")
    except Exception as exc:  # noqa: BLE001 (a capture failure is a result, recorded)
        return dict(time_fn(fn, mode="eager", reps=reps), mode="eager",
                    graph_error=f"{type(exc).__name__}: {exc}"[:300])


#: The fields of ScanBackwardConfig the sweep varies, in the order the table prints them.
SWEPT = ("head_splits", "block_q", "rows_block_q", "warps", "occupancy")
#: The fields of StateBackwardConfig chunk_state's sweep sets (--state-tiles SxPxN).
STATE_SWEPT = ("block_s", "block_p", "block_n", "occupancy")
#: The fields of PassingBackwardConfig state_passing's sweep sets (--passing-tiles PxN).
PASSING_SWEPT = ("block_p", "block_n", "occupancy")
#: Every swept field, as a progress line names a record's point (occupancy last).
POINT_FIELDS = tuple(dict.fromkeys((*SWEPT[:-1], *STATE_SWEPT, *PASSING_SWEPT)))


def where_dprev_forms(where: str) -> StageBackwards:
    """The cuTile stages with dprev_states formed where ``where`` (of :data:`PLACEMENTS`) says:
    in state_passing's walk with chunk_state's backward folded into chunk_scan's kernels ("fold",
    the default), in the walk with chunk_state's own kernels ("walk"), or by chunk_scan's states
    kernel ("kernel": ``ScanBackwardConfig.dprev_in_walk`` off)."""
    import functools

    from ..backward import chunk_scan_backward_cutile, cutile_backwards
    from ..config import ScanBackwardConfig

    return cutile_backwards(fold=where == "fold")._replace(chunk_scan=functools.partial(
        chunk_scan_backward_cutile, config=ScanBackwardConfig(dprev_in_walk=where != "kernel")))


def run(shapes, chunks=(64, 256), sweep=None, reps=30, dprev=PLACEMENTS,
        state_tiles=(), passing_tiles=(), progress=None) -> dict:
    """Time every stage's backward, the forward and the forward + backward of each shape at each
    chunk size with dprev_states formed where each of ``dprev`` says (:func:`where_dprev_forms`;
    "fold" times chunk_scan's and chunk_state's folded call), chunk_scan's at every combination of
    ``sweep`` ({field of :data:`SWEPT`: values}), chunk_state's at each of ``state_tiles``
    ((block_s, block_p, block_n, occupancy) of StateBackwardConfig) and state_passing's at each
    of ``passing_tiles`` ((block_p, block_n, occupancy) of PassingBackwardConfig: its walk's
    state slices and hint), the sweeps at dprev's first; return the payload (records,
    settings). ``progress``: called with a
    line for each record as it is taken (a run cut short still shows what it measured)."""
    import dataclasses
    import itertools

    import torch

    from .. import api
    from ..config import PassingBackwardConfig, ScanBackwardConfig, StateBackwardConfig
    from .backward_bench import LEAVES, inference, leaves_of, training_step, upstream
    from .bench import make_inputs

    records, sweep = [], sweep or {}

    def add(record):
        records.append(record)
        if progress:
            point = "".join(f" {k}={record[k]}" for k in POINT_FIELDS
                            if record.get(k) is not None)
            progress(f"{record['shape']} q{record['chunk_size']} {record['dprev']} "
                     f"{record['what']}{point}: {record['median_ms']:.3f} ms")
    for shape, q, where_dprev in itertools.product(shapes, chunks, dprev):
        backwards = where_dprev_forms(where_dprev)
        where = dict(shape=shape.name, dims=list(shape.dims), chunk_size=q, dprev=where_dprev)
        calls = stage_calls(shape, q, backwards=backwards)
        default, tried = head_split_choices(shape, q, sweep.get("head_splits", ()))
        for stage, (fn, args, kwargs) in calls.items():
            add(dict(where, what=stage, **timed(backward_call(fn, args, kwargs), reps),
                     head_splits=default if stage in ("chunk_scan", "fold") else None))
        scan = "fold" if "fold" in calls else "chunk_scan"
        fn, args, kwargs = calls[scan]
        base = ScanBackwardConfig(head_splits=default, dprev_in_walk=where_dprev != "kernel")
        values = [tried or (default,)] + [sweep.get(k) or (getattr(base, k),)
                                          for k in SWEPT[1:]]
        swept = any(sweep.values()) and where_dprev == dprev[0]
        for point in itertools.product(*values) if swept else ():
            config = dataclasses.replace(base, **dict(zip(SWEPT, point)))
            stats = timed(backward_call(fn, args, dict(kwargs, config=config)), reps)
            add(dict(where, what=f"{scan} (sweep)", **dict(zip(SWEPT, point)),
                     default=config == base, **stats))
        for stage, cls, fields, points in (
                ("chunk_state", StateBackwardConfig, STATE_SWEPT, state_tiles),
                ("state_passing", PassingBackwardConfig, PASSING_SWEPT, passing_tiles)):
            fn, args, kwargs = calls.get(stage, (None, (), {}))
            for tiles in points if where_dprev == dprev[0] and fn else ():
                config = cls(**dict(zip(fields, tiles)))
                stats = timed(backward_call(fn, args, dict(kwargs, config=config)), reps)
                add(dict(where, what=f"{stage} (sweep)", **dict(zip(fields, tiles)),
                         default=config == cls(), **stats))
        leaves = leaves_of(make_inputs(shape))
        x, dt, A, B, C, D, bias = (leaves[k] for k in LEAVES)

        def forward(x=x, dt=dt, A=A, B=B, C=C, D=D, bias=bias, q=q, backwards=backwards):
            return api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                 dt_softplus=True, backwards=backwards)

        for what, fn in (("forward", inference(forward)),
                         ("forward+backward", training_step(forward, leaves, upstream(shape)))):
            add(dict(where, what=what, **timed(fn, reps)))
        del calls, leaves
        torch.cuda.empty_cache()
    settings = dict(reps=reps, warmup=5, mode="graph (eager where a record says so)",
                    l2="flushed", flush_bytes=512 * 2**20, timer="CUDA events",
                    statistic="median", dtype="bfloat16", chunks=list(chunks), dprev=list(dprev),
                    sweep={k: list(v) for k, v in (sweep or {}).items()},
                    state_tiles=[list(t) for t in state_tiles],
                    passing_tiles=[list(t) for t in passing_tiles])
    return dict(records=records, settings=settings)


def breakdown(records) -> list[dict]:
    """One row per (shape, chunk size, where dprev_states forms): each stage's ms (None for a
    stage the placement does not call), their sum (with ``fold``: fold, which holds the walk, and
    chunk_cumsum), the forward, the forward + backward, the backward (their difference) and what
    lies between the stages (the backward minus the stages' sum)."""
    rows = {}
    for r in records:
        if r["what"].endswith("(sweep)"):
            continue
        row = rows.setdefault((r["shape"], r["chunk_size"], r["dprev"]),
                              dict(shape=r["shape"], chunk_size=r["chunk_size"], dprev=r["dprev"]))
        row[r["what"]] = r["median_ms"]
        if r["what"] in ("chunk_scan", "fold"):
            row["head_splits"] = r["head_splits"]
    out = []
    for row in rows.values():
        called = ("fold", "chunk_cumsum") if "fold" in row else STAGES[:-1]
        for s in STAGES:
            row.setdefault(s, None)
        row["stages"] = sum(row[s] for s in called)
        row["backward"] = row["forward+backward"] - row["forward"]
        row["between stages"] = row["backward"] - row["stages"]
        out.append(row)
    return out


def table(payload) -> str:
    """The breakdown as text, then chunk_scan's sweep (``*``: the defaults' point)."""
    cols = [*STAGES, "stages", "between stages", "backward", "forward", "forward+backward"]
    lines = [f"ms, CUDA-graph replay, L2 flushed, median of {payload['settings']['reps']}",
             f"{'shape':13s} {'q':>4s} {'dprev':>6s} {'splits':>6s} "
             + " ".join(f"{c[:13]:>13s}" for c in cols)]
    for row in breakdown(payload["records"]):
        lines.append(f"{row['shape']:13s} {row['chunk_size']:4d} {row['dprev']:>6s} "
                     f"{row['head_splits']:6d} "
                     + " ".join(f"{'–':>13s}" if row[c] is None else f"{row[c]:13.3f}"
                                for c in cols))
    sweep = [r for r in payload["records"] if r["what"] in ("chunk_scan (sweep)", "fold (sweep)")]
    if sweep:
        lines.append(f"{sweep[0]['what'][:-8]}'s backward by " + ", ".join(SWEPT)
                     + " (None: the compiler's or block_q's; * the defaults)")
        for r in sweep:
            point = " ".join(f"{str(r[k]):>5s}" for k in SWEPT)
            lines.append(f"{r['shape']:13s} {r['chunk_size']:4d} {point}"
                         f"{'*' if r['default'] else ' '} {r['median_ms']:9.3f}")
    for stage, fields in (("chunk_state", STATE_SWEPT), ("state_passing", PASSING_SWEPT)):
        rows = [r for r in payload["records"] if r["what"] == f"{stage} (sweep)"]
        if rows:
            lines.append(f"{stage}'s backward by " + ", ".join(fields) + " (* the defaults)")
        for r in rows:
            point = " ".join(f"{str(r[k]):>5s}" for k in fields)
            lines.append(f"{r['shape']:13s} {r['chunk_size']:4d} {point}"
                         f"{'*' if r['default'] else ' '} {r['median_ms']:9.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .bench import SUITES
    from .env import ROOT, environment, gpu_slug, write_json

    parser = argparse.ArgumentParser(prog="python -m ssd.tools.backward_stages",
                                     description=__doc__.splitlines()[0])
    names = [s.name for s in SUITES["models"]]
    parser.add_argument("--shapes", default=",".join(names),
                        help=f"models shapes, comma-separated (of {', '.join(names)})")
    parser.add_argument("--chunks", default="64,256", help="chunk sizes (default %(default)s)")
    parser.add_argument("--head-splits", default="",
                        help="chunk_scan's backward also at these head splits, e.g. 1,2,4,8 "
                             "(those that divide a shape's heads per group)")
    parser.add_argument("--block-q", default="",
                        help="chunk_scan's backward also at these tiles, e.g. 32,64")
    parser.add_argument("--rows-block-q", default="",
                        help="and these tiles of its rows kernel alone, e.g. 32,64")
    parser.add_argument("--warps", default="", help="and these warp counts (4, 8)")
    parser.add_argument("--occupancy", default="", help="and these occupancy hints (1..32)")
    parser.add_argument("--dprev", default=",".join(PLACEMENTS),
                        help="where dprev_states forms: fold (the default: the walk, "
                             "chunk_state's backward folded into chunk_scan's kernels), walk "
                             "(the walk, chunk_state's own kernels), kernel (chunk_scan's states "
                             "kernel); the sweep takes the first")
    parser.add_argument("--state-tiles", default="",
                        help="chunk_state's backward also at these block_s x block_p x block_n, "
                             "each with an occupancy hint after @ or none, e.g. "
                             "64x32x32,64x64x64@2")
    parser.add_argument("--passing-tiles", default="",
                        help="state_passing's backward also at these block_p x block_n[@O], e.g. "
                             "32x64,64x64@4")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", help="output JSON (default _build/backward_stages/<gpu>.json)")
    args = parser.parse_args(argv)
    wanted = args.shapes.split(",")
    if unknown := [s for s in wanted if s not in names]:
        parser.error(f"--shapes: {', '.join(unknown)} unknown (known: {', '.join(names)})")
    try:
        chunks = tuple(int(v) for v in args.chunks.split(","))
        sweep = {k: tuple(int(v) for v in getattr(args, k).split(",") if v) for k in SWEPT}
    except ValueError as exc:
        parser.error(f"--chunks, --head-splits, --block-q, --rows-block-q, --warps, "
                     f"--occupancy: comma-separated integers ({exc})")
    if bad := [q for q in chunks if q not in (16, 32, 64, 128, 256)]:
        parser.error(f"--chunks: {bad} not in 16, 32, 64, 128, 256")
    if bad := [s for s in sweep["head_splits"] if s < 1]:
        parser.error(f"--head-splits: {bad} not positive")
    for name in ("block_q", "rows_block_q"):
        if bad := [v for v in sweep[name] if v < 8 or v & (v - 1)]:
            parser.error(f"--{name.replace('_', '-')}: {bad} not powers of two of at least 8")
    if bad := [v for v in sweep["warps"] if v not in (4, 8)]:
        parser.error(f"--warps: {bad} not 4 or 8")
    if bad := [v for v in sweep["occupancy"] if not 1 <= v <= 32]:
        parser.error(f"--occupancy: {bad} not in 1..32")
    tiles = {}
    for flag, size in (("state_tiles", 3), ("passing_tiles", 2)):
        option = "--" + flag.replace("_", "-")
        try:  # NxN[@O]: the tiles, then the occupancy hint (none: the compiler's choice)
            tiles[flag] = [(*(int(v) for v in t.partition("@")[0].split("x")),
                            int(t.partition("@")[2]) if "@" in t else None)
                           for t in getattr(args, flag).split(",") if t]
        except ValueError:
            parser.error(f"{option}: {getattr(args, flag)!r} is not {'x'.join('N' * size)}[@O],"
                         "... (integers)")
        if bad := [t for t in tiles[flag]
                   if len(t) != size + 1 or any(v < 8 or v & (v - 1) for v in t[:-1])]:
            parser.error(f"{option}: {bad} not {size} powers of two of at least 8")
        if bad := [t for t in tiles[flag] if t[-1] is not None and not 1 <= t[-1] <= 32]:
            parser.error(f"{option}: {bad}: the occupancy after @ is 1..32")
    dprev = tuple(args.dprev.split(","))
    if bad := [d for d in dprev if d not in PLACEMENTS]:
        parser.error(f"--dprev: {bad} not of {', '.join(PLACEMENTS)}")
    env = environment()
    shapes = [s for s in SUITES["models"] if s.name in wanted]
    payload = dict(run(shapes, chunks, {k: v for k, v in sweep.items() if v}, args.reps, dprev,
                       tiles["state_tiles"], tiles["passing_tiles"],
                       progress=lambda line: print(line, file=sys.stderr, flush=True)),
                   environment=env)
    out = args.out or ROOT / "_build" / "backward_stages" / f"{gpu_slug(env['gpu'])}.json"
    write_json(out, payload)
    print(table(payload))
    print(f"[backward_stages] wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
