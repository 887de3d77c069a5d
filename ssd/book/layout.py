"""Tables and figures of the layout chapter (``notebooks/09_layout_tiling.ipynb``).

Every function reads recordings that are already loaded, and times and compiles nothing:

* ``study``: the layout study, ``results/<gpu>/study.json`` (``python -m ssd.tools.bench --suite
  study``): per shape, the forward timed at what the API ships there and at one change of it at a
  time (:func:`ssd.tools.bench.config_space`), median of CUDA-graph replays with L2 flushed;
* ``resources``: ``results/compile/sm_90_resources.json`` (``python -m ssd.tools.aot
  --resources``, on a CPU): registers and stack a thread, shared memory a block and compile time
  of the stage-2 and ``chunk_scan`` kernels of every point of the study, compiled for sm_90;
* ``models`` (optional): the models run, for the copy bandwidth it measured.

Tables come back as :class:`ssd.book.tables.Table`, figures as matplotlib Figures made without
pyplot, so a notebook shows each once. The study's shapes are whatever the recording holds.
"""
from __future__ import annotations

from dataclasses import replace

from .. import config as cfgmod
from ..config import FusedScanConfig, SSDConfig, fused_scan_fills
from ..cost import ssd_costs
from ..tools import bench
from .tables import Table

# An sm_90 SM, for how many blocks of a compiled kernel fit on one: 64 K 32-bit registers, given
# out 8 a thread at a time, and 228 KiB of shared memory with 1 KiB reserved a block. The stage-2
# and chunk_scan kernels are warp-specialised, 256 threads a block (a producer and a consumer
# warpgroup, as Nsight Compute reads them; tests/test_aot.py checks the same arithmetic).
REGISTERS_PER_SM = 64 * 1024
REGISTER_GRANULE = 8
SHARED_PER_SM = 228 * 1024
SHARED_RESERVED = 1024
THREADS = 256

# The compiled kernels (their names in the resources): the stage-2 walk (fused, or the split
# scan), chunk_scan, and stages 2 and 3 as one kernel.
WALK, SCAN, ONE = "state_passing_kernel", "chunk_scan_kernel", "fused_scan_kernel"

# The names of the chapter's figures (MyST labels; the tables the rules rest on are figures too),
# for ssd/config.py's rules to point at.
FIGURES = ("fig-chunk-size", "fig-fused-stage2", "fig-state-slicing", "fig-occupancy",
           "fig-scan-tiles", "fig-one-kernel", "fig-default-vs-best")

# The rules of ssd.config, in the order default_config applies them: the constants each reads,
# what it decides, and where the evidence is: a figure of the chapter ("fig-*") or another
# chapter.
RULES = [
    ("StateConfig()", ("StateConfig",),
     "stage 2 fused, in transposed state slices, with an occupancy hint",
     "fig-fused-stage2, fig-state-slicing"),
    ("too few blocks", ("MIN_STAGE2_BLOCKS_PER_SM", "NARROW_STATE"),
     "narrower slices where the walk has too few blocks a SM", "fig-state-slicing"),
    ("one wave", ("ONE_WAVE_CHUNK", "ONE_WAVE_STATE"),
     "whole states where the default slices need a second wave", "fig-state-slicing"),
    ("groups of chunks", ("GROUPED_WALK", "GROUPED_MIN_CHUNKS"),
     "few long sequences walk in groups of chunks", "chapter 06"),
    ("small states", ("SMALL_STATE", "SMALL_STATE_SCAN", "SMALL_STATE_AT"),
     "chunk_scan tiles for small states", "chapter 10"),
    ("ScanConfig()", ("ScanConfig",),
     "chunk_scan at the other chunk sizes: row tiles of two heads", "chapter 10"),
    ("chunk 64 tiles", ("CHUNK64", "CHUNK64_SCAN"),
     "chunk_scan at chunk 64: whole-chunk tiles of one head, each loaded once",
     "fig-scan-tiles, fig-occupancy"),
    ("one kernel", ("FUSED_SCAN_CHUNK", "FUSED_SCAN_MAX_STATE", "FUSED_SCAN_MIN_FILL",
                    "FUSED_SCAN_MAX_WAVES"),
     "stages 2 and 3 in one kernel where its b x h blocks fill the GPU", "fig-one-kernel"),
]


# The fields a rule's dataclass defaults are quoted by.
DEFAULT_FIELDS = {"StateConfig": ("fused", "block_n", "transposed", "occupancy"),
                  "ScanConfig": ("block_h", "block_m", "whole_chunk", "occupancy")}


