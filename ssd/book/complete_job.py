"""Chapter 11's tables and figures: two Mamba-2 layers, the plain one (conv and norm in PyTorch)
and the fast one (conv and norm as cuTile kernels), and what the same faster SSD buys each
(Amdahl's law, checked against the measurement).

Every function takes ``endtoend``, ``results/<gpu>/endtoend.json`` as
``python -m ssd.tools.endtoend`` writes it (``ssd.book.recordings.load_recorded``): part
``share``, one mixer per models shape in both layers with each SSD backend, mamba_ssm's own
``Mamba2`` module, each shape's projections alone, the rest's floor, and the ceilings measured
in the same run; part ``prefill``, stacks of mixers over a prompt in both layers. Tables are
:class:`ssd.book.tables.Table` objects; figures are matplotlib ``Figure`` objects;
:func:`headlines` returns the handful of numbers the chapter's prose quotes.
"""
from __future__ import annotations

import math

from ..tools.endtoend import AMDAHL_KEYS, BASE, GATE_TOL, NEW, PEER_KERNELS, amdahl, amdahl_rows
from .tables import Table

#: How the two SSD backends are named in tables and legends.
LABEL = {NEW: "ours (cuTile)", BASE: "mamba_ssm (Triton)"}
COLOR = {NEW: "C0", BASE: "C1"}
#: The two layers, by the ``kernels`` of their rows: the conv and norm around the SSD.
PLAIN, FAST = "torch", "cutile"
LAYER = {PLAIN: "plain", FAST: "fast"}
LAYER_COLOR = {PLAIN: "0.55", FAST: "C2"}
#: The goal for the fast layer's rest (mixer minus SSD): within this factor of its floor.
REST_GOAL = 1.3
#: The fields of a prefill point (one stack, one prompt batch), without the layer.
PREFILL_KEY = AMDAHL_KEYS["prefill"][:-1]


def pct(v) -> str:
    return f"{100 * v:.1f}\u00a0%"  # no break before the sign


def _rows(endtoend, part="share", backend=None, kernels=None):
    """The rows of ``part``, of one backend and one layer if given (a row without ``kernels``
    ran in the plain layer)."""
    return [r for r in endtoend[part]["rows"]
            if (backend is None or r["backend"] == backend)
            and (kernels is None or r.get("kernels", PLAIN) == kernels)]


def _by_shape(endtoend, backend, kernels) -> dict:
    return {r["shape"]: r for r in _rows(endtoend, "share", backend, kernels)}


def shapes(endtoend) -> list:
    """The shapes that have both layers with both SSD backends, in recorded order."""
    have = [set(_by_shape(endtoend, b, k)) for b in (BASE, NEW) for k in (PLAIN, FAST)]
    order = dict.fromkeys(r["shape"] for r in endtoend["share"]["rows"])
    return [s for s in order if all(s in h for h in have)]


# ----------------------------------------------------------------------------- Amdahl's law


def amdahl_grid(shares=(0.1, 0.5, 0.9), speedups=(2.0, 10.0, math.inf)) -> Table:
    """End-to-end speedup S for a part of share s made k times faster (k = inf: the bound
    1 / (1 - s))."""
    rows = []
    for s in shares:
        row = {"share": s}
        for k in speedups:
            row[k] = 1 / (1 - s) if math.isinf(k) else amdahl(s, k)
        rows.append(row)
    cols = {"share": "share s of the job"}
    cols.update({k: "k = inf (bound)" if math.isinf(k) else f"k = {k:g}" for k in speedups})
    return Table(rows, cols, {"share": pct, **{k: "{:.2f}x" for k in speedups}})


# ----------------------------------------------------------------------------- the floor


def ssd_floor_ms(dims, ceilings) -> float:
    """The SSD forward's floor on these dims (``ssd.tools.bench.floor_ms``)."""
    from ..tools.bench import Shape, floor_ms

    return floor_ms(Shape("", *dims), ceilings)["floor_ms"]


