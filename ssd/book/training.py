"""The training chapter (notebooks/15_training): what the backward costs against mamba_ssm's, what
a faster SSD buys a training step (Amdahl's law), and a model trained with each backend.

Every function takes loaded recordings (``ssd.book.recordings.load_recorded``) and returns a
:class:`ssd.book.tables.Table` or a matplotlib ``Figure``; nothing here runs a kernel:

* ``backward``: ``python -m ssd.tools.backward_bench``, the SSD's forward and forward + backward,
  ours and mamba_ssm's (and TileGym's untuned, any peer recorded beside them), on the ``models``
  shapes at three chunk sizes, CUDA-graph replay and eager, with the extra peak memory:
  :func:`fb_table`, :func:`fb_goals`, :func:`memory_table`, :func:`plot_fb`;
* ``backward_tilegym_tuned``: ``make gpu-tilegym-backward``, ours beside TileGym's forward +
  backward tuned by its own search, in one process: :func:`fb_goals`;
* ``training_step``: ``python -m ssd.tools.train step``, a training step (forward, backward,
  AdamW) of a stack per ``models`` shape and backend, with the SSD's share: :func:`step_table`,
  :func:`plot_step`;
* ``training``: ``python -m ssd.tools.train mqar``, multi-query associative recall learned by a
  small Mamba-2 language model with each backend and seed: :func:`task_line`,
  :func:`mqar_table`, :func:`noise_table`, :func:`plot_curves`.

Speedups and shares are computed by the tools' own functions (``ssd.tools.backward_bench.best``
and ``speedups``, ``ssd.tools.endtoend.amdahl_rows``, ``ssd.tools.train.summary`` and
``curve_gaps``).
"""
from __future__ import annotations

import math

import numpy as np

from ..cost import DTYPE_BYTES
from ..tools import backward_bench as BB
from ..tools import train as T
from ..tools.endtoend import amdahl_rows
from .figures import paired_bars
from .tables import Table, pct

__all__ = ["FB_GOALS", "LABEL", "fb_table", "fb_goals", "memory_table", "plot_fb", "step_table",
           "plot_step", "task_line", "mqar_table", "noise_table", "plot_curves"]

#: The forward + backward goals, against mamba_ssm's best chunk size in CUDA-graph replay: the
#: geometric mean over the models shapes and the lowest shape's speedup; faster than each other
#: peer recorded (TileGym untuned and tuned) on every shape; extra peak memory at most mamba_ssm's; the first
#: forward + backward call within ``first_call_s``; and, a stretch, our backward at most
#: ``backward_over_forward`` times our forward.
FB_GOALS = dict(geomean=2.0, every_shape=1.5, peers=1.0, memory=1.0, first_call_s=15.0,
                backward_over_forward=2.0)
#: How the chapter names implementations and backends, and their colours.
LABEL = {"ssd": "ours", "cutile": "ours (cuTile)", "mamba_ssm": "mamba_ssm",
         "tilegym": "TileGym", "tilegym_tuned": "TileGym tuned", "torch": "PyTorch"}
COLOR = {"ssd": "C0", "cutile": "C0", "mamba_ssm": "C1", "tilegym": "C2", "tilegym_tuned": "C3"}
FB = "forward+backward"
#: The peers whose goal rows are shown, recorded or not.
CUTILE_PEERS = ("tilegym", "tilegym_tuned")


def times(v) -> str:
    return f"{v:.2f}×"


def _geomean(values) -> float:
    values = [v for v in values if v is not None]
    return float(np.exp(np.mean(np.log(values)))) if values else math.nan


def _peers(records) -> list:
    """The implementations recorded beside ours, mamba_ssm first."""
    impls = [i for i in dict.fromkeys(r["impl"] for r in records) if i != "ssd"]
    return sorted(impls, key=lambda i: i != "mamba_ssm")


# ----------------------------------------------------------------------------- forward + backward