def _plain_ticks(axis, ticks):
    """Ticks at ``ticks`` (within the data's range), labelled as plain numbers on a log axis."""
    from matplotlib.ticker import FixedLocator, NullLocator, StrMethodFormatter

    lo, hi = axis.axes.get_xlim() if axis.axis_name == "x" else axis.axes.get_ylim()
    axis.set_major_locator(FixedLocator([t for t in ticks if lo <= t <= hi]))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_locator(NullLocator())


# ----------------------------------------------------------------------------- the study


def shapes(study) -> list:
    """The study's shapes, in the order it timed them."""
    return list(dict.fromkeys(r["shape"] for r in study["rows"]))


def dims_of(study) -> dict:
    """shape -> (b, l, h, p, n, g), from the study's rows."""
    return {r["shape"]: tuple(r["dims"]) for r in study["rows"]}


def sm_count(study) -> int:
    return int(study["environment"]["sm_count"])


def config_of(row) -> SSDConfig:
    return SSDConfig.from_dict(row["config"])


def environment_line(study) -> str:
    """Where and with what the study was recorded, on two lines."""
    env = study["environment"]
    first = (f"{env.get('gpu')} ({env.get('sm_count')} SMs, driver {env.get('driver')}), "
             f"recorded {str(env.get('date', ''))[:10]} at git {env.get('git_revision')}")
    second = ", ".join(f"{k} {env[k]}" for k in ("cuda_tile", "tileiras", "torch", "python")
                       if env.get(k))
    return f"{first}\n{second}"


def ratios(study) -> dict:
    """(shape, label) -> the forward's time over its reference's (:func:`ssd.tools.bench.
    study_ratios`: the default, or for a stage factor on a one-kernel shape its three stages)."""
    return {(s, label): ratio for s, points in bench.study_ratios(study["rows"]).items()
            for _, label, ratio, _ in points}


def ratio_to_reference(study, row) -> float:
    """Point ``row``'s forward time over its reference's
    (:func:`ssd.tools.bench.study_reference`)."""
    return row["median_ms"] / bench.study_reference(study["rows"], row)["median_ms"]


def to_default(study) -> list:
    """Every point but the defaults: its forward time over its shape's default's."""
    t0 = {s: default_row(study, s)["median_ms"] for s in shapes(study)}
    return [r["median_ms"] / t0[r["shape"]] for r in study["rows"] if r["factor"] != "default"]


def default_row(study, shape) -> dict:
    return next(r for r in study["rows"] if r["shape"] == shape and r["factor"] == "default")


def study_table(study) -> Table:
    """One row a shape: its sizes, the points timed, and what the API ships there."""
    rows = []
    for s, d in dims_of(study).items():
        mine = [r for r in study["rows"] if r["shape"] == s]
        dflt = default_row(study, s)
        rows.append(dict(shape=s, **dict(zip("blhpng", d)), points=len(mine),
                         default=dflt["label"], ms=dflt["median_ms"]))
    return Table(rows, ["shape", *"blhpng", "points", "ms", "default"], {"ms": ".3f"})


# ----------------------------------------------------------------------------- compiled resources


def resource_index(resources) -> dict:
    """(study label, kernel name) -> the compiled kernel's row (registers, stack_bytes,
    shared_bytes, compile_s)."""
    return {(r["label"], r["kernel"]): r for r in resources["rows"]}


