"""The serving chapter (notebooks/14_serving): packed prefill, per-sequence states, the decode
step, the generation benchmark and speed on every shape.

Two kinds of function:

* **On the CPU, float64** (nothing recorded): :func:`packed_prefill_check` (one packed call
  gives each sequence its own outputs and final state) and :func:`prefill_decode_check` (the
  chunked prefill and then the recurrent step give what the forward gives one token longer),
  :func:`decode_cost_table` (what one decode step moves and computes).
* **From the recordings** (``ssd.book.recordings.load_recorded``), each a
  :class:`ssd.book.tables.Table` or a matplotlib ``Figure``:

  - ``decode``: ``python -m ssd.tools.decode_bench``, the decode step, ours and mamba_ssm's, per
    head shape, batch and state dtype: :func:`decode_table`, :func:`decode_goals`,
    :func:`plot_decode`;
  - ``robust``: ``python -m ssd.tools.bench --suite robust``, shapes drawn from published
    Mamba-2 layers, packed or not: :func:`robust_table`, :func:`robust_goals`,
    :func:`packed_table`, :func:`plot_robust`;
  - ``serving_scenario``: ``python -m ssd.tools.serving``, a packed prefill of many prompts,
    then a decode loop, per SSD backend: :func:`scenario_line`, :func:`scenario_table`,
    :func:`scenario_amdahl`, :func:`plot_scenario`.
  - ``host_profile``: ``python -m ssd.tools.host_profile``, where an eager forward's host time
    goes on one 512-token prompt: :func:`host_table`, :func:`host_goal`.

Speedups are ratios within one recording (peers timed in the same process on the same inputs),
computed by the tools' own functions (``ssd.tools.bench.speedup_summary``,
``ssd.tools.decode_bench.speedups``, ``ssd.tools.serving.amdahl_of``).
"""
from __future__ import annotations

import math

import numpy as np

from .. import reference as R
from ..problem import ProblemSpec
from ..tools import bench, decode_bench
from ..tools.endtoend import BASE, NEW
from .tables import Table, pct

__all__ = [
    "DECODE_GOALS", "LABEL", "packed_prefill_check", "prefill_decode_check",
    "decode_cost_table", "decode_table", "decode_goals", "plot_decode", "robust_table",
    "robust_goals", "packed_table", "plot_robust", "scenario_line", "scenario_table",
    "scenario_amdahl", "plot_scenario", "HOST_GOAL_US", "host_table", "host_goal",
]

#: The decode step's goals: faster than mamba_ssm's at every batch and head shape timed, and at
#: least this fraction of the measured copy bandwidth on its state traffic from this batch up.
DECODE_GOALS = dict(speedup=1.0, copy_fraction=0.8, copy_from_batch=64)
#: An eager forward's host overhead (eager minus graph time) on one 512-token prompt, at most.
HOST_GOAL_US = 50.0
#: What each phase of a call's host path does (``ssd.tools.host_profile``).
HOST_PHASES = {
    "checks": "the arguments' checks (ssd.api.validate)",
    "config": "the configuration for the problem and GPU",
    "stages": "the launchers: allocations, argument lists, parameter order",
    "launch_key": "the key of each launch that has a quick first build",
    "key": "the signature's key, to find its plan",
    "prepare": "the inputs as the kernels take them",
    "allocate": "fresh outputs and intermediates",
    "arguments": "each launch's argument tuple",
    "launch": "the launches, through ssd.launch",
    "cutile": "cuda.tile.launch alone for the same launches: the floor",
    "call": "the whole call",
}
#: How the chapter names the implementations and SSD backends, and their colours.
LABEL = {"ssd": "ours", "mamba_ssm": "mamba_ssm", NEW: "ours (cuTile)",
         BASE: "mamba_ssm (Triton)", "torch": "PyTorch"}
COLOR = {"ssd": "C0", NEW: "C0", "mamba_ssm": "C1"}


def times(v) -> str:
    return f"{v:.2f}×"


def _rel(actual, expected) -> float:
    norm = np.linalg.norm(expected)
    return float(np.linalg.norm(np.asarray(actual) - expected) / (norm if norm > 0 else 1.0))


# ----------------------------------------------------------------------------- on the CPU


def _serving_spec(seqlen, heads, chunk_size, boundaries=()) -> ProblemSpec:
    h, p, n, g = heads
    return ProblemSpec(1, seqlen, h, p, n, g, chunk_size=chunk_size, D="h", dt_bias=True,
                       dt_softplus=True, seq_boundaries=tuple(boundaries), name="serving")


def packed_prefill_check(lengths=(5, 16, 1, 40, 7), chunk_size=16, heads=(4, 8, 8, 2),
                         seed=0) -> Table:
    """Pack sequences of ``lengths`` along one row, run the chunked forward once with
    ``cu_seqlens`` and ``return_varlen_states`` (float64, ``ssd.reference.ssd_chunked``), and
    compare each sequence's outputs and final state with that sequence run alone through the
    recurrence.

    Args:
        lengths: tokens of each packed sequence.
        chunk_size: q.
        heads: (h, p, n, g).
    Returns:
        one row per sequence: its tokens, where it starts, the chunks it touches, whether it
        crosses a chunk border, and the relative errors of its y and final state.
    """
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    spec = _serving_spec(int(cu[-1]), heads, chunk_size, cu[1:-1])
    inputs = spec.make_inputs(seed)
    y, varlen = R.ssd_chunked(**inputs, **spec.options, cu_seqlens=cu,
                              return_varlen_states=True)  # (1, l, h, p), (S, h, p, n)
    alone_keys = ("x", "dt", "B", "C")
    rows = []
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        part = {k: v for k, v in inputs.items() if k != "seq_idx"}
        part.update({k: inputs[k][:, start:end] for k in alone_keys})
        y_alone, final = R.ssd_recurrence(**part, dt_softplus=True, return_final_states=True)
        first, last = start // chunk_size, (end - 1) // chunk_size
        rows.append(dict(sequence=i, tokens=int(end - start), start=int(start),
                         chunks=f"{first}" if first == last else f"{first}–{last}",
                         borders=int(last - first), y_err=_rel(y[:, start:end], y_alone),
                         state_err=_rel(varlen[i], final[0])))
    return Table(rows, dict(sequence="sequence", tokens="tokens", start="starts at",
                            chunks="chunks", borders="borders crossed", y_err="y rel. error",
                            state_err="final state rel. error"),
                 dict(y_err=".1e", state_err=".1e"))


def prefill_decode_check(seqlen=48, prefill=30, chunk_size=16, heads=(4, 8, 8, 2),
                         seed=0) -> Table:
    """The two sides of the duality on one sequence (float64): the chunked forward over the
    first ``prefill`` tokens hands its final state to the decode step
    (``ssd.reference.selective_state_update``, mamba_ssm's semantics), which then takes the
    remaining tokens one at a time. Each side's outputs are compared with the chunked forward
    over the whole sequence, and the state after the last step with its final state.

    Returns:
        three rows: the prefill's outputs, the decode steps' outputs, the final state; each with
        the positions it covers, how it was computed and its relative error.
    """
    spec = _serving_spec(seqlen, heads, chunk_size)
    inp = spec.make_inputs(seed)
    y_all, final_all = R.ssd_chunked(**inp, **spec.options, return_final_states=True)
    head = {k: (v[:, :prefill] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    y_pre, state = R.ssd_chunked(**head, **spec.options, return_final_states=True)
    steps = []
    for t in range(prefill, seqlen):  # one token a call: x (b, h, p), dt (b, h), B, C (b, g, n)
        y_t, state = R.selective_state_update(
            state, inp["x"][:, t], inp["dt"][:, t], inp["A"], inp["B"][:, t], inp["C"][:, t],
            D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True)
        steps.append(y_t)
    y_dec = np.stack(steps, axis=1)  # (b, l - prefill, h, p)
    chunks = -(-prefill // chunk_size)
    rows = [dict(part="prefill outputs", positions=f"0–{prefill - 1}",
                 how=f"chunked forward, {chunks} chunks of {chunk_size}",
                 err=_rel(y_pre, y_all[:, :prefill])),
            dict(part="decode outputs", positions=f"{prefill}–{seqlen - 1}",
                 how=f"{seqlen - prefill} decode steps from the prefill's state",
                 err=_rel(y_dec, y_all[:, prefill:])),
            dict(part="state after the last step", positions=f"{seqlen - 1}",
                 how="the last step's, (b, h, p, n) = (1, {}, {}, {})".format(*heads[:3]),
                 err=_rel(state, final_all))]
    return Table(rows, dict(part="what", positions="positions", how="computed by",
                            err="rel. error against the whole forward"), dict(err=".1e"))


def decode_cost_table(heads=None, batches=decode_bench.BATCHES, state_bytes=4,
                      io_bytes=2) -> Table:
    """What one decode step must move and compute, per head shape and batch: the state read
    and written once (``ssd.tools.decode_bench.state_traffic``), the other operands (x, dt, B,
    C in, y out, in ``io_bytes``), and the FLOPs (per state element a decay multiply, the write's
    multiply-add and the output's multiply-add: 5), hence FLOPs a byte.

    Args:
        heads: {name: (h, p, n, g)} (default ``ssd.tools.decode_bench.HEADS``).
        batches: batch sizes.
        state_bytes: bytes of a state element (4: fp32).
    """
    rows = []
    for name, (h, p, n, g) in (heads or decode_bench.HEADS).items():
        for b in batches:
            state = decode_bench.state_traffic((b, h, p, n, g), state_bytes)
            other = io_bytes * b * (2 * h * p + h + 2 * g * n)
            flops = 5 * b * h * p * n
            rows.append(dict(shape=name, batch=b, state_mb=state / 1e6,
                             state_share=state / (state + other), flops_per_byte=flops /
                             (state + other)))
    return Table(rows, dict(shape="heads", batch="batch", state_mb="state MB moved",
                            state_share="state share of bytes", flops_per_byte="FLOPs a byte"),
                 dict(state_mb=".2f", state_share=pct, flops_per_byte=".2f"))


# ----------------------------------------------------------------------------- decode step


def _decode_key(r):
    return (r["shape"], r["dims"][0], r["state_dtype"])


def decode_table(decode, state_dtype=None) -> Table:
    """One row per (head shape, batch, state dtype): ours and mamba_ssm's median time (µs),
    ours' speedup, and the bandwidth each reaches on the state traffic as a fraction of the
    copy bandwidth measured in the same run. ``state_dtype``: only those rows."""
    recs = [r for r in decode["records"] if state_dtype in (None, r["state_dtype"])]
    by = {(_decode_key(r), r["impl"]): r for r in recs}
    sp = decode_bench.speedups(recs)
    rows = []
    for key in dict.fromkeys(_decode_key(r) for r in recs):
        ours, theirs = by.get((key, "ssd")), by.get((key, "mamba_ssm"))
        rows.append(dict(shape=key[0], batch=key[1], state_dtype=key[2],
                         ours_us=ours and 1e3 * ours["median_ms"],
                         mamba_us=theirs and 1e3 * theirs["median_ms"], speedup=sp.get(key),
                         ours_copy=ours and ours["copy_fraction"],
                         mamba_copy=theirs and theirs["copy_fraction"]))
    return Table(rows, dict(shape="heads", batch="batch", state_dtype="state", ours_us="ours µs",
                            mamba_us="mamba_ssm µs", speedup="speedup",
                            ours_copy="ours, of copy", mamba_copy="mamba_ssm, of copy"),
                 dict(ours_us=".2f", mamba_us=".2f", speedup=times, ours_copy=pct,
                      mamba_copy=pct))


def decode_goals(decode, goals=DECODE_GOALS) -> Table:
    """The decode step's two goals, each with the worst case measured, where it was, whether
    it was met and the margin (measured over goal, minus one: negative where missed)."""
    table = decode_table(decode)
    timed = [r for r in table if r["speedup"] is not None]
    big = [r for r in table if r["batch"] >= goals["copy_from_batch"] and r["ours_copy"]]
    rows = []
    for goal, target, hits, key, fmt in (
            ("faster than mamba_ssm, every shape, batch and state dtype", goals["speedup"],
             timed, "speedup", times),
            (f"state traffic at ≥ {pct(goals['copy_fraction'])} of copy, batch ≥ "
             f"{goals['copy_from_batch']}", goals["copy_fraction"], big, "ours_copy", pct)):
        if not hits:
            rows.append(dict(goal=goal, target=fmt(target), worst=None, where="not recorded",
                             met=None, margin=None))
            continue
        w = min(hits, key=lambda r: r[key])
        strict = key == "speedup"  # faster: strictly above; a fraction: at least
        met = w[key] > target if strict else w[key] >= target
        rows.append(dict(goal=goal, target=fmt(target), worst=fmt(w[key]),
                         where=f"{w['shape']}, batch {w['batch']}, {w['state_dtype']} state",
                         met=met, margin=w[key] / target - 1))
    return Table(rows, dict(goal="goal", target="target", worst="worst measured",
                            where="where", met="met", margin="margin"),
                 dict(met=lambda v: "yes" if v else "no",
                      margin=lambda v: f"{100 * v:+.1f}\u00a0%"))


def plot_decode(decode, state_dtype="float32"):
    """Left: time per step against batch, ours and mamba_ssm's, per head shape (log-log).
    Right: the bandwidth on state traffic as a fraction of the copy bandwidth, with the goal."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(8, 3.0), dpi=90)
    recs = [r for r in decode["records"] if r["state_dtype"] == state_dtype]
    styles = {name: style for name, style in zip(decode_bench.HEADS, ("-", "--", ":"))}
    for impl in ("ssd", "mamba_ssm"):
        for shape in dict.fromkeys(r["shape"] for r in recs):
            pts = sorted((r["dims"][0], r) for r in recs
                         if r["impl"] == impl and r["shape"] == shape)
            if not pts:
                continue
            b = [p[0] for p in pts]
            kw = dict(color=COLOR[impl], ls=styles.get(shape, "-"), marker="o", ms=3,
                      label=f"{LABEL[impl]}, {shape}")
            ax0.plot(b, [1e3 * p[1]["median_ms"] for p in pts], **kw)
            ax1.plot(b, [100 * p[1]["copy_fraction"] for p in pts], **kw)
    ax1.axhline(100 * DECODE_GOALS["copy_fraction"], color="k", lw=0.6, ls="--")
    ax1.axvline(DECODE_GOALS["copy_from_batch"], color="0.6", lw=0.6)
    for ax, ylabel, title in ((ax0, "µs a step", "time a step"),
                              (ax1, "% of copy bandwidth", "state traffic / time")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(f"{title} ({state_dtype} state)", fontsize=9)
        ax.tick_params(labelsize=7)
    ax0.set_yscale("log")
    ax0.legend(fontsize=6)
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- robust suite


def _model(name: str) -> str:
    """'r04-nemotron-h-4b-b16-l889-s6' -> 'nemotron-h-4b' (``bench.robust_shapes``' names)."""
    parts = name.split("-")[1:]
    while parts and parts[-1][:1] in "bls" and parts[-1][1:].isdigit():
        parts.pop()
    return "-".join(parts)


def _packing(robust) -> dict:
    """{shape: packed sequences a row} of the recording's shapes (1 where not packed)."""
    return {r["shape"]: len(r.get("seq_boundaries", ())) + 1 for r in robust["records"]}


def robust_table(robust) -> Table:
    """One row per shape: its model, dims, packed sequences a row, ours and mamba_ssm's best
    graph-replay time (ms, chunk size; ours at the chunk sizes the suite's policy runs it at,
    ``settings.our_chunk_sizes``: one, against mamba_ssm's three) and ours' speedup in graph
    replay and eagerly."""
    rec = robust["records"]
    ours, theirs = bench.best_records(rec, "ssd"), bench.best_records(rec, "mamba_ssm")
    graph, eager = bench.speedups(rec), bench.speedups(rec, mode="eager")
    seqs = _packing(robust)
    rows = []
    for shape, o in ours.items():
        m = theirs.get(shape)
        rows.append(dict(shape=shape, model=_model(shape), dims="×".join(map(str, o["dims"])),
                         sequences=seqs[shape], ours=f"{o['median_ms']:.3f} ({o['chunk_size']})",
                         mamba=m and f"{m['median_ms']:.3f} ({m['chunk_size']})",
                         graph=graph.get(shape), eager=eager.get(shape)))
    return Table(rows, dict(model="model", dims="b×l×h×p×n×g", sequences="sequences a row",
                            ours="ours ms (chunk)", mamba="mamba_ssm ms (chunk)",
                            graph="× graph", eager="× eager"),
                 dict(graph=times, eager=times))


def robust_goals(robust) -> Table:
    """The robust suite's goals (``ssd.tools.bench.ROBUST_GOALS``) against the recording
    (``ssd.tools.bench.speedup_summary``): each goal, its target, the measured value, the shape
    it was measured on (for a minimum), whether it was met and the margin (measured over
    target, minus one)."""
    goals = robust.get("goals", bench.ROBUST_GOALS)
    summary = bench.speedup_summary(robust["records"], goals=goals)
    text = {"graph_geomean": "CUDA graph: geometric mean over mamba_ssm",
            "graph_min": "CUDA graph: every shape over mamba_ssm",
            "eager_min": "eager: every shape over mamba_ssm eagerly"}
    rows = []
    for key, target in goals.items():
        mode, stat = key.split("_", 1)
        got = summary.get(mode)
        value = got and got[stat]
        rows.append(dict(goal=text.get(key, key), target=f"≥ {target:.2f}×", measured=value,
                         where=got and (got["min_shape"] if stat == "min" else
                                        f"{got['shapes']} shapes"),
                         met=None if value is None else value >= target,
                         margin=None if value is None else value / target - 1))
    return Table(rows, dict(goal="goal", target="target", measured="measured", where="where",
                            met="met", margin="margin"),
                 dict(measured=times, met=lambda v: "yes" if v else "no",
                      margin=lambda v: f"{100 * v:+.1f}\u00a0%"))


def _geomean(values) -> float:
    values = [v for v in values if v is not None]
    return float(np.exp(np.mean(np.log(values)))) if values else math.nan


def packed_table(robust) -> Table:
    """Packed shapes (seq_idx: several sequences a row, ours in three stages) against the
    others: how many, and ours' speedup over mamba_ssm (geometric mean and lowest) in graph
    replay and eagerly."""
    table = robust_table(robust)
    rows = []
    for label, pick in (("packed (seq_idx)", lambda r: r["sequences"] > 1),
                        ("one sequence a row", lambda r: r["sequences"] == 1)):
        part = [r for r in table if pick(r)]
        graph = [r["graph"] for r in part if r["graph"] is not None]
        rows.append(dict(kind=label, shapes=len(part), graph_geomean=_geomean(graph),
                         graph_min=min(graph, default=None),
                         eager_geomean=_geomean([r["eager"] for r in part])))
    return Table(rows, dict(kind="shapes", shapes="count", graph_geomean="× graph, geomean",
                            graph_min="× graph, lowest", eager_geomean="× eager, geomean"),
                 dict(graph_geomean=times, graph_min=times, eager_geomean=times))


def plot_robust(robust):
    """Ours' speedup over mamba_ssm on every shape of the suite, sorted, in graph replay (dots)
    and eagerly (crosses), packed shapes filled, with the goals as lines."""
    import matplotlib.pyplot as plt

    table = sorted(robust_table(robust), key=lambda r: r["graph"] or 0)
    goals = robust.get("goals", bench.ROBUST_GOALS)
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
    x = np.arange(len(table))
    packed = np.array([r["sequences"] > 1 for r in table])
    graph = np.array([r["graph"] or np.nan for r in table])
    eager = np.array([r["eager"] or np.nan for r in table])
    for mask, label in ((packed, "packed"), (~packed, "one sequence a row")):
        face = "C0" if label == "packed" else "white"
        ax.scatter(x[mask], graph[mask], marker="o", s=22, facecolors=face, edgecolors="C0",
                   label=f"CUDA graph, {label}", zorder=3)
    ax.scatter(x, eager, marker="x", s=18, color="C1", label="eager", zorder=3)
    for key, ls in (("graph_geomean", "--"), ("graph_min", ":"), ("eager_min", "-")):
        if key in goals:
            ax.axhline(goals[key], color="k", lw=0.6, ls=ls)
            ax.text(len(table) - 0.5, goals[key], f" {key.replace('_', ' ')} goal",
                    fontsize=6, va="bottom", ha="right")
    ax.set_xticks(x, [r["model"] for r in table], rotation=90, fontsize=6)
    ax.set_ylabel("mamba_ssm time / ours", fontsize=8)
    ax.set_title("Speed on every shape: the robust suite", fontsize=9)
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the scenario


def scenario_line(scenario) -> str:
    """The scenario in one sentence: requests, prompt lengths, tokens generated, the stack."""
    sc, m = scenario["scenario"], scenario["model"]
    lengths = sc["prompt_lengths"]
    return (f"{sc['requests']} requests, prompts of {min(lengths)} to {max(lengths)} tokens "
            f"({sc['prompt_tokens']} in all), {sc['generate']} tokens generated each, on "
            f"{m['n_layers']} layers of {m['config']} in {m['dtype']}")


def scenario_table(scenario) -> Table:
    """One row per SSD backend: time to first token (the packed prefill) and the SSD's share
    of it, a decode step's time, the SSD's share of it, decode tokens per second, and how
    each phase was launched."""
    rows = [dict(backend=LABEL.get(r["backend"], r["backend"]), key=r["backend"],
                 chunk=r["chunk_size"], ttft_ms=r["ttft_ms"], prefill_share=r["ssd_prefill_share"],
                 prefill_mode=r["prefill_mode"], step_ms=r["step_ms"],
                 step_share=r["ssd_step_share"], decode_mode=r["decode_mode"],
                 tokens_per_s=r["decode_tokens_per_s"]) for r in scenario["rows"]]
    return Table(rows, dict(backend="SSD", chunk="chunk", ttft_ms="time to first token ms",
                            prefill_share="SSD share of it", prefill_mode="prefill launched",
                            step_ms="decode step ms", step_share="SSD share of a step",
                            decode_mode="steps launched", tokens_per_s="tokens/s"),
                 dict(ttft_ms=".1f", prefill_share=pct, step_ms=".3f", step_share=pct,
                      tokens_per_s=",.0f"))


def scenario_amdahl(scenario) -> Table:
    """Amdahl's prediction beside the measurement, for the prefill (time to first token) and a
    decode step, recomputed from the rows (``ssd.tools.serving.amdahl_of``): the SSD's share
    s with mamba_ssm's SSD, the SSD's speedup k, predicted and measured speedup, the bound."""
    from ..tools.serving import amdahl_of

    rows = [dict(a, phase=phase) for phase, part in amdahl_of(scenario["rows"]).items()
            for a in part]
    return Table(rows, dict(phase="phase", share="share s", kernel_speedup="SSD speedup k",
                            predicted="predicted S", measured="measured S",
                            max_possible="bound"),
                 dict(share=pct, kernel_speedup="{:.2f}x", predicted="{:.3f}x",
                      measured="{:.3f}x", max_possible="{:.2f}x"))


def plot_scenario(scenario):
    """Two panels, time to first token and a decode step: per backend, the SSD (all layers)
    and the rest, in units of mamba_ssm's time where it ran (else the first backend's)."""
    import matplotlib.pyplot as plt

    rows = scenario["rows"]
    ref = next((r for r in rows if r["backend"] == BASE), rows[0])
    fig, axes = plt.subplots(1, 2, figsize=(8, 2.4), dpi=90)
    for ax, total, part, title in ((axes[0], "ttft_ms", "ssd_prefill_ms_total",
                                    "time to first token (packed prefill)"),
                                   (axes[1], "step_ms", "ssd_step_ms_total", "a decode step")):
        for i, r in enumerate(rows):
            unit = ref[total]
            ssd = min(r[part], r[total]) / unit
            ax.barh(i, ssd, color=COLOR.get(r["backend"], "C2"), height=0.7,
                    label="SSD" if i == 0 else None)
            ax.barh(i, r[total] / unit - ssd, left=ssd, color="0.8", height=0.7,
                    label="the rest" if i == 0 else None)
            ax.text(r[total] / unit + 0.01, i, pct(r[part] / r[total]), va="center",
                    fontsize=7)
        ax.set_yticks(range(len(rows)), [LABEL.get(r["backend"], r["backend"]) for r in rows],
                      fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25)
        ax.set_xlabel(f"time / {LABEL.get(ref['backend'], ref['backend'])}'s", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------- the host path


def host_table(record) -> Table:
    """One row per phase of the host path (``ssd.tools.host_profile``), in µs: a signature's
    first call (checks, configuration, the launchers) and a repeated call, whose plan replays
    the launches; on a GPU the last row of each is the whole call, timed alone."""
    rows = [dict(call=title, phase=phase, us=us, does=HOST_PHASES.get(phase, ""))
            for title, part in (("first", record["first_call_us"]),
                                ("repeated", record["repeated_call_us"]))
            for phase, us in part.items() if phase != "total"]
    return Table(rows, dict(call="call", phase="phase", us="µs", does="what it does"),
                 dict(us=".1f"))


def host_goal(record, goal_us=HOST_GOAL_US) -> Table:
    """The host-path goal: a repeated eager call's time minus its CUDA-graph replay's (the
    host time the graph hides) at most ``goal_us``, beside the floor cuTile's own launches set
    (``cutile``: ``cuda.tile.launch`` alone for the call's launches); the first-call path's
    overhead below it, without a goal (a signature's first call, and every call a plan cannot
    hold). None where the record was made without a GPU."""
    gpu = "eager_ms" in record
    rows = [dict(path=path, overhead=record[key] if gpu else None, goal=goal,
                 floor=record["repeated_call_us"].get("cutile") if goal else None,
                 met=record[key] <= goal if gpu and goal else None)
            for path, key, goal in (
                ("repeated call (plan replayed)", "host_overhead_us", goal_us),
                ("first-call path (checks, configuration, launchers)",
                 "first_call_host_overhead_us", None))]
    return Table(rows, dict(path="path", overhead="eager − graph µs", goal="goal µs",
                            floor="cuTile's launches µs", met="met"),
                 dict(overhead=".1f", goal=".0f", floor=".1f",
                      met=lambda v: "yes" if v else "no"))