def fb_table(backward, mode="graph") -> Table:
    """Per shape, each implementation at its fastest forward + backward chunk size
    (``ssd.tools.backward_bench.best``): ours' forward and forward + backward times, its
    backward over its forward ((fwd+bwd - fwd) / fwd), mamba_ssm's forward + backward, ours'
    speedup over each peer in ``mode`` and eagerly, and the extra peak memory of ours and
    mamba_ssm's. The last row holds the geometric means of the speedups."""
    rec = backward["records"]
    top, eager_top = BB.best(rec, mode), BB.best(rec, "eager")
    peers = _peers(rec)
    rows = []
    for shape in dict.fromkeys(r["shape"] for r in rec):
        ours = top.get((shape, "ssd"))
        if ours is None:
            continue
        o_fb, o_f = ours[FB], ours.get("forward")
        m = top.get((shape, "mamba_ssm"), {}).get(FB)
        row = dict(shape=shape, dims="×".join(map(str, o_fb["dims"])),
                   ours_f=o_f and o_f["median_ms"],
                   ours_fb=f"{o_fb['median_ms']:.3f} ({o_fb['chunk_size']})",
                   bwd_over_fwd=o_f and (o_fb["median_ms"] - o_f["median_ms"]) / o_f["median_ms"],
                   mamba_fb=m and f"{m['median_ms']:.3f} ({m['chunk_size']})",
                   ours_mb=o_fb["extra_peak_mb"], mamba_mb=m and m["extra_peak_mb"])
        for peer in peers:
            theirs = top.get((shape, peer), {}).get(FB)
            row[f"x_{peer}"] = theirs and theirs["median_ms"] / o_fb["median_ms"]
        e_ours, e_m = (eager_top.get((shape, i), {}).get(FB) for i in ("ssd", "mamba_ssm"))
        row["x_eager"] = e_ours and e_m and e_m["median_ms"] / e_ours["median_ms"]
        rows.append(row)
    speedups = [f"x_{p}" for p in peers] + ["x_eager"]
    rows.append(dict(shape="geometric mean", **{k: _geomean(r[k] for r in rows)
                                                for k in speedups}))
    cols = dict(shape="shape", dims="b×l×h×p×n×g", ours_f="ours fwd ms",
                ours_fb="ours fwd+bwd ms (chunk)", bwd_over_fwd="ours bwd / fwd",
                mamba_fb="mamba_ssm fwd+bwd ms (chunk)")
    cols.update({f"x_{p}": f"× {LABEL.get(p, p)}" for p in peers})
    cols.update(x_eager="× mamba_ssm eager", ours_mb="ours extra MiB",
                mamba_mb="mamba_ssm extra MiB")
    return Table(rows, cols, dict(ours_f=".3f", bwd_over_fwd=times, ours_mb=".0f",
                                  mamba_mb=".0f", **{k: times for k in speedups}))