def blocks_per_sm(use) -> int:
    """How many blocks of a kernel compiled to ``use`` (a resources row) fit on one sm_90 SM:
    the fewer of what its registers and its shared memory allow."""
    regs = -(-use["registers"] // REGISTER_GRANULE) * REGISTER_GRANULE
    return min(REGISTERS_PER_SM // (regs * THREADS),
               SHARED_PER_SM // (use["shared_bytes"] + SHARED_RESERVED))


def _use(res, row, kernel):
    return res.get((row["label"], kernel))


# ----------------------------------------------------------------------------- the cost model


def path_bytes(dims, chunk_size, io_bytes=2) -> dict:
    """Compulsory bytes of the forward at ``chunk_size`` for three ways of running stages 2
    and 3, from :func:`ssd.cost.ssd_costs` (each kernel reads what it needs once): "split"
    (chunk_state writes every chunk's fp32 state, state_passing reads them back and writes the
    entering states), "fused" (one walk writes the entering states; chunk_scan reads them) and
    "one kernel" (the walk writes the outputs; no state reaches memory but the final one).
    Entering states are in the inputs' dtype (``io_bytes``), as the default stores them. Also
    the two intermediates that separate the paths: "chunk states" (the fp32 round trip split
    adds) and "entering states" (the round trip the one kernel drops)."""
    b, l, h, p, n, g = dims
    cs = ssd_costs(dims, chunk_size, dtype_bytes=io_bytes, state_bytes=4)
    c = -(-l // chunk_size)
    states = b * c * h * p * n  # one (p, n) state a (batch, chunk, head)
    final = b * h * p * n * 4
    entering = states * io_bytes
    stage1 = cs["chunk_cumsum"]["bytes"]
    walk_in = cs["chunk_state"]["bytes_read"]  # x, B, dt_out, dA_cumsum
    scan_in = cs["chunk_scan"]["bytes_read"] - states * 4  # x, B, C, dt_out, dA_cumsum
    y = cs["chunk_scan"]["bytes_written"]
    fused = stage1 + walk_in + entering + final + scan_in + entering + y
    split = (stage1 + cs["chunk_state"]["bytes"] + cs["state_passing"]["bytes_read"]
             + entering + final + scan_in + entering + y)
    one = stage1 + scan_in + y + final
    return {"split": split, "fused": fused, "one kernel": one,
            "chunk states": 2 * states * 4, "entering states": 2 * entering,
            "scan flops": cs["chunk_scan"]["flops"]}


def _three_stage_row(study, shape, q=bench.OUR_CHUNK, **state):
    """The row at ``q`` that runs the shape's three-stage configuration with a fused or split
    stage 2 (``state``: StateConfig fields that must match), or None."""
    base = config_of(bench.study_base(study["rows"], shape))
    if base.fused_scan.enabled:
        return None
    want = replace(base.state, **state)
    return next((r for r in study["rows"] if r["shape"] == shape and r["chunk_size"] == q
                 and not config_of(r).fused_scan.enabled and config_of(r).state == want
                 and config_of(r).scan == base.scan), None)


def _one_kernel_row(study, shape, q=bench.OUR_CHUNK):
    """The row at ``q`` that runs stages 2 and 3 as the default's one kernel, or None."""
    return next((r for r in study["rows"] if r["shape"] == shape and r["chunk_size"] == q
                 and config_of(r).fused_scan == replace(FusedScanConfig(), enabled=True)), None)


def traffic_table(study, bandwidth=None) -> Table:
    """Per shape at the study's chunk size: MB each way of running stages 2 and 3 moves
    (:func:`path_bytes`), the time those bytes take at ``bandwidth`` (bytes/s; the models
    run's copy bandwidth) and the forward's measured time on each path where the study has it."""
    q, rows = bench.OUR_CHUNK, []
    for s, d in dims_of(study).items():
        mb = path_bytes(d, q)
        measured = {"split": _three_stage_row(study, s, fused=False, groups=1),
                    "fused": _three_stage_row(study, s), "one kernel": _one_kernel_row(study, s)}
        row = dict(shape=s)
        for path in ("split", "fused", "one kernel"):
            row[f"{path} MB"] = mb[path] / 1e6
            row[f"{path} floor ms"] = 1e3 * mb[path] / bandwidth if bandwidth else None
            row[f"{path} ms"] = measured[path]["median_ms"] if measured[path] else None
        rows.append(row)
    cols = ["shape"] + [f"{p} {k}" for p in ("split", "fused", "one kernel")
                        for k in ("MB", "floor ms", "ms")]
    if not bandwidth:
        cols = [c for c in cols if not c.endswith("floor ms")]
    fmt = {c: (".0f" if c.endswith("MB") else ".3f") for c in cols[1:]}
    return Table(rows, cols, fmt)


# ----------------------------------------------------------------------------- chunk size


def chunk_size_table(study) -> Table:
    """Per shape and chunk size (what the API ships at each): chunks, the entering states' MB
    (bf16, the three-stage path), chunk_scan's modelled GFLOP, the forward's time and its ratio
    to the default's."""
    rows = []
    for s, d in dims_of(study).items():
        dflt = default_row(study, s)
        for r in sorted((r for r in study["rows"] if r["shape"] == s
                         and r["factor"] in ("default", "chunk size")),
                        key=lambda r: r["chunk_size"]):
            q = r["chunk_size"]
            mb = path_bytes(d, q)
            rows.append(dict(shape=s, q=q, chunks=-(-d[1] // q),
                             states_mb=mb["entering states"] / 2e6,
                             scan_gflop=mb["scan flops"] / 1e9,
                             one_kernel="yes" if config_of(r).fused_scan.enabled else "no",
                             ms=r["median_ms"], ratio=r["median_ms"] / dflt["median_ms"]))
    return Table(rows, ["shape", "q", "chunks", "states_mb", "scan_gflop", "one_kernel", "ms",
                        "ratio"], {"states_mb": ".0f", "scan_gflop": ".1f", "ms": ".3f",
                                   "ratio": ".3f"})


def plot_chunk_size(study):
    """Left: the model against the chunk size (entering states, chunk_scan arithmetic and the
    walk's steps, each over its value at the smallest chunk size, for each (p, n) of the
    study). Right: each shape's forward time over its time at the default chunk size."""
    from matplotlib.figure import Figure

    table = chunk_size_table(study)
    qs = sorted(set(table.column("q")))
    fig = Figure(figsize=(8.4, 3.2), dpi=90)
    ax0, ax1 = fig.subplots(1, 2)
    for p, n in dict.fromkeys((d[3], d[4]) for d in dims_of(study).values()):
        models = [path_bytes((1, 1 << 14, 1, p, n, 1), q) for q in qs]
        ax0.plot(qs, [m["scan flops"] / models[0]["scan flops"] for m in models], "s-",
                 label=f"chunk_scan FLOPs (p={p}, n={n})")
    ax0.plot(qs, [qs[0] / q for q in qs], "o-", color="grey",
             label="entering states, walk steps (1/q)")
    ax0.set(xscale="log", xticks=qs, xticklabels=qs, xlabel="chunk size q",
            ylabel=f"model / its value at q={qs[0]}", title="what the chunk size trades")
    ax0.minorticks_off()
    ax0.legend(fontsize=7)
    for s in shapes(study):
        mine = table.where(shape=s)
        ax1.plot([r["q"] for r in mine], [r["ratio"] for r in mine], "o-", label=s)
    ax1.axhline(1, color="grey", lw=0.8)
    ax1.set(xscale="log", xticks=qs, xticklabels=qs, xlabel="chunk size q",
            ylabel="forward time / default's", title="measured (what ships at each q)")
    ax1.minorticks_off()
    ax1.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- stage 2


def stage2_blocks(dims, state) -> int:
    """The fused walk's grid, b x h x state slices (x chunk groups)."""
    b, l, h, p, n, g = dims
    return b * h * state.slices(p, n)[2] * state.groups


def split_table(study, resources, bandwidth=None) -> Table:
    """Per shape: fused against split stage 2 at the study's chunk size. Blocks of the fused
    walk and of the split chunk_state (one block a chunk too), the extra MB of split's fp32
    per-chunk states, the time those bytes take at ``bandwidth``, the measured extra time, and
    the split state_passing's compiled registers and spill."""
    res, q, rows = resource_index(resources), bench.OUR_CHUNK, []
    for s, d in dims_of(study).items():
        fused, split = _three_stage_row(study, s), _three_stage_row(study, s, fused=False, groups=1)
        if not (fused and split):
            continue
        st = config_of(fused).state
        extra = path_bytes(d, q)["chunk states"]
        scan_pass = _use(res, split, WALK) or {}
        rows.append(dict(shape=s, walk_blocks=stage2_blocks(d, st),
                         split_blocks=stage2_blocks(d, st) * -(-d[1] // q),
                         extra_mb=extra / 1e6,
                         bytes_ms=1e3 * extra / bandwidth if bandwidth else None,
                         extra_ms=split["median_ms"] - fused["median_ms"],
                         ratio=split["median_ms"] / fused["median_ms"],
                         pass_regs=scan_pass.get("registers"),
                         pass_spill=scan_pass.get("stack_bytes")))
    cols = ["shape", "walk_blocks", "split_blocks", "extra_mb", "bytes_ms", "extra_ms", "ratio",
            "pass_regs", "pass_spill"]
    if not bandwidth:
        cols.remove("bytes_ms")
    return Table(rows, cols, {"extra_mb": ".0f", "bytes_ms": ".3f", "extra_ms": ".3f",
                              "ratio": ".2f"})


STAGE2_FACTORS = ("state block_n", "state occupancy", "state narrow")


def stage2_table(study, resources) -> Table:
    """Every fused stage-2 point around each shape's three stages (its slice width, its
    occupancy hint, the narrow slices): blocks of the walk, blocks of the compiled walk that fit
    a SM, waves (blocks over SMs x that), registers, spill, and the forward's time over its
    reference's."""
    res, sms, rows = resource_index(resources), sm_count(study), []
    dims = dims_of(study)
    for s in shapes(study):
        base = bench.study_base(study["rows"], s)
        if config_of(base).fused_scan.enabled:
            continue
        for r in [base] + [r for r in study["rows"]
                           if r["shape"] == s and r["factor"] in STAGE2_FACTORS]:
            st, use = config_of(r).state, _use(res, r, WALK)
            blocks = stage2_blocks(dims[s], st)
            fit = blocks_per_sm(use) if use else None
            rows.append(dict(shape=s, factor="base" if r is base else r["factor"],
                             block_n=st.slices(dims[s][3], dims[s][4])[0],
                             occupancy=st.occupancy, blocks=blocks, fit=fit,
                             waves=blocks / (fit * sms) if fit else None,
                             regs=use and use["registers"], spill=use and use["stack_bytes"],
                             ratio=1.0 if r is base else ratio_to_reference(study, r)))
    return Table(rows, ["shape", "factor", "block_n", "occupancy", "blocks", "fit", "waves",
                        "regs", "spill", "ratio"], {"waves": ".2f", "ratio": ".3f"})


def plot_stage2_waves(study, resources):
    """The fused walk's waves (blocks over the resident blocks its compiled kernel allows)
    against the forward's time over the shape's three-stage base: slice widths and occupancy
    hints, one colour a shape."""
    from matplotlib.figure import Figure

    table = stage2_table(study, resources)
    fig = Figure(figsize=(7.2, 3.6), dpi=90)
    ax = fig.subplots()
    marks = {"base": "*", "state block_n": "o", "state occupancy": "^", "state narrow": "s"}
    for i, s in enumerate(shapes(study)):
        color, tags = f"C{i}", {}
        for r in table.where(shape=s):
            if r["waves"] is None:
                continue
            ax.plot(r["waves"], r["ratio"], marks[r["factor"]], color=color,
                    ms=12 if r["factor"] == "base" else 6,
                    mfc="none" if r["spill"] else color)
            tag = {"state block_n": f"n{r['block_n']}", "state occupancy":
                   f"o{r['occupancy'] or '-'}", "state narrow": "narrow", "base": ""}[r["factor"]]
            tags.setdefault((round(r["waves"], 2), round(r["ratio"], 2)), []).append(tag)
        for (x, y), names in tags.items():
            ax.annotate(",".join(t for t in names if t), (x, y), fontsize=7, xytext=(4, 2),
                        textcoords="offset points", color=color)
        ax.plot([], [], "o", color=color, label=s)
    for name, m in marks.items():
        ax.plot([], [], m, color="grey", label={"base": "shipped", "state block_n": "slice width",
                                               "state occupancy": "occupancy hint",
                                               "state narrow": "narrow slices"}[name])
    ax.axvline(1, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="waves of the stage-2 walk (blocks / (SMs x blocks that fit a SM))",
           ylabel="forward time / shipped three stages", xscale="log")
    _plain_ticks(ax.xaxis, [0.25, 0.5, 1, 2, 4, 8])
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- chunk_scan


def _changed(base, cfg) -> str:
    """The fields of ``cfg`` (a stage's config) that differ from ``base``'s, 'f=v, ...'."""
    diff = [f"{k}={v}" for k, v in vars(cfg).items() if vars(base)[k] != v]
    return ", ".join(diff) or "(shipped)"


def _points_by_change(study, factors, stage, kernel, resources):
    """(change, rows by shape) for the points of ``factors`` around each shape's base, keyed
    by what they change in ``stage`` ("scan" or "fused_scan")."""
    res, out = resource_index(resources), {}
    for s in shapes(study):
        base = (default_row(study, s) if stage == "fused_scan"
                else bench.study_base(study["rows"], s))
        if stage == "fused_scan" and not config_of(base).fused_scan.enabled:
            continue
        b = getattr(config_of(base), stage)
        for r in [base] + [r for r in study["rows"] if r["shape"] == s and r["factor"] in factors]:
            key = _changed(b, getattr(config_of(r), stage))
            out.setdefault(key, {})[s] = (r, 1.0 if r is base else ratio_to_reference(study, r),
                                          _use(res, r, kernel))
    return out


def _resource_rows(study, points, extra=None) -> list:
    rows = []
    for change, by_shape in points.items():
        use = next((u for _, _, u in by_shape.values() if u), None) or {}
        row = dict(change=change, regs=use.get("registers"), spill=use.get("stack_bytes"),
                   shared_KiB=use["shared_bytes"] / 1024 if use else None,
                   fit=blocks_per_sm(use) if use else None, compile_s=use.get("compile_s"))
        row.update(extra or {})
        row.update({s: by_shape[s][1] if s in by_shape else None for s in shapes(study)})
        row["ratios"] = [by_shape[s][1] for s in shapes(study) if s in by_shape]
        rows.append(row)
    return rows


def scan_tiles_table(study, resources) -> Table:
    """chunk_scan's tile points around each shape's three stages: what each changes in
    ScanConfig, the compiled kernel (registers, spill, shared KiB, blocks that fit a SM,
    compile seconds on a CPU) and the forward's time over the reference's, a column a shape."""
    points = _points_by_change(study, ("scan tile", "scan block_h", "scan whole chunk",
                                       "scan loads"), "scan", SCAN, resources)
    cols = ["change", "regs", "spill", "shared_KiB", "fit", "compile_s", *shapes(study)]
    return Table(_resource_rows(study, points), cols,
                 {"shared_KiB": ".0f", "compile_s": ".1f", **{s: ".3f" for s in shapes(study)}})


def occupancy_table(study, resources) -> Table:
    """The occupancy hint of chunk_scan and of the one kernel: registers, spill, shared KiB,
    blocks that fit a SM and compile seconds of the compiled kernel, and the forward's time over
    the reference's (a column a shape; the one kernel's only where the shape ships it)."""
    rows = []
    for kernel, stage, factor, name in ((SCAN, "scan", "scan occupancy", "chunk_scan"),
                                        (ONE, "fused_scan", "one kernel occupancy", "one kernel")):
        points = _points_by_change(study, (factor,), stage, kernel, resources)
        for row, by_shape in zip(_resource_rows(study, points, dict(kernel=name)),
                                 points.values()):
            r = next(iter(by_shape.values()))[0]
            hint = getattr(config_of(r), stage).occupancy or "none"
            row["hint"] = f"{hint} (shipped)" if row.pop("change") == "(shipped)" else hint
            rows.append(row)
    cols = ["kernel", "hint", "regs", "spill", "shared_KiB", "fit", "compile_s", *shapes(study)]
    return Table(rows, cols, {"shared_KiB": ".0f", "compile_s": ".1f",
                              **{s: ".3f" for s in shapes(study)}})


# ----------------------------------------------------------------------------- one kernel or three


def one_kernel_fill(dims, sms, fused_scan=None) -> dict:
    """The one kernel's grid on ``sms`` SMs: blocks (b x h x channel blocks), resident slots (the
    occupancy hint's blocks a SM), waves, the share of its waves' slots it fills, and whether
    the rule (:func:`ssd.config.fused_scan_fills`) takes it at the rule's chunk size."""
    fs = fused_scan or FusedScanConfig()
    b, l, h, p, n, g = dims
    blocks = b * h * -(-p // fs.block_p)
    slots = (fs.occupancy or 1) * sms
    waves = -(-blocks // slots)
    return dict(blocks=blocks, slots=slots, waves=waves, load=blocks / slots,
                fill=blocks / (waves * slots), takes=fused_scan_fills(fs, (b, h, p, n), sms))


def one_kernel_table(study, shapes_dims=None) -> Table:
    """The one kernel's fill on every shape of ``shapes_dims`` (name -> dims; default the
    models suite and the study's shapes) at the study GPU's SM count, with the measured time of
    the one kernel over the three stages where the study timed both."""
    sms = sm_count(study)
    shapes_dims = shapes_dims or {**{s.name: s.dims for s in bench.SUITES["models"]},
                                  **dims_of(study)}
    rows = []
    for name, d in shapes_dims.items():
        f = one_kernel_fill(d, sms)
        one = _one_kernel_row(study, name) if name in dims_of(study) else None
        three = None
        if one:
            base = bench.study_base(study["rows"], name)
            three = base if not config_of(base).fused_scan.enabled else None
        rows.append(dict(shape=name, **f, studied="yes" if name in dims_of(study) else "no",
                         one_over_three=one["median_ms"] / three["median_ms"]
                         if one and three and one is not three else None))
    return Table(rows, ["shape", "blocks", "slots", "load", "waves", "fill", "takes", "studied",
                        "one_over_three"], {"load": ".2f", "fill": ".2f", "one_over_three": ".3f"})


def plot_one_kernel_fill(study, shapes_dims=None):
    """The share of its waves' resident slots the one kernel's grid fills, against its blocks
    over the slots of one wave; the region the rule takes shaded, each shape placed and
    labelled with the measured one kernel / three stages where the study has both."""
    import numpy as np
    from matplotlib.figure import Figure

    table = one_kernel_table(study, shapes_dims)
    fig = Figure(figsize=(7.2, 3.4), dpi=90)
    ax = fig.subplots()
    top = cfgmod.FUSED_SCAN_MAX_WAVES + 0.6
    x = np.linspace(0.02, top, 600)
    ax.plot(x, x / np.ceil(x), color="grey", lw=1, label="fill = blocks / (waves x slots)")
    ax.fill_between(x, cfgmod.FUSED_SCAN_MIN_FILL, 1.02,
                    where=x <= cfgmod.FUSED_SCAN_MAX_WAVES, color="C2", alpha=0.15,
                    label=f"rule: fill >= {cfgmod.FUSED_SCAN_MIN_FILL:.2f}, "
                          f"<= {cfgmod.FUSED_SCAN_MAX_WAVES} waves")
    for r in table.rows:
        ax.plot(r["load"], r["fill"], "o", color="C2" if r["takes"] else "C3")
        tag = r["shape"] + (f"\none/three {r['one_over_three']:.2f}" if r["one_over_three"] else "")
        ax.annotate(tag, (r["load"], r["fill"]), fontsize=7, xytext=(4, -10),
                    textcoords="offset points")
    ax.plot([], [], "o", color="C2", label="one kernel")
    ax.plot([], [], "o", color="C3", label="three stages")
    ax.set(xlabel="one-kernel blocks / resident slots of one wave", ylabel="fill of its waves",
           ylim=(0, 1.08), xlim=(0, top))
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the default rule


def rules_table() -> Table:
    """The rules of :func:`ssd.config.default_config`, each with the constants it reads (their
    values quoted from ssd.config), what it decides and the chapter's evidence."""
    rows = []
    for name, consts, decides, evidence in RULES:
        values = []
        for c in consts:
            v = getattr(cfgmod, c)
            if isinstance(v, type):  # a dataclass: the defaults the rule names
                v = ", ".join(f"{k}={getattr(v(), k)}" for k in DEFAULT_FIELDS[c])
            elif isinstance(v, dict):
                v = _fields(v)
            elif isinstance(v, float):
                v = f"{v:.3g}"
            values.append(f"{c} = {v}")
        rows.append(dict(rule=name, constants="; ".join(values), decides=decides,
                         evidence=evidence))
    return Table(rows, ["rule", "decides", "constants", "evidence"])


def _fields(d) -> str:
    """A rule's dict as 'k=v, ...'; a dict of dicts (keyed by chunk size) as 'q: k=v; ...'."""
    if all(isinstance(v, dict) for v in d.values()):
        return "; ".join(f"{k}: {_fields(v)}" for k, v in d.items())
    return ", ".join(f"{k}={v}" for k, v in d.items())


def shipped_table(study, shapes_dims=None) -> Table:
    """What :func:`ssd.tools.bench.shape_default` (the API's default) picks at the study's chunk
    size on the study's GPU for every shape of ``shapes_dims`` (default: the models suite and
    the study's shapes), and which rules it took."""
    sms = sm_count(study)
    shapes_dims = shapes_dims or {**{s.name: s.dims for s in bench.SUITES["models"]},
                                  **dims_of(study)}
    base = cfgmod.default_config((9, 0))
    rows = []
    for name, d in shapes_dims.items():
        cfg = bench.shape_default(d, sms)
        taken = []
        if cfg.state == replace(base.state, **cfgmod.NARROW_STATE):
            taken.append("too few blocks")
        if cfg.state.groups > 1:
            taken.append("groups of chunks")
        elif cfg.state == replace(base.state, **cfgmod.ONE_WAVE_STATE):
            taken.append("one wave")
        if cfg.scan.shared and d[4] <= cfgmod.SMALL_STATE:
            taken.append("small states")
        elif cfg.scan == replace(base.scan, **cfgmod.CHUNK64_SCAN):
            taken.append("chunk 64 tiles")
        if cfg.fused_scan.enabled:
            taken.append("one kernel")
        rows.append(dict(shape=name, walk_blocks=stage2_blocks(d, cfg.state),
                         rules=", ".join(taken) or "none",
                         shipped=bench.config_label(bench.OUR_CHUNK, cfg)))
    return Table(rows, ["shape", "walk_blocks", "rules", "shipped"])


def default_vs_best(study) -> Table:
    """Per shape: the default's time, the fastest point's, which it was, and how much longer
    the default took (%)."""
    rows = []
    for s in shapes(study):
        dflt = default_row(study, s)
        best = min((r for r in study["rows"] if r["shape"] == s), key=lambda r: r["median_ms"])
        band = (dflt["q80_ms"] - dflt["q20_ms"]) / dflt["median_ms"]
        rows.append(dict(shape=s, default_ms=dflt["median_ms"], best_ms=best["median_ms"],
                         gap_pct=100 * (dflt["median_ms"] / best["median_ms"] - 1),
                         band_pct=100 * band, best_factor=best["factor"], best=best["label"]))
    return Table(rows, ["shape", "default_ms", "best_ms", "gap_pct", "band_pct", "best_factor",
                        "best"], {"default_ms": ".3f", "best_ms": ".3f", "gap_pct": ".1f",
                                  "band_pct": ".1f"})


FACTOR_GROUPS = (("chunk size", ("chunk size",)), ("one kernel", ("one kernel",)),
                 ("stage 2", ("stage 2", "state")), ("chunk_scan", ("scan",)))


def _group(factor) -> str:
    return next((name for name, prefixes in FACTOR_GROUPS
                 if factor.startswith(prefixes) and not factor.endswith("hints")), "hints")


def plot_default_vs_best(study):
    """Every point of the study, its forward time over the shape's default (log scale, one row
    a shape), coloured by what it changes; the default at 1."""
    from matplotlib.figure import Figure

    names = shapes(study)
    fig = Figure(figsize=(7.6, 0.9 + 0.75 * len(names)), dpi=90)
    ax = fig.subplots()
    groups = [g for g, _ in FACTOR_GROUPS] + ["hints"]
    for i, s in enumerate(names):
        t0 = default_row(study, s)["median_ms"]
        for r in study["rows"]:
            if r["shape"] != s or r["factor"] == "default":
                continue
            k = groups.index(_group(r["factor"]))
            ax.plot(r["median_ms"] / t0, i + (k - 2) * 0.08, "o", color=f"C{k}", ms=4, alpha=0.8)
    for k, g in enumerate(groups):
        ax.plot([], [], "o", color=f"C{k}", label=g)
    ax.axvline(1, color="black", lw=1)
    ax.set(yticks=range(len(names)), yticklabels=names, xscale="log",
           xlabel="forward time / the shipped default's (1 = default; left of it: faster)",
           ylim=(-0.6, len(names) - 0.4))
    _plain_ticks(ax.xaxis, [0.9, 1, 1.25, 1.5, 2, 3, 4])
    ax.legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.22))
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- prose helpers


def span(values, fmt=".2f") -> str:
    """'a' or 'a–b' (min and max of ``values``, formatted), for a range in prose."""
    values = [v for v in values if v is not None]
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else \
        f"{format(lo, fmt)}–{format(hi, fmt)}"


def join(items) -> str:
    """'a', 'a and b', 'a, b and c'."""
    items = list(items)
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)


def verdict(ratios, band=0.0) -> str:
    """How points of time ratio ``ratios`` (to a reference) compare: 'faster on every shape',
    'slower on every shape' or 'faster on some shapes and slower on others'; a ratio within
    ``band`` of 1 counts as 'level'."""
    kinds = {"faster" if r < 1 - band else "slower" if r > 1 + band else "level"
             for r in ratios if r is not None}
    if len(kinds) == 1:
        return f"{kinds.pop()} on every shape"
    return "faster on some shapes and slower on others" if kinds >= {"faster", "slower"} else \
        f"{(kinds - {'level'}).pop()} or level"


def by_value(mapping) -> str:
    """{shape: value} as 'v on every shape' or 'v1 on a and b, v2 on c'."""
    groups = {}
    for key, value in mapping.items():
        groups.setdefault(value, []).append(key)
    if len(groups) == 1:
        return f"{next(iter(groups))} on every shape"
    return ", ".join(f"{v} on {join(keys)}" for v, keys in groups.items())