def floor_table(endtoend) -> Table:
    """Per shape, before any timing: the rest of the mixer's work (the projections' FLOPs, the
    conv's and norm's bytes), its floor at the ceilings measured in the same run
    (``ssd.cost.rest_floor``), the SSD's floor, and the SSD's share of a mixer whose two parts
    both ran at their floors."""
    ceil = endtoend["share"]["ceilings"]
    rows = []
    for shape, r in _by_shape(endtoend, NEW, FAST).items():
        f, ssd = r["rest_floor"], ssd_floor_ms(r["dims"], ceil)
        rows.append(dict(shape=shape, d_model=r["d_model"], tokens=r["dims"][0] * r["dims"][1],
                         proj_gflop=f["proj_flops"] / 1e9,
                         elementwise_mb=(f["conv_bytes"] + f["norm_bytes"]) / 1e6,
                         proj_ms=f["proj_ms"], bytes_ms=f["bytes_ms"], rest_floor_ms=f["floor_ms"],
                         ssd_floor_ms=ssd, share_at_floors=ssd / (ssd + f["floor_ms"])))
    return Table(rows, dict(shape="shape", d_model="d_model", tokens="tokens",
                            proj_gflop="projections GFLOP", elementwise_mb="conv + norm MB",
                            proj_ms="at matmul rate ms", bytes_ms="at copy rate ms",
                            rest_floor_ms="rest floor ms", ssd_floor_ms="SSD floor ms",
                            share_at_floors="SSD share at the floors"),
                 dict(proj_gflop="{:.0f}", elementwise_mb="{:.0f}", proj_ms="{:.3f}",
                      bytes_ms="{:.3f}", rest_floor_ms="{:.3f}", ssd_floor_ms="{:.3f}",
                      share_at_floors=pct))


def projections_table(endtoend) -> Table:
    """in_proj and out_proj timed alone (cuBLAS through ``F.linear``): their achieved rate and
    its fraction of the matmul ceiling measured in the same run."""
    rows = []
    for shape, r in _by_shape(endtoend, NEW, FAST).items():
        p = r["projections"]
        rows.append(dict(shape=shape, **{k: p[k] for k in (
            "in_proj_ms", "in_proj_tflops", "in_proj_of_ceiling", "out_proj_ms",
            "out_proj_tflops", "out_proj_of_ceiling")}))
    return Table(rows, dict(shape="shape", in_proj_ms="in_proj ms",
                            in_proj_tflops="in_proj TFLOP/s", in_proj_of_ceiling="of ceiling",
                            out_proj_ms="out_proj ms", out_proj_tflops="out_proj TFLOP/s",
                            out_proj_of_ceiling="of ceiling "),
                 dict(in_proj_ms="{:.3f}", out_proj_ms="{:.3f}", in_proj_tflops="{:.0f}",
                      out_proj_tflops="{:.0f}", in_proj_of_ceiling=pct, out_proj_of_ceiling=pct))


# ----------------------------------------------------------------------------- two layers


def layers_table(endtoend) -> Table:
    """Per shape and layer: the mixer with each SSD, our SSD's time, the rest (mixer minus SSD,
    with ours), the SSD's share with each SSD, and the rest against its floor."""
    rows = []
    for shape in shapes(endtoend):
        for k in (PLAIN, FAST):
            base, new = _by_shape(endtoend, BASE, k)[shape], _by_shape(endtoend, NEW, k)[shape]
            rows.append(dict(shape=shape, layer=LAYER[k], kernels=k, base_ms=base["mixer_ms"],
                             new_ms=new["mixer_ms"], ssd_ms=new["ssd_ms"],
                             rest_ms=new["rest_diff_ms"], base_share=base["share"],
                             new_share=new["share"], over_floor=new["rest_over_floor"]))
    return Table(rows, dict(shape="shape", layer="layer", base_ms="mixer ms, mamba_ssm SSD",
                            new_ms="mixer ms, our SSD", ssd_ms="our SSD ms",
                            rest_ms="rest ms", base_share="share, mamba_ssm SSD",
                            new_share="share, our SSD", over_floor="rest / floor"),
                 dict(base_ms="{:.3f}", new_ms="{:.3f}", ssd_ms="{:.3f}", rest_ms="{:.3f}",
                      base_share=pct, new_share=pct, over_floor="{:.2f}x"))


def amdahl_layers(endtoend, part="share") -> Table:
    """Amdahl's prediction beside the measurement, per job and layer (``amdahl_rows`` within
    one layer): the SSD's share s of the job with mamba_ssm's SSD, our SSD's speedup k inside
    it, the predicted and measured speedup of the job, and the bound 1 / (1 - s)."""
    key = AMDAHL_KEYS[part]
    total, inner = ("mixer_ms", "ssd_ms") if part == "share" else ("latency_ms", "ssd_ms_total")
    rows = [r for r in endtoend[part]["rows"] if r.get("kernels", PLAIN) in LAYER]
    out = amdahl_rows(rows, key=key, total=total, part=inner)
    for a in out:
        a.update(layer=LAYER[a["kernels"]], error=a["measured"] - a["predicted"])
        if part == "prefill":
            a.update(stack=f"{a['config']}, {a['n_layers']} layers",
                     prompts=f"{a['batch']} x {a['seqlen']}")
    heads = {"shape": "shape"} if part == "share" else dict(stack="stack",
                                                            prompts="prompts x tokens")
    heads.update(layer="layer", share="share s", kernel_speedup="SSD speedup k",
                 predicted="predicted S", measured="measured S", error="measured - predicted",
                 max_possible="bound")
    return Table(out, heads, dict(share=pct, kernel_speedup="{:.2f}x", predicted="{:.3f}x",
                                  measured="{:.3f}x", max_possible="{:.2f}x",
                                  error=lambda v: f"{v:+.3f}"))


def stack_table(endtoend) -> Table:
    """Prefill with our SSD in the fast layer: latency and tokens/s per stack and prompt batch,
    and its speedup over the plain layer with our SSD (the layer's kernels alone) and over the
    plain layer with mamba_ssm's SSD (everything this book changes)."""
    rows = {(tuple(r[f] for f in PREFILL_KEY), r["backend"], r.get("kernels", PLAIN)): r
            for r in endtoend["prefill"]["rows"]}
    out = []
    for (point, backend, kernels), r in rows.items():
        plain_new, plain_base = rows.get((point, NEW, PLAIN)), rows.get((point, BASE, PLAIN))
        if (backend, kernels) != (NEW, FAST) or plain_new is None or plain_base is None:
            continue
        out.append(dict(stack=f"{r['config']}, {r['n_layers']} layers",
                        prompts=f"{r['batch']} x {r['seqlen']}", tokens=r["tokens"],
                        latency_ms=r["latency_ms"], tokens_per_s=r["tokens_per_s"],
                        over_plain=plain_new["latency_ms"] / r["latency_ms"],
                        over_start=plain_base["latency_ms"] / r["latency_ms"]))
    return Table(out, dict(stack="stack", prompts="prompts x tokens", latency_ms="latency ms",
                           tokens_per_s="tokens/s", over_plain="vs plain layer, our SSD",
                           over_start="vs plain layer, mamba_ssm SSD"),
                 dict(latency_ms="{:.2f}", tokens_per_s=lambda v: f"{v:,.0f}",
                      over_plain="{:.2f}x", over_start="{:.2f}x"))


# ----------------------------------------------------------------------------- the goals


def peer_table(endtoend) -> Table:
    """mamba_ssm's own ``Mamba2`` module against the fast layer with our SSD, on the same
    weights: the path the module took here, both times, and the speedup."""
    fast = _by_shape(endtoend, NEW, FAST)
    rows = []
    for shape, p in _by_shape(endtoend, BASE, PEER_KERNELS).items():
        if shape in fast:
            rows.append(dict(shape=shape, conv=p["path"]["conv"], peer_ms=p["mixer_ms"],
                             peer_rest_ms=p["rest_diff_ms"], fast_ms=fast[shape]["mixer_ms"],
                             speedup=p["mixer_ms"] / fast[shape]["mixer_ms"]))
    return Table(rows, dict(shape="shape", conv="its conv", peer_ms="Mamba2 ms",
                            peer_rest_ms="its rest ms", fast_ms="fast layer ms",
                            speedup="fast layer's speedup"),
                 dict(peer_ms="{:.3f}", peer_rest_ms="{:.3f}", fast_ms="{:.3f}",
                      speedup="{:.2f}x"))


def goals_table(endtoend) -> Table:
    """The fast layer's three goals, per shape, each met or missed by the measured margin:
    its rest (mixer minus our SSD) within :data:`REST_GOAL` times its floor; faster than
    mamba_ssm's own ``Mamba2`` module; its output (with our SSD) equal to the plain layer's
    within ``ssd.tools.endtoend.GATE_TOL`` of the dtype."""
    peer = _by_shape(endtoend, BASE, PEER_KERNELS)
    rows = []
    for shape, r in _by_shape(endtoend, NEW, FAST).items():
        tol = GATE_TOL[r["dtype"]]
        row = dict(shape=shape, over_floor=r["rest_over_floor"],
                   floor_met=r["rest_over_floor"] <= REST_GOAL, rel_err=r["gate_rel_err"],
                   tol=tol, equal_met=r["gate_rel_err"] is not None and r["gate_rel_err"] <= tol,
                   vs_peer=None, peer_met=None)
        if shape in peer:
            row["vs_peer"] = peer[shape]["mixer_ms"] / r["mixer_ms"]
            row["peer_met"] = row["vs_peer"] > 1
        rows.append(row)
    met = lambda v: "-" if v is None else ("met" if v else "missed")  # noqa: E731
    return Table(rows, dict(shape="shape", over_floor=f"rest / floor (goal <= {REST_GOAL})",
                            floor_met="met", vs_peer="speedup over Mamba2 (goal > 1)",
                            peer_met="met", rel_err="rel err vs plain", tol="tolerance",
                            equal_met="met"),
                 dict(over_floor="{:.2f}x", vs_peer="{:.2f}x", rel_err="{:.1e}", tol="{:.0e}",
                      floor_met=met, peer_met=met, equal_met=met))


# ----------------------------------------------------------------------------- the prose


def headlines(endtoend) -> dict:
    """The numbers the chapter's prose quotes, by name (percentages in percent): ranges over
    the shapes of each layer's SSD share, rest over floor, Amdahl's k, S and its error, the
    stacks' gains and the fast stack's throughput, the projections' rates, the goals' worst
    margins, and mamba_ssm's module's conv path."""
    layers, mixer, stack = layers_table(endtoend), amdahl_layers(endtoend), \
        amdahl_layers(endtoend, "prefill")
    floors, proj, stacks = floor_table(endtoend), projections_table(endtoend), \
        stack_table(endtoend)
    goals, peer = goals_table(endtoend), peer_table(endtoend)
    ceil = endtoend["share"]["ceilings"]
    out = dict(n_shapes=len(floors), copy_tb_s=ceil["copy_bytes_per_s"] / 1e12,
               matmul_tflop_s=ceil["bf16_flops_per_s"] / 1e12,
               floor_share_lo=100 * min(floors.column("share_at_floors")),
               floor_share_hi=100 * max(floors.column("share_at_floors")),
               proj_of_ceiling_lo=100 * min(proj.column("in_proj_of_ceiling")
                                            + proj.column("out_proj_of_ceiling")),
               proj_of_ceiling_hi=100 * max(proj.column("in_proj_of_ceiling")
                                            + proj.column("out_proj_of_ceiling")))
    for k, name in LAYER.items():
        lay = layers.where(kernels=k)
        mix = [a for a in mixer if a["kernels"] == k]
        stk = [a for a in stack if a["kernels"] == k]
        out.update({f"{name}_share_lo": 100 * min(r["base_share"] for r in lay),
                    f"{name}_share_hi": 100 * max(r["base_share"] for r in lay),
                    f"{name}_floor_lo": min(r["over_floor"] for r in lay),
                    f"{name}_floor_hi": max(r["over_floor"] for r in lay),
                    f"{name}_k_lo": min(a["kernel_speedup"] for a in mix),
                    f"{name}_k_hi": max(a["kernel_speedup"] for a in mix),
                    f"{name}_S_lo": 100 * (min(a["measured"] for a in mix) - 1),
                    f"{name}_S_hi": 100 * (max(a["measured"] for a in mix) - 1),
                    f"{name}_err": 100 * max(abs(a["error"]) for a in mix)})
        if stk:
            out.update({f"{name}_stack_S_lo": 100 * (min(a["measured"] for a in stk) - 1),
                        f"{name}_stack_S_hi": 100 * (max(a["measured"] for a in stk) - 1),
                        f"{name}_stack_err": 100 * max(abs(a["error"]) for a in stk)})
    if len(stacks):
        best = max(stacks, key=lambda r: r["tokens_per_s"])
        out.update(stack_tokens_hi=best["tokens_per_s"] / 1e6, stack_tokens_at=best["stack"],
                   stack_over_plain_lo=min(stacks.column("over_plain")),
                   stack_over_plain_hi=max(stacks.column("over_plain")),
                   stack_over_start_hi=max(stacks.column("over_start")))
    out.update(goal_floor_worst=max(goals.column("over_floor")),
               goal_floor_met=sum(bool(v) for v in goals.column("floor_met")),
               goal_equal_worst=max(v for v in goals.column("rel_err") if v is not None),
               goal_equal_met=sum(bool(v) for v in goals.column("equal_met")))
    if len(peer):
        out.update(peer_speedup_lo=min(peer.column("speedup")),
                   peer_speedup_hi=max(peer.column("speedup")),
                   goal_peer_met=sum(bool(v) for v in goals.column("peer_met")),
                   peer_conv=peer[0]["conv"])
    return out


# ----------------------------------------------------------------------------- figures


def plot_layers(endtoend):
    """Stacked bars, per shape: the mixer in each layer with each SSD (the SSD coloured by its
    backend, the rest by its layer) and mamba_ssm's own Mamba2 module, in units of the plain
    layer's time with mamba_ssm's SSD; a black tick marks the SSD plus the rest's floor."""
    import matplotlib.pyplot as plt

    names = shapes(endtoend)
    bars = [(BASE, PLAIN), (NEW, PLAIN), (BASE, FAST), (NEW, FAST), (BASE, PEER_KERNELS)]
    fig, ax = plt.subplots(figsize=(8.5, 1.2 + 1.15 * len(names)), dpi=90)
    ticks, seen = [], set()
    for i, s in enumerate(names):
        ref = _by_shape(endtoend, BASE, PLAIN)[s]["mixer_ms"]
        for j, (b, k) in enumerate(bars):
            r = _by_shape(endtoend, b, k).get(s)
            if r is None:
                continue
            y, peer = (len(bars) + 1.2) * i + j, k == PEER_KERNELS
            ssd_label = f"SSD, {LABEL[b]}"
            rest_label = "rest, mamba_ssm's Mamba2" if peer else f"rest, {LAYER[k]} layer"
            ax.barh(y, r["ssd_ms"] / ref, color=COLOR[b], height=0.85,
                    label=None if ssd_label in seen else ssd_label)
            ax.barh(y, r["rest_diff_ms"] / ref, left=r["ssd_ms"] / ref, height=0.85,
                    color="white" if peer else LAYER_COLOR[k], edgecolor="0.3" if peer else None,
                    hatch="//" if peer else None, label=None if rest_label in seen else rest_label)
            seen |= {ssd_label, rest_label}
            ax.plot([(r["ssd_ms"] + r["rest_floor_ms"]) / ref] * 2, [y - 0.42, y + 0.42],
                    color="k", lw=1.2)
            ax.text(r["mixer_ms"] / ref + 0.01, y, pct(r["share"]), va="center", fontsize=6.5)
            who = "Mamba2 module" if peer else f"{LAYER[k]}, {'ours' if b == NEW else 'mamba_ssm'}"
            ticks.append((y, f"{s}: {who}"))
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks], fontsize=6.5)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.2)
    ax.set_xlabel("mixer time / plain layer's with mamba_ssm's SSD\n(label: SSD share; tick: "
                  "SSD + the rest's floor)", fontsize=7.5)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("The same SSDs in a plain and a fast layer", fontsize=9)
    fig.tight_layout()
    return fig


def plot_amdahl(endtoend, shares=(0.05, 0.1, 0.2, 0.3, 0.5), k_max=4.0):
    """Amdahl's curves S(k) for a few shares s, with every measured point (our SSD's speedup k,
    the job's measured speedup S) of one mixer and of the prefill stacks, in each layer: the
    same k lands higher in the fast layer, whose SSD share is larger."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=90)
    k = np.linspace(1, k_max, 200)
    for s in shares:
        ax.plot(k, [amdahl(s, v) for v in k], color="0.75", lw=1)
        ax.text(k_max, amdahl(s, k_max), f" s = {s:.0%}", fontsize=7, va="center", color="0.4")
    for part, marker, what in (("share", "o", "one mixer"), ("prefill", "^", "prefill stack")):
        table = amdahl_layers(endtoend, part)
        for kern, name in LAYER.items():
            pts = table.where(kernels=kern)
            ax.scatter([a["kernel_speedup"] for a in pts], [a["measured"] for a in pts],
                       marker=marker, color=LAYER_COLOR[kern], edgecolors="k", linewidths=0.5,
                       s=30, zorder=3, label=f"{what}, {name} layer")
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xlim(1, k_max * 1.12)
    ax.set_xlabel("SSD speedup k (mamba_ssm time / ours, inside the job)", fontsize=8)
    ax.set_ylabel("job speedup S (measured)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("One kernel gain, two dilutions: curves predicted, points measured", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["LABEL", "LAYER", "PLAIN", "FAST", "REST_GOAL", "shapes", "amdahl_grid",
           "ssd_floor_ms", "floor_table", "projections_table", "layers_table", "amdahl_layers",
           "stack_table", "peer_table", "goals_table", "headlines", "plot_layers", "plot_amdahl"]