def _goal_row(goal, target, value, where, at_least=True, fmt=times):
    """A goal's row: met and the margin, positive where met (measured over target minus one
    for a lower bound, target over measured minus one for an upper bound)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return dict(goal=goal, target=target, measured=None, where=where or "not recorded",
                    met=None, margin=None)
    met = value >= target[1] if at_least else value <= target[1]
    margin = value / target[1] - 1 if at_least else target[1] / value - 1
    return dict(goal=goal, target=target, measured=fmt(value), where=where, met=met,
                margin=margin)


def _peer_speedups(recordings, peer, mode="graph") -> dict:
    """{shape: ``peer``'s best forward + backward time over ours'} from the first of
    ``recordings`` that holds ``peer``'s records (ours from the same recording: the same
    process), empty where none does."""
    for recording in recordings:
        if recording is not None and any(r["impl"] == peer for r in recording["records"]):
            return BB.speedups(recording["records"], over=peer, mode=mode)
    return {}


def fb_goals(backward, goals=FB_GOALS, tuned=None) -> Table:
    """The forward + backward goals (:data:`FB_GOALS`) against the recording: per goal the
    target, the worst value measured (or the geometric mean), where, whether it was met and
    the margin; a goal whose peer was not recorded says so. ``tuned``: the
    ``backward_tilegym_tuned`` recording, where TileGym tuned is read when ``backward`` does
    not hold it."""
    table = [r for r in fb_table(backward) if r["shape"] != "geometric mean"]
    rec = backward["records"]
    rows = []
    sp = [(r["x_mamba_ssm"], r["shape"]) for r in table if r.get("x_mamba_ssm") is not None]
    rows.append(_goal_row("fwd+bwd over mamba_ssm, geometric mean", ("≥", goals["geomean"]),
                          _geomean(v for v, _ in sp) if sp else None, f"{len(sp)} shapes"))
    low = min(sp, default=(None, None))
    rows.append(_goal_row("fwd+bwd over mamba_ssm, every shape", ("≥", goals["every_shape"]),
                          low[0], low[1]))
    recorded = [p for p in _peers(rec) if p != "mamba_ssm" and p not in CUTILE_PEERS]
    for peer in CUTILE_PEERS + tuple(recorded):
        vals = [(v, shape) for shape, v in _peer_speedups((backward, tuned), peer).items()]
        worst = min(vals, default=(None, None))
        rows.append(_goal_row(f"faster than {LABEL.get(peer, peer)} fwd+bwd, every shape",
                              (">", goals["peers"]), worst[0], worst[1]))
        if worst[0] is not None:  # strictly faster
            rows[-1]["met"] = worst[0] > goals["peers"]
    mem = [(r["ours_mb"] / r["mamba_mb"], r["shape"]) for r in table if r.get("mamba_mb")]
    worst = max(mem, default=(None, None))
    rows.append(_goal_row("extra peak memory over mamba_ssm's, every shape",
                          ("≤", goals["memory"]), worst[0], worst[1], at_least=False))
    firsts = [(r["first_call_s"], r["shape"]) for r in rec if r["impl"] == "ssd"]
    worst = max(firsts, default=(None, None))
    rows.append(_goal_row("first fwd+bwd call of a shape, compiles included (s)",
                          ("≤", goals["first_call_s"]), worst[0], worst[1], at_least=False,
                          fmt=lambda v: f"{v:.1f}"))
    ratio = [(r["bwd_over_fwd"], r["shape"]) for r in table if r.get("bwd_over_fwd")]
    worst = max(ratio, default=(None, None))
    rows.append(_goal_row("stretch: our backward over our forward, every shape",
                          ("≤", goals["backward_over_forward"]), worst[0], worst[1],
                          at_least=False))
    for r in rows:
        sign, value = r["target"]
        r["target"] = f"{sign} {value:g} s" if "(s)" in r["goal"] else f"{sign} {value:.2f}×"
    return Table(rows, dict(goal="goal", target="target", measured="measured",
                            where="where", met="met", margin="margin"),
                 dict(met=lambda v: "yes" if v else "no",
                      margin=lambda v: f"{100 * v:+.1f}\u00a0%"))


def memory_table(backward, mode="graph") -> Table:
    """Per shape and chunk size q: ours' and mamba_ssm's forward + backward time in ``mode`` and
    extra peak memory, and the part of ours' the entering states and their gradient take:
    both (b, c, h, p, n) in the inputs' dtype, c = ceil(l / q), so 2 b c h p n elements, N/Q of
    x's size each. What a smaller chunk buys its speed with."""
    rec = {(r["shape"], r["impl"], r["chunk_size"]): r for r in backward["records"]
           if r["what"] == FB and r["mode"] == mode}
    rows = []
    for (shape, impl, q), ours in rec.items():
        if impl != "ssd":
            continue
        b, l, h, p, n, _ = ours["dims"]
        states = 2 * b * -(-l // q) * h * p * n * DTYPE_BYTES[ours["dtype"]] / 2**20
        m = rec.get((shape, "mamba_ssm", q))
        rows.append(dict(shape=shape, chunk=q, ours_ms=ours["median_ms"],
                         ours_mb=ours["extra_peak_mb"], states_mb=states,
                         states_share=states / ours["extra_peak_mb"],
                         mamba_ms=m and m["median_ms"], mamba_mb=m and m["extra_peak_mb"]))
    return Table(rows, dict(shape="shape", chunk="chunk", ours_ms="ours fwd+bwd ms",
                            ours_mb="ours extra MiB", states_mb="entering states + gradient MiB",
                            states_share="their share", mamba_ms="mamba_ssm fwd+bwd ms",
                            mamba_mb="mamba_ssm extra MiB"),
                 dict(ours_ms=".3f", ours_mb=".0f", states_mb=".0f", states_share=pct,
                      mamba_ms=".3f", mamba_mb=".0f"))


def plot_fb(backward, mode="graph"):
    """Per shape, ours and mamba_ssm's forward and backward (forward + backward minus forward)
    as stacked bars, in units of mamba_ssm's forward + backward (each at its fastest chunk)."""
    top = BB.best(backward["records"], mode)
    shapes = list(dict.fromkeys(s for s, i in top if i == "ssd" and (s, "mamba_ssm") in top))
    groups = []
    for s in shapes:
        ref, bars = top[(s, "mamba_ssm")][FB]["median_ms"], []
        for impl in ("mamba_ssm", "ssd"):
            recs = top[(s, impl)]
            fb = recs[FB]["median_ms"] / ref
            f = recs["forward"]["median_ms"] / ref if "forward" in recs else 0.0
            bars.append((f"{s}, {LABEL[impl]}",
                         [(f, dict(color=COLOR[impl], label=f"forward, {LABEL[impl]}")),
                          (fb - f, dict(color=COLOR[impl], alpha=0.45,
                                        label=f"backward, {LABEL[impl]}"))],
                         f"{recs[FB]['median_ms']:.2f} ms"))
        groups.append(bars)
    return paired_bars(groups, xlim=1.3, ncol=4,
                       xlabel="time / mamba_ssm's forward + backward",
                       title=f"The SSD's forward and backward ({mode})")


# ----------------------------------------------------------------------------- the training step


def step_table(step) -> Table:
    """Per shape: the training step's time with each backend, the SSD's share of mamba_ssm's
    step, the SSD's forward + backward speedup k inside it, and Amdahl's predicted step speedup
    beside the measured one (``ssd.tools.endtoend.amdahl_rows``, as the recording's)."""
    times_ = {(r["shape"], r["backend"]): r["step_ms"] for r in step["rows"]}
    rows = []
    for a in amdahl_rows(step["rows"], key=("shape",), total="step_ms", part="ssd_ms_total",
                         base=T.BASE, new=T.NEW):
        rows.append(dict(a, base_ms=times_[(a["shape"], T.BASE)],
                         new_ms=times_[(a["shape"], T.NEW)],
                         error=a["measured"] - a["predicted"]))
    return Table(rows, dict(shape="shape", base_ms="mamba_ssm step ms", new_ms="ours step ms",
                            share="SSD share s", kernel_speedup="SSD fwd+bwd speedup k",
                            predicted="predicted S", measured="measured S",
                            max_possible="bound"),
                 dict(base_ms=".2f", new_ms=".2f", share=pct, kernel_speedup="{:.2f}x",
                      predicted="{:.3f}x", measured="{:.3f}x", max_possible="{:.2f}x"))


def plot_step(step):
    """Per shape and backend, the step's time split into the SSD (forward + backward, all
    layers) and the rest (projections, conv, norm, their backward, AdamW), in units of
    mamba_ssm's step."""
    row = {(r["shape"], r["backend"]): r for r in step["rows"]}
    shapes = [s for s in dict.fromkeys(r["shape"] for r in step["rows"])
              if (s, T.BASE) in row and (s, T.NEW) in row]
    groups = []
    for s in shapes:
        ref, bars = row[(s, T.BASE)]["step_ms"], []
        for b in (T.BASE, T.NEW):
            r = row[(s, b)]
            ssd = min(r["ssd_ms_total"], r["step_ms"]) / ref
            bars.append((f"{s}, {LABEL[b]}",
                         [(ssd, dict(color=COLOR[b], label=f"SSD, {LABEL[b]}")),
                          (r["step_ms"] / ref - ssd,
                           dict(color="0.8", label="the rest of the step"))],
                         pct(r["ssd_share"])))
        groups.append(bars)
    return paired_bars(groups, xlim=1.2, xlabel="step time / mamba_ssm step's (label: SSD share)",
                       title="Where a training step's time goes")


# ----------------------------------------------------------------------------- MQAR


def task_line(training) -> str:
    """The task and the model in one sentence."""
    c = training["config"]
    return (f"MQAR: {c['num_pairs']} key-value pairs in sequences of {c['seq_len']} tokens, "
            f"vocabulary {c['vocab_size']}; a Mamba-2 LM of {c['n_layers']} layers, width "
            f"{c['d_model']}, state {c['d_state']}, chunk {c['chunk_size']}; AdamW at lr "
            f"{c['lr']:g}, batch {c['batch']}, {c['steps']} steps")


def mqar_table(training) -> Table:
    """One row a run (``ssd.tools.train.summary``): backend, seed, final accuracy and held-out
    loss, steps and seconds of training to the target accuracy, steady ms a step, the first
    steps' ms (compiling), peak memory."""
    rows = [dict(r, label=LABEL.get(r["backend"], r["backend"]))
            for r in T.summary(training["runs"])]
    target = training["config"]["target_accuracy"]
    return Table(rows, dict(label="backend", seed="seed", final_accuracy="final accuracy",
                            final_eval_loss="held-out loss",
                            steps_to_target=f"steps to {pct(target)}",
                            time_to_target_s=f"seconds to {pct(target)}",
                            ms_per_step="ms a step", first_steps_ms="first steps ms",
                            peak_mem_mib="peak MiB"),
                 dict(final_accuracy=pct, final_eval_loss=".4f", time_to_target_s=".1f",
                      ms_per_step=".2f", first_steps_ms=".0f", peak_mem_mib=".0f"))


def noise_table(training) -> Table:
    """How far apart the held-out loss curves are (``ssd.tools.train.curve_gaps``): each pair
    of backends at one seed, and each pair of seeds of one backend (run-to-run noise); mean and
    largest absolute difference over the evaluation points."""
    gaps = T.curve_gaps(training["runs"])
    rows = [dict(pair=" vs ".join(LABEL.get(b, b) for b in g["backends"]),
                 kind=f"backends, seed {g['seed']}", mean_abs=g["mean_abs"],
                 max_abs=g["max_abs"]) for g in gaps["between_backends"]]
    rows += [dict(pair=f"seeds {g['seeds'][0]} vs {g['seeds'][1]}",
                  kind=f"noise, {LABEL.get(g['backend'], g['backend'])}",
                  mean_abs=g["mean_abs"], max_abs=g["max_abs"]) for g in gaps["between_seeds"]]
    return Table(rows, dict(kind="compared", pair="runs", mean_abs="mean |Δ loss|",
                            max_abs="largest |Δ loss|"), dict(mean_abs=".2e", max_abs=".2e"))


def plot_curves(training, smooth=25):
    """Left: the training loss (a running mean over ``smooth`` steps) and the held-out loss
    (markers) of every run; right: the held-out accuracy, with the target. Colour: backend;
    line style: seed."""
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(8, 3.0), dpi=90)
    seeds = sorted({r["seed"] for r in training["runs"]})
    styles = dict(zip(seeds, ("-", "--", ":", "-.")))
    for r in training["runs"]:
        color, ls = COLOR.get(r["backend"], "C2"), styles.get(r["seed"], "-")
        label = f"{LABEL.get(r['backend'], r['backend'])}, seed {r['seed']}"
        loss = np.asarray(r["train_loss"], dtype=float)
        k = max(1, min(smooth, len(loss)))
        running = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax0.plot(np.arange(k, len(loss) + 1), running, color=color, ls=ls, lw=0.8, alpha=0.7)
        ax0.plot(r["eval_step"], r["eval_loss"], color=color, ls="none", marker="o", ms=2.5)
        ax1.plot(r["eval_step"], [100 * a for a in r["eval_accuracy"]], color=color, ls=ls,
                 lw=1, label=label)
    ax1.axhline(100 * training["config"]["target_accuracy"], color="k", lw=0.5, ls="--")
    ax0.set_yscale("log")
    for ax, ylabel, title in ((ax0, "loss (line: training; dots: held-out)", "loss"),
                              (ax1, "held-out accuracy %", "recall accuracy")):
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
    ax1.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig
