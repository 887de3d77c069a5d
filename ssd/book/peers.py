"""The peers chapter (notebooks/10_peers): ours beside mamba_ssm and TileGym, from the recordings.

Every function takes the loaded recording dicts (``ssd.book.recordings.load_recorded``) and
returns a :class:`ssd.book.tables.Table` or a matplotlib ``Figure``; nothing here runs a
kernel. The recordings:

* ``models``: the ``models`` suite of ``python -m ssd.tools.bench``: ours and mamba_ssm at chunk
  sizes 64/128/256, TileGym untuned at 64, each in CUDA-graph replay and eager launches, with L2
  flushed and warm; per-stage times; the copy and matmul ceilings measured in the same run;
* ``tilegym_replayed``: ours beside TileGym tuned, which replays the configurations its own
  search chose (graph replay, L2 flushed), with both sides' per-stage times;
* ``serving``: the ``serving`` suite, shapes outside the ``models`` suite, timed as ``models``;
* ``first-call``: the first call on never-seen shapes, each in a fresh process with an empty
  cuTile kernel cache, and the seconds each kernel took to compile.

Speedups are always ratios within one recording (the peers ran in the same process, on the same
inputs): a peer's time over ours, each at its fastest chunk size.
"""
from __future__ import annotations

import math

import numpy as np

from ..tools.bench import FUSED_SCAN_STAGE
from .tables import Table

#: How the chapter names each implementation, and its colour in every figure.
LABELS = {"ssd": "ours", "mamba_ssm": "mamba_ssm", "tilegym": "TileGym",
          "tilegym_tuned": "TileGym tuned"}
COLORS = {"ssd": "C0", "mamba_ssm": "C1", "tilegym": "C2", "tilegym_tuned": "C3"}
PEERS = ("ssd", "mamba_ssm", "tilegym")

#: The work each recorded kernel does, by the stage names of the chunked algorithm: ours
#: (``ssd.tools.bench.stage_times``), mamba_ssm's five Triton kernels and TileGym's three.
WORK = {"chunk_cumsum": "chunk_cumsum",
        "chunk_state": "states", "state_passing": "states", "chunk_state+state_passing": "states",
        "state": "states",
        "bmm": "outputs", "chunk_scan": "outputs", "out": "outputs",
        FUSED_SCAN_STAGE: "states + outputs"}
WORK_COLORS = {"chunk_cumsum": "0.6", "states": "C4", "outputs": "C9",
               "states + outputs": "C8"}


# ----------------------------------------------------------------------------- helpers


def geomean(values) -> float:
    values = [v for v in values if v is not None]
    return float(np.exp(np.mean(np.log(values)))) if values else math.nan


def _dims(dims) -> str:
    return "×".join(str(d) for d in dims)


def _log_axes(ax, log, xlabel, ylabel, title, **legend):
    """Log scales on the axes named in ``log`` ("x", "xy"), labelled with plain numbers at their
    major ticks only; the axis labels, title and legend at the chapter's font sizes."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    for name in log:
        getattr(ax, f"set_{name}scale")("log")
        fmt, axis = ScalarFormatter(), getattr(ax, f"{name}axis")
        fmt.set_scientific(False)
        axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(fmt)
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, **legend)


# ----------------------------------------------------------------------------- records


def best(records, impl, mode="graph", l2="flushed") -> dict:
    """(shape, dtype) -> the fastest record of ``impl`` over the chunk sizes it ran at
    (``ssd.tools.bench.best_records``, kept apart by dtype)."""
    out = {}
    for r in records:
        if r["impl"] == impl and r["mode"] == mode and r["l2"] == l2:
            key = (r["shape"], r.get("dtype", "bfloat16"))
            if key not in out or r["median_ms"] < out[key]["median_ms"]:
                out[key] = r
    return out


def shapes(records) -> list:
    """The (shape, dtype) pairs of a recording, in the order it ran them."""
    return list(dict.fromkeys((r["shape"], r.get("dtype", "bfloat16")) for r in records))


def record(records, shape, impl, chunk_size, mode, l2, dtype="bfloat16") -> dict:
    hits = [r for r in records if (r["shape"], r["impl"], r["chunk_size"], r["mode"], r["l2"],
                                   r.get("dtype", "bfloat16")) ==
            (shape, impl, chunk_size, mode, l2, dtype)]
    if len(hits) != 1:
        raise KeyError(f"{len(hits)} records of {shape} {impl} q{chunk_size} {mode} {l2} {dtype}")
    return hits[0]


# ----------------------------------------------------------------------------- method


def environment_line(payload) -> str:
    """Where and with what a recording was made, in four short lines."""
    e = payload["environment"]
    sm = str(e.get("compute_capability", "")).replace(".", "")
    return (f"{e.get('gpu')} ({e.get('sm_count')} SMs, sm_{sm}), driver {e.get('driver')}\n"
            f"recorded {str(e.get('date', ''))[:10]} at git revision {e.get('git_revision')}\n"
            f"cuda-tile {e.get('cuda_tile')}, tileiras {e.get('tileiras')}, "
            f"torch {e.get('torch')}, triton {e.get('triton')}\n"
            f"mamba_ssm {e.get('mamba_ssm')}, TileGym {e.get('tilegym')}")


def method_table(payload) -> Table:
    """How every time of a suite was taken: the harness settings and what it checked first."""
    s, rec, c = payload["settings"], payload["records"], payload["ceilings"]
    impls = list(dict.fromkeys(r["impl"] for r in rec))
    qs = {i: sorted({r["chunk_size"] for r in rec if r["impl"] == i}) for i in impls}
    rows = [
        ("timer", f"{s['timer']} around each call"),
        ("warm-up", f"{s['warmup']} untimed calls"),
        ("statistic", f"{s['statistic']} of {s['reps']} timed calls, band q20–q80"),
        ("L2 flushed", f"a {s['flush_bytes'] / 2**20:.0f} MiB buffer zeroed before every call"),
        ("L2 warm", "back-to-back calls"),
        ("launch modes", ", ".join(dict.fromkeys(r["mode"] for r in rec))),
        ("chunk sizes", "; ".join(f"{LABELS[i]} {qs[i]}" for i in impls)),
        ("mamba_ssm autotuning", s.get("mamba_ssm_autotune", "–")),
        ("correctness gate", f"worst rel. error {max(r['gate_rel_err'] for r in rec):.1e} "
                             f"against float64; {len(payload['failures'])} failed"),
        ("ceilings (same run)", f"copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
                                f"bf16 matmul {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s"),
    ]
    return Table([dict(what=k, how=v) for k, v in rows], ["what", "how"])


# ----------------------------------------------------------------------------- headline


def headline(payload, replayed=None, mode="graph", l2="flushed") -> Table:
    """Per shape: each implementation at its fastest chunk size (ms, and the chunk size), the
    width of ours' q20–q80 band as a percentage of its median, and ours' speedup over each peer
    (``x_<peer>``: their time / ours); the last row holds the geometric means.
    ``replayed``: the TileGym-tuned recording, whose speedup is ours over TileGym tuned timed
    in that run."""
    rec = payload["records"]
    b = {i: best(rec, i, mode, l2) for i in PEERS}
    tuned = {}
    if replayed is not None:
        ours_r, tg_r = best(replayed["records"], "ssd"), best(replayed["records"], "tilegym_tuned")
        tuned = {k: tg_r[k]["median_ms"] / ours_r[k]["median_ms"] for k in ours_r if k in tg_r}
    rows = []
    for key in shapes(rec):
        o = b["ssd"][key]
        row = dict(shape=key[0], dtype=key[1], dims=_dims(o["dims"]), ours_ms=o["median_ms"],
                   ours_q=o["chunk_size"], ours_q20=o["q20_ms"], ours_q80=o["q80_ms"],
                   floor_pct=100 * o["floor_ms"] / o["median_ms"],
                   band_pct=100 * (o["q80_ms"] - o["q20_ms"]) / o["median_ms"],
                   ours=f"{o['median_ms']:.3f} ({o['chunk_size']})")
        for impl in PEERS[1:]:
            r = b[impl].get(key)
            row[f"{impl}_ms"] = r and r["median_ms"]
            row[f"{impl}_q"] = r and r["chunk_size"]
            row[f"x_{impl}"] = r and r["median_ms"] / o["median_ms"]
        m = b["mamba_ssm"].get(key)
        row["mamba_ssm"] = m and f"{m['median_ms']:.3f} ({m['chunk_size']})"
        row["x_tilegym_tuned"] = tuned.get(key)
        rows.append(row)
    rows.append(dict(shape="geometric mean", dtype="", dims="", ours="", mamba_ssm="",
                     tilegym_ms="", band_pct="",
                     **{k: geomean(r[k] for r in rows)
                        for k in ("x_mamba_ssm", "x_tilegym", "x_tilegym_tuned")}))
    cols = ["shape", "dims", "ours", "band_pct", "mamba_ssm", "tilegym_ms", "x_mamba_ssm",
            "x_tilegym", "x_tilegym_tuned"]
    if len({r["dtype"] for r in rows[:-1]}) > 1:
        cols.insert(1, "dtype")
    if replayed is None:
        cols.remove("x_tilegym_tuned")
    x = lambda v: f"{v:.2f}×"  # noqa: E731
    return Table(rows, cols, {"tilegym_ms": ".3f", "band_pct": ".1f", "x_mamba_ssm": x,
                              "x_tilegym": x, "x_tilegym_tuned": x},
                 {"dims": "b×l×h×p×n×g", "ours": "ours ms (chunk)", "band_pct": "ours q20–q80 %",
                  "mamba_ssm": "mamba_ssm ms (chunk)", "tilegym_ms": "TileGym untuned ms",
                  "x_mamba_ssm": "× mamba_ssm", "x_tilegym": "× TileGym untuned",
                  "x_tilegym_tuned": "× TileGym tuned"})


def chunk_table(payload, mode="graph", l2="flushed") -> Table:
    """Ours and mamba_ssm at every chunk size the run timed: time over the implementation's
    fastest on the shape (1 = the chunk size it is counted at)."""
    rec = payload["records"]
    rows = []
    for impl in ("ssd", "mamba_ssm"):
        fastest = best(rec, impl, mode, l2)
        for r in rec:
            if r["impl"] == impl and r["mode"] == mode and r["l2"] == l2:
                f = fastest[r["shape"], r.get("dtype", "bfloat16")]
                rows.append(dict(impl=impl, shape=r["shape"], chunk_size=r["chunk_size"],
                                 ms=r["median_ms"], vs_fastest=r["median_ms"] / f["median_ms"]))
    return Table(rows, ["impl", "shape", "chunk_size", "ms", "vs_fastest"],
                 {"ms": ".3f", "vs_fastest": ".3f"})


def plot_chunk_sizes(payload):
    """Two panels (ours, mamba_ssm): time at each chunk size over that implementation's
    fastest, per shape."""
    from matplotlib.figure import Figure

    t = chunk_table(payload)
    names = list(dict.fromkeys(t.column("shape")))
    qs = sorted(set(t.column("chunk_size")))
    fig = Figure(figsize=(7.5, 2.6), dpi=90)
    axes = fig.subplots(1, 2, sharey=True)
    w = 0.8 / len(qs)
    for ax, impl in zip(axes, ("ssd", "mamba_ssm")):
        for j, q in enumerate(qs):
            vals = [t.find(impl=impl, shape=s, chunk_size=q)["vs_fastest"] for s in names]
            ax.bar(np.arange(len(names)) + (j - (len(qs) - 1) / 2) * w, vals, w, label=f"q = {q}",
                   color=f"C{j + 5}")
        ax.axhline(1, color="k", lw=0.6)
        ax.set_xticks(range(len(names)), names, fontsize=7, rotation=20, ha="right")
        ax.set_title(LABELS[impl], fontsize=9)
        ax.set_ylim(0.9, None)
    axes[0].set_ylabel("time / its fastest", fontsize=8)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- stages


def stage_table(payload, replayed=None) -> Table:
    """Tidy per-kernel times (ms; each kernel alone, eager, L2 flushed): ours and mamba_ssm from
    ``payload["stages"]``, each at its fastest chunk size, and TileGym tuned (with ours again,
    from the same process) from ``replayed["tilegym_stages"]``; with ``forward_ms``, the
    implementation's whole forward (graph replay, L2 flushed) in the same recording."""
    rows = []

    def add(source, rec, shape, impl, q, kernels):
        fwd = best(rec, impl).get((shape, "bfloat16"))
        for k, ms in kernels.items():
            rows.append(dict(source=source, shape=shape, impl=impl, chunk_size=q, kernel=k,
                             work=WORK[k], ms=ms, forward_ms=fwd and fwd["median_ms"]))

    for st in payload["stages"]:
        add("models", payload["records"], st["shape"], "ssd", st["ssd_chunk_size"], st["ssd"])
        if "mamba_ssm" in st:
            add("models", payload["records"], st["shape"], "mamba_ssm",
                st["mamba_ssm_chunk_size"], st["mamba_ssm"])
    if replayed is not None:
        rec = replayed["records"]
        for shape, st in replayed.get("tilegym_stages", {}).items():
            add("tilegym_replayed", rec, shape, "ssd", st["ssd_chunk_size"], st["ssd"])
            add("tilegym_replayed", rec, shape, "tilegym_tuned", 64, st["tilegym_tuned"])
    return Table(rows, ["source", "shape", "impl", "chunk_size", "kernel", "work", "ms"],
                 {"ms": ".4f"})


def work_table(stages: Table) -> Table:
    """Per (recording, shape, implementation): the time of each kind of work (the kernels'
    times summed by ``WORK``), the kernels' sum, and that sum over the graph-replay forward."""
    groups = {}
    for r in stages:
        g = groups.setdefault((r["source"], r["shape"], r["impl"]),
                              dict(source=r["source"], shape=r["shape"], impl=r["impl"],
                                   chunk_size=r["chunk_size"], kernels=0, sum_ms=0.0,
                                   forward_ms=r["forward_ms"]))
        g[r["work"]] = g.get(r["work"], 0.0) + r["ms"]
        g["kernels"] += 1
        g["sum_ms"] += r["ms"]
    rows = list(groups.values())
    for g in rows:
        g["sum_over_forward"] = g["forward_ms"] and g["sum_ms"] / g["forward_ms"]
    cols = ["source", "shape", "impl", "chunk_size", "kernels", *WORK_COLORS, "sum_ms",
            "forward_ms", "sum_over_forward"]
    return Table(rows, cols, {k: ".3f" for k in (*WORK_COLORS, "sum_ms", "forward_ms",
                                                   "sum_over_forward")})


def plot_stages(payload, replayed=None):
    """One panel per shape: a bar per implementation, one segment per kernel (timed alone),
    coloured by the work it does; TileGym tuned's bar from the replay recording."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    t = stage_table(payload, replayed)
    bars = [("models", "ssd"), ("models", "mamba_ssm"), ("tilegym_replayed", "tilegym_tuned")]
    names = list(dict.fromkeys(t.column("shape")))
    fig = Figure(figsize=(7.5, 1.1 * len(names) + 0.6), dpi=90)
    axes = fig.subplots(len(names), 1)
    for ax, shape in zip(np.atleast_1d(axes), names):
        ylabels = []
        for y, (source, impl) in enumerate(bars):
            left = 0.0
            for r in t:
                if (r["source"], r["shape"], r["impl"]) != (source, shape, impl):
                    continue
                ax.barh(y, 1e3 * r["ms"], left=left, color=WORK_COLORS[r["work"]],
                        edgecolor="white", lw=0.8, height=0.7)
                left += 1e3 * r["ms"]
            ylabels.append(f"{LABELS[impl]}")
        ax.set_yticks(range(len(bars)), ylabels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(shape, fontsize=8, loc="left", pad=2)
        ax.tick_params(axis="x", labelsize=7)
    np.atleast_1d(axes)[-1].set_xlabel("µs (each kernel timed alone, eager, L2 flushed)",
                                       fontsize=8)
    fig.legend(handles=[Patch(color=c, label=w) for w, c in WORK_COLORS.items()], fontsize=7,
               loc="upper center", ncol=len(WORK_COLORS), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / fig.get_figheight()))
    return fig


# ----------------------------------------------------------------------------- floor


def states_round_trip_bytes(dims, chunk_size, state_bytes=2) -> int:
    """Bytes of the entering states (b, c, h, p, n) written by stage 2 and read back by
    ``chunk_scan`` when they run as separate kernels (stored in the input dtype)."""
    b, l, h, p, n, _ = dims
    return 2 * b * math.ceil(l / chunk_size) * h * p * n * state_bytes


def floor_table(payload, replayed=None) -> Table:
    """Per shape: the floor (``ssd.tools.bench.floor_ms``: compulsory bytes over the copy
    ceiling, or the causal chunked FLOPs over the matmul ceiling, whichever is longer), each
    implementation's time as a percentage of it, whether ours runs states and outputs (stages 2
    and 3) in one kernel or two, and where two, the time of the entering states' round trip at
    the copy ceiling."""
    rec, ceil = payload["records"], payload["ceilings"]
    b = {i: best(rec, i) for i in PEERS}
    tg = best(replayed["records"], "tilegym_tuned") if replayed is not None else {}
    one = {st["shape"]: FUSED_SCAN_STAGE in st["ssd"] for st in payload.get("stages", [])}
    rows = []
    for key in shapes(rec):
        o = b["ssd"][key]
        row = dict(shape=key[0], floor_MB=o["floor_bytes"] / 1e6,
                   floor_GFLOP=o["floor_flops"] / 1e9,
                   flop_per_byte=o["floor_flops"] / o["floor_bytes"], bound=o["floor_bound"],
                   floor_us=1e3 * o["floor_ms"])
        for impl in PEERS:
            r = b[impl].get(key)
            row[f"{impl}_pct"] = r and 100 * r["floor_ms"] / r["median_ms"]
        r = tg.get(key)
        row["tilegym_tuned_pct"] = r and 100 * r["floor_ms"] / r["median_ms"]
        row["ours_kernels"] = {True: "one kernel", False: "two kernels"}.get(one.get(key[0]))
        row["states_us"] = (None if one.get(key[0], True) else
                            1e6 * states_round_trip_bytes(o["dims"], o["chunk_size"])
                            / ceil["copy_bytes_per_s"])
        rows.append(row)
    pct = ".1f"
    return Table(rows, ["shape", "floor_MB", "floor_GFLOP", "flop_per_byte", "bound", "floor_us",
                        "ssd_pct", "mamba_ssm_pct", "tilegym_pct", "tilegym_tuned_pct",
                        "ours_kernels", "states_us"],
                 {"floor_MB": ".0f", "floor_GFLOP": ".1f", "flop_per_byte": ".0f",
                  "floor_us": ".1f",
                  "ssd_pct": pct, "mamba_ssm_pct": pct, "tilegym_pct": pct,
                  "tilegym_tuned_pct": pct, "states_us": ".1f"},
                 {"floor_MB": "MB", "floor_GFLOP": "GFLOP", "flop_per_byte": "FLOP/byte",
                  "floor_us": "floor µs", "ssd_pct": "ours %", "mamba_ssm_pct": "mamba_ssm %",
                  "tilegym_pct": "TileGym %", "tilegym_tuned_pct": "TileGym tuned %",
                  "ours_kernels": "ours: states and outputs in",
                  "states_us": "states round trip µs"})


def plot_roofline(payload, replayed=None):
    """Left: the roofline of the two measured ceilings and every implementation's forward,
    at its shape's arithmetic intensity (the floor's FLOPs per compulsory byte) and the rate
    those FLOPs ran at. Right: each forward's time as a percentage of its floor."""
    from matplotlib.figure import Figure

    ceil = payload["ceilings"]
    bw, peak = ceil["copy_bytes_per_s"], ceil["bf16_flops_per_s"]
    points = {i: best(payload["records"], i) for i in PEERS}
    if replayed is not None:
        points["tilegym_tuned"] = best(replayed["records"], "tilegym_tuned")
    fig = Figure(figsize=(8, 3), dpi=90)
    ax, bx = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=(1, 1.3)))
    xs = np.logspace(1, 3.3, 100)
    ax.plot(xs, np.minimum(bw * xs, peak) / 1e12, color="k", lw=1)
    ax.axvline(peak / bw, color="0.6", lw=0.6, ls=":")
    for impl, recs in points.items():
        ax.scatter([r["floor_flops"] / r["floor_bytes"] for r in recs.values()],
                   [r["floor_flops"] / (r["median_ms"] * 1e-3) / 1e12 for r in recs.values()],
                   s=14, color=COLORS[impl], label=LABELS[impl])
    _log_axes(ax, "xy", "FLOP per compulsory byte", "TFLOP/s of the floor's FLOPs",
              "roofline (ridge dotted)", loc="lower right")
    t = floor_table(payload, replayed)
    names = t.column("shape")
    w = 0.8 / len(points)
    for j, impl in enumerate(points):
        bx.bar(np.arange(len(names)) + (j - (len(points) - 1) / 2) * w,
               [v or 0 for v in t.column(f"{impl}_pct")], w, color=COLORS[impl], label=LABELS[impl])
    bx.set_xticks(range(len(names)), names, fontsize=7, rotation=20, ha="right")
    bx.set_ylabel("floor / time, %", fontsize=8)
    bx.set_title("fraction of the floor reached", fontsize=9)
    bx.tick_params(labelsize=7)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- L2, launches


def cache_launch_table(*payloads) -> Table:
    """For every shape of the given recordings and every implementation at its fastest chunk
    size (graph replay, L2 flushed): its time in each launch mode and L2 condition at that
    chunk size, warm over flushed, and eager over graph (both with L2 warm)."""
    rows = []
    for p in payloads:
        rec = p["records"]
        for impl in PEERS:
            for (shape, dtype), r in best(rec, impl).items():
                t = {(m, c): record(rec, shape, impl, r["chunk_size"], m, c, dtype)["median_ms"]
                     for m in ("graph", "eager") for c in ("flushed", "warm")}
                rows.append(dict(shape=shape, dtype=dtype, impl=impl, chunk_size=r["chunk_size"],
                                 MB=r["floor_bytes"] / 1e6,
                                 graph_flushed=t["graph", "flushed"], graph_warm=t["graph", "warm"],
                                 eager_flushed=t["eager", "flushed"], eager_warm=t["eager", "warm"],
                                 warm_over_flushed=t["graph", "warm"] / t["graph", "flushed"],
                                 eager_over_graph=t["eager", "warm"] / t["graph", "warm"]))
    fmt = {k: ".4f" for k in ("graph_flushed", "graph_warm", "eager_flushed", "eager_warm")}
    return Table(rows, ["shape", "impl", "chunk_size", "MB", *fmt, "warm_over_flushed",
                        "eager_over_graph"],
                 {**fmt, "MB": ".0f", "warm_over_flushed": ".3f", "eager_over_graph": ".2f"})


def plot_l2(table: Table):
    """Warm over flushed (graph replay) against the bytes the forward must move."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 2.6), dpi=90)
    ax = fig.subplots()
    for impl in PEERS:
        rows = [r for r in table if r["impl"] == impl]
        ax.scatter([r["MB"] for r in rows], [r["warm_over_flushed"] for r in rows], s=16,
                   color=COLORS[impl], label=LABELS[impl])
    ax.axhline(1, color="k", lw=0.6)
    _log_axes(ax, "x", "compulsory MB per forward (inputs read once, y written once)",
              "time warm / flushed", "What a warm L2 changes (CUDA-graph replay)")
    fig.tight_layout()
    return fig


def plot_launches(table: Table):
    """Eager time against graph-replay time (both L2 warm), every shape and implementation:
    on the diagonal the GPU's work sets the time; above it, the host's."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 3.2), dpi=90)
    ax = fig.subplots()
    for impl in PEERS:
        rows = [r for r in table if r["impl"] == impl]
        ax.scatter([1e3 * r["graph_warm"] for r in rows], [1e3 * r["eager_warm"] for r in rows],
                   s=16, color=COLORS[impl], label=LABELS[impl])
    lo = 1e3 * min(table.column("graph_warm")) / 1.5
    hi = 1e3 * max(table.column("eager_warm")) * 1.5
    ax.plot([lo, hi], [lo, hi], color="k", lw=0.6)
    _log_axes(ax, "xy", "CUDA-graph replay, µs", "eager launches, µs",
              "Eager against graph replay (L2 warm)")
    fig.tight_layout()
    return fig


def host_bound(table: Table, factor=1.5) -> dict:
    """impl -> the eager times (ms, L2 warm) of the cases whose eager time is more than
    ``factor`` times their graph replay: there the host, not the GPU, sets the eager time."""
    out = {}
    for r in table:
        if r["eager_over_graph"] > factor:
            out.setdefault(r["impl"], []).append(r["eager_warm"])
    return out


# ----------------------------------------------------------------------------- compile, tuning


def first_call_table(payload) -> Table:
    """The first-call suite: per never-seen shape, the first call's wall time, the seconds its
    kernels took to compile in it (the first build of each), the seconds of builds compiled
    beside it in a child process (each kernel's later builds: chunk_scan's tuned one), when
    those were ready, and the call after that."""
    rows = []
    for r in payload["rows"]:
        if "error" in r:
            rows.append(dict(shape=r["shape"], error=r["error"]))
            continue
        builds = r.get("compile_s", {})
        rows.append(dict(shape=r["shape"], **{"b×l×h×p×n×g": _dims(r["dims"])},
                         first_s=r["first_s"],
                         compiled_in_call_s=sum(v[0] for v in builds.values()),
                         kernels=len(builds),
                         background_s=sum(sum(v[1:]) for v in builds.values()),
                         tuned_ready_s=r.get("tuned_s"), second_ms=1e3 * r["second_s"]))
    return Table(rows, ["shape", "b×l×h×p×n×g", "first_s", "compiled_in_call_s",
                        "background_s", "tuned_ready_s", "second_ms"],
                 {"first_s": ".1f", "compiled_in_call_s": ".1f", "background_s": ".1f",
                  "tuned_ready_s": ".1f", "second_ms": ".0f"},
                 {"first_s": "first call s", "compiled_in_call_s": "compiling in it s",
                  "background_s": "compiling beside it s", "tuned_ready_s": "tuned ready s",
                  "second_ms": "next call ms"})


def tuning_table(payload, replayed=None) -> Table:
    """Per models shape: each implementation's first call at its fastest chunk size in the
    benchmark process (compilation, and for mamba_ssm its autotuning on this shape, plus one
    run), ours' tuned build ready, and the seconds of TileGym's own search where the replay
    recording names the search it replays. A record whose kernels were compiled ahead of the
    run (``precompiled``: its first call a cache hit) shows none."""
    rec = payload["records"]
    b = {i: best(rec, i) for i in PEERS}
    source = (replayed or {}).get("tilegym_replayed_from", {})
    rows = []
    for key in shapes(rec):
        row = dict(shape=key[0])
        for impl in PEERS:
            r = b[impl].get(key)
            row[f"{impl}_s"] = None if not r or r.get("precompiled") else r["first_call_s"]
        ours = b["ssd"][key]
        row["ssd_tuned_s"] = None if ours.get("precompiled") else ours.get("tuned_s")
        row["tilegym_search_s"] = source.get(key[0], {}).get("tuning_s")
        rows.append(row)
    return Table(rows, ["shape", "ssd_s", "ssd_tuned_s", "mamba_ssm_s", "tilegym_s",
                        "tilegym_search_s"],
                 {k: ".1f" for k in ("ssd_s", "ssd_tuned_s", "mamba_ssm_s", "tilegym_s",
                                     "tilegym_search_s")},
                 {"ssd_s": "ours s", "ssd_tuned_s": "ours tuned ready s",
                  "mamba_ssm_s": "mamba_ssm s (autotuned)", "tilegym_s": "TileGym untuned s",
                  "tilegym_search_s": "TileGym tuned: search s"})


def stage_ratios(work: Table) -> Table:
    """Per shape, ours against each peer on the same work, from :func:`work_table` (each side
    from one recording): stages 2 and 3 together (everything after chunk_cumsum), and where
    ours runs them as separate kernels, the states and the outputs apart. Ratios are the
    peer's time over ours (above 1: ours faster); ``outputs_share``: the peer's outputs work
    over its kernels' sum."""
    rows = []
    by = {(r["source"], r["shape"], r["impl"]): r for r in work}
    for (source, shape, impl), peer in by.items():
        if impl == "ssd" or (source, shape, "ssd") not in by:
            continue
        ours = by[source, shape, "ssd"]
        after = lambda g: g["sum_ms"] - g.get("chunk_cumsum", 0.0)  # noqa: E731
        row = dict(shape=shape, peer=impl, ours_kernels=ours["kernels"],
                   x_stages23=after(peer) / after(ours),
                   outputs_share=peer.get("outputs", 0.0) / peer["sum_ms"])
        for w in ("states", "outputs"):
            row[f"x_{w}"] = peer[w] / ours[w] if w in ours and w in peer else None
        rows.append(row)
    return Table(rows, ["shape", "peer", "ours_kernels", "x_stages23", "x_states", "x_outputs",
                        "outputs_share"],
                 {k: ".2f" for k in ("x_stages23", "x_states", "x_outputs", "outputs_share")})


def fastest_chunks(payload, impl) -> dict:
    """shape -> the chunk size ``impl`` is counted at (its fastest, graph replay, L2 flushed)."""
    return {s: r["chunk_size"] for (s, _), r in best(payload["records"], impl).items()}


def chunk_summary(chunks: dict) -> str:
    """'64 on all 5 shapes' or '256 on 4 shapes, 128 on small-state' from :func:`fastest_chunks`."""
    by = {}
    for shape, q in chunks.items():
        by.setdefault(q, []).append(shape)
    if len(by) == 1:
        return f"{next(iter(by))} on all {len(chunks)} shapes"
    parts = sorted(by.items(), key=lambda kv: -len(kv[1]))
    return ", ".join(f"{q} on " + (f"{len(s)} shapes" if len(s) > 2 else " and ".join(s))
                     for q, s in parts)


# ----------------------------------------------------------------------------- prose
# Sentences the chapter glues where what is true depends on the recording (a shape set without
# separate stage kernels, a replay that names no search): each says what the numbers show.


def span(values, fmt=".2f") -> str:
    """'1.25–1.32' for the range of ``values``, or one number where both ends print alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def split_sentence(ratios: Table) -> str:
    """Ours against mamba_ssm on the shapes where ours runs states and outputs apart."""
    split = [r for r in ratios if r["peer"] == "mamba_ssm" and r["x_states"] is not None]
    if not split:
        return ""
    outputs_lead = all(r["x_outputs"] > r["x_states"] for r in split)
    return (f"Where ours runs states and outputs as separate kernels "
            f"({' and '.join(r['shape'] for r in split)}), our states kernel runs at "
            f"{span([r['x_states'] for r in split])}× the speed of the two of mamba_ssm and our "
            f"chunk_scan at {span([r['x_outputs'] for r in split])}× their bmm and chunk_scan "
            "together" + (": most of the lead is in the outputs." if outputs_lead else "."))


def trip_sentence(floor: Table) -> str:
    """The entering states' round trip over the floor, where ours stores them."""
    trip = [r["states_us"] / r["floor_us"] for r in floor if r["states_us"]]
    if not trip:
        return ("On these shapes ours runs one kernel and stores no entering state; a forward "
                "that stored them would pay that round trip")
    return (f"Where ours runs separate kernels, that round trip alone takes {span(trip, '.1f')}× "
            "the floor")


def kernels_sentence(floor: Table) -> str:
    """Ours' mean fraction of the floor with states and outputs in one kernel and in two."""
    mean = {}
    for k in ("one kernel", "two kernels"):
        pct = [r["ssd_pct"] for r in floor if r["ours_kernels"] == k]
        if pct:
            mean[k] = sum(pct) / len(pct)
    if len(mean) < 2:
        return ""
    return (f"On average ours reaches {mean['one kernel']:.0f} % of the floor where states and "
            f"outputs run in one kernel and {mean['two kernels']:.0f} % where they run as "
            "separate kernels and pay the round trip of the entering states.")


def host_sentence(host: dict) -> str:
    """The eager times of the host-bound cases (:func:`host_bound`), per implementation."""
    return ", ".join(f"{LABELS[i]} {span([1e3 * v for v in t], '.0f')} µs"
                     for i, t in host.items()) or "none"


def search_sentences(tune: Table) -> tuple[str, str]:
    """(a sentence for the tuning section, a clause for the summary) on TileGym's search."""
    search = [v / 60 for v in tune.column("tilegym_search_s") if v is not None]
    if not search:
        return ("The replay recording does not name the duration of the searches it replays.",
                "TileGym tuned searches every new shape exhaustively")
    return (f"The searches replayed here took {span(search, '.1f')} minutes per shape, against "
            "seconds for the others.",
            f"TileGym tuned searched for {span(search, '.1f')} minutes per shape")
