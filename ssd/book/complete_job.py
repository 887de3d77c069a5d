"""Chapter 11's tables and figures: where a Mamba-2 mixer's time goes, and what a faster SSD
buys it end to end (Amdahl's law, checked against the measurement).

Every function takes the loaded recordings (``ssd.book.recordings.load_recorded``):
``endtoend`` is ``results/<gpu>/endtoend.json`` as ``python -m ssd.tools.endtoend`` writes it
(parts ``share``: one mixer per benchmark shape; ``prefill``: stacks of mixers over a prompt),
``models`` is the models suite (for the copy bandwidth and matmul rate it measured). Tables are
:class:`ssd.book.tables.Table` objects; figures are matplotlib ``Figure`` objects.
"""
from __future__ import annotations

import math

from ..tools.endtoend import BASE, NEW, amdahl, amdahl_rows
from .figures import paired_bars
from .tables import Table, pct

#: How the two SSD backends are named in tables and legends.
LABEL = {NEW: "ours (cuTile)", BASE: "mamba_ssm (Triton)"}
COLOR = {NEW: "C0", BASE: "C1"}
#: The fields that pair a base row with a new one in each part of ``endtoend.json``.
PREFILL_KEY = ("config", "n_layers", "batch", "seqlen")


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


# ----------------------------------------------------------------------------- the cost model


def layer_config(row):
    """The ``ssd.layer.Mamba2Config`` of a share row: its SSD dims and d_model (expand 2)."""
    from ..layer import Mamba2Config

    b, l, h, p, n, g = row["dims"]
    return Mamba2Config(d_model=row["d_model"], d_state=n, headdim=p, ngroups=g,
                        expand=h * p // row["d_model"], dtype=row.get("dtype", "bfloat16"))


def rest_costs(config, batch, seqlen, dtype_bytes=2) -> dict:
    """FLOPs and compulsory bytes of a mixer without its SSD, as two kernels' work.

    ``in_proj + conv1d``: the input projection and the depthwise causal convolution, reading
    u and the weights once and writing z, x, B, C and dt (the in_proj width); ``norm + out_proj``:
    the gated RMSNorm and the output projection, reading y and z and the weights once and
    writing the output. A projection of m tokens from width i to width o costs 2 m i o FLOPs;
    the elementwise work (SiLU, the norm) is not counted, as in ``ssd.cost``. With the SSD a
    kernel of its own, no layer can move fewer bytes or do fewer FLOPs than these.
    """
    c, t, e = config, batch * seqlen, dtype_bytes
    w_in = c.d_model * c.d_in_proj + c.conv_dim * (c.d_conv + 1)
    w_out = c.d_inner * c.d_model
    return {
        "in_proj + conv1d": dict(
            flops=2 * t * c.d_model * c.d_in_proj + 2 * t * c.conv_dim * c.d_conv,
            bytes=e * (t * c.d_model + w_in + t * c.d_in_proj)),
        "norm + out_proj": dict(flops=2 * t * c.d_inner * c.d_model,
                                bytes=e * (2 * t * c.d_inner + w_out + t * c.d_model)),
    }


def rest_floor_ms(config, batch, seqlen, ceilings) -> float:
    """The time floor of the rest of the mixer: each part of :func:`rest_costs` at
    max(bytes / copy bandwidth, FLOPs / bf16 matmul rate), summed (``ssd.cost.floor_ms``)."""
    from ..cost import floor_ms

    return sum(floor_ms(part, ceilings["copy_bytes_per_s"], ceilings["bf16_flops_per_s"])
               for part in rest_costs(config, batch, seqlen).values())


def ssd_floor_ms(dims, ceilings) -> float:
    """The SSD forward's floor on these dims (``ssd.tools.bench.floor_ms``)."""
    from ..tools.bench import Shape, floor_ms

    return floor_ms(Shape("", *dims), ceilings)["floor_ms"]


def cost_table(endtoend, models) -> Table:
    """Per shape, before any timing: the work of the rest of the mixer and of its SSD, their
    floors on this GPU (the ceilings the models suite measured), and the SSD's share of the
    mixer if both ran at their floors."""
    ceil = models["ceilings"]
    rows = []
    for r in _rows(endtoend["share"], NEW):
        cfg = layer_config(r)
        b, l = r["dims"][:2]
        parts = rest_costs(cfg, b, l)
        rest_floor, ssd_floor = rest_floor_ms(cfg, b, l, ceil), ssd_floor_ms(r["dims"], ceil)
        rows.append(dict(shape=r["shape"], d_model=r["d_model"], tokens=b * l,
                         rest_gflop=sum(p["flops"] for p in parts.values()) / 1e9,
                         rest_mb=sum(p["bytes"] for p in parts.values()) / 1e6,
                         rest_floor_ms=rest_floor, ssd_floor_ms=ssd_floor,
                         share_at_floors=ssd_floor / (ssd_floor + rest_floor)))
    return Table(rows, dict(shape="shape", d_model="d_model", tokens="tokens",
                            rest_gflop="rest GFLOP", rest_mb="rest MB",
                            rest_floor_ms="rest floor ms", ssd_floor_ms="SSD floor ms",
                            share_at_floors="SSD share at the floors"),
                 dict(rest_gflop="{:.0f}", rest_mb="{:.0f}", rest_floor_ms="{:.3f}",
                      ssd_floor_ms="{:.3f}", share_at_floors=pct))


# ----------------------------------------------------------------------------- the mixer


def _rows(part, backend=None):
    return [r for r in part["rows"] if backend is None or r["backend"] == backend]


def time_split(endtoend) -> Table:
    """One row per shape and backend: the mixer's time, its SSD call's, the rest's (the mixer
    with its SSD replaced by a stub that only allocates y), the SSD's share, and how much of
    the mixer the two parts timed alone leave unexplained (mixer - rest - SSD, over mixer)."""
    rows = []
    for r in _rows(endtoend["share"]):
        rows.append(dict(shape=r["shape"], backend=LABEL.get(r["backend"], r["backend"]),
                         key=r["backend"], dims=tuple(r["dims"]), chunk=r["chunk_size"],
                         mixer_ms=r["mixer_ms"], ssd_ms=r["ssd_ms"], rest_ms=r["rest_ms"],
                         share=r["share"],
                         unexplained=(r["mixer_ms"] - r["rest_ms"] - r["ssd_ms"]) / r["mixer_ms"]))
    return Table(rows, dict(shape="shape", dims="(b, l, h, p, n, g)", backend="SSD",
                            chunk="chunk", mixer_ms="mixer ms", ssd_ms="SSD ms",
                            rest_ms="rest ms", share="SSD share", unexplained="unexplained"),
                 dict(mixer_ms="{:.3f}", ssd_ms="{:.3f}", rest_ms="{:.3f}", share=pct,
                      unexplained=lambda v: f"{100 * v:+.2f}\u00a0%"))


def amdahl_table(endtoend, part="share") -> Table:
    """Amdahl's prediction next to the measurement, recomputed from the rows of ``part``
    with ``ssd.tools.endtoend.amdahl_rows``: the SSD's share s of the old job (the layer with
    mamba_ssm's SSD), the SSD's speedup k inside it, predicted and measured speedup of the
    job, and the bound 1 / (1 - s)."""
    if part == "share":
        rows = amdahl_rows(endtoend["share"]["rows"])
    else:
        rows = amdahl_rows(endtoend["prefill"]["rows"], key=PREFILL_KEY, total="latency_ms",
                           part="ssd_ms_total")
    for a in rows:
        a["error"] = a["measured"] - a["predicted"]
    heads = {"shape": "shape"} if part == "share" else dict(
        config="preset", n_layers="layers", batch="batch", seqlen="seqlen")
    heads.update(share="share s", kernel_speedup="SSD speedup k", predicted="predicted S",
                 measured="measured S", error="measured - predicted", max_possible="bound")
    return Table(rows, heads, dict(share=pct, kernel_speedup="{:.2f}x", predicted="{:.3f}x",
                                   measured="{:.3f}x", max_possible="{:.2f}x",
                                   error=lambda v: f"{v:+.3f}"))


def prefill_table(endtoend) -> Table:
    """The prefill grid: per stack and prompt, both backends' latency, the SSD's share s of
    the old stack (mamba_ssm's SSD in every layer), the SSD's speedup k inside it, and
    Amdahl's predicted stack speedup next to the measured one."""
    part = endtoend["prefill"]
    latency = {(tuple(r[k] for k in PREFILL_KEY), r["backend"]): r["latency_ms"]
               for r in part["rows"]}
    rows = []
    for a in amdahl_table(endtoend, "prefill"):
        k = tuple(a[f] for f in PREFILL_KEY)
        rows.append(dict(a, tokens=a["batch"] * a["seqlen"], base_ms=latency[(k, BASE)],
                         new_ms=latency[(k, NEW)], stack=f"{a['config']}, {a['n_layers']} layers",
                         prompts=f"{a['batch']} x {a['seqlen']}"))
    return Table(rows, dict(stack="stack", prompts="prompts x tokens",
                            base_ms="mamba_ssm ms", new_ms="ours ms", share="share s",
                            kernel_speedup="SSD speedup k", predicted="predicted S",
                            measured="measured S"),
                 dict(base_ms="{:.2f}", new_ms="{:.2f}", share=pct, kernel_speedup="{:.2f}x",
                      predicted="{:.3f}x", measured="{:.3f}x"))


def rest_floor_table(endtoend, models) -> Table:
    """How far the rest of the mixer is from its floor, and what our SSD's lead could buy a
    mixer whose rest ran at that floor: the rest cannot be faster, so the SSD's share of the
    old mixer could be at most ssd_base / (ssd_base + rest floor), and Amdahl's law with the
    measured SSD speedup k bounds the mixer's speedup by that share."""
    ceil = models["ceilings"]
    base = {r["shape"]: r for r in _rows(endtoend["share"], BASE)}
    measured = {a["shape"]: a for a in amdahl_rows(endtoend["share"]["rows"])}
    rows = []
    for r in _rows(endtoend["share"], NEW):
        b, l = r["dims"][:2]
        floor = rest_floor_ms(layer_config(r), b, l, ceil)
        m = base[r["shape"]]
        k = m["ssd_ms"] / r["ssd_ms"]
        share_at_floor = m["ssd_ms"] / (m["ssd_ms"] + floor)
        rows.append(dict(shape=r["shape"], rest_ms=r["rest_ms"], rest_floor_ms=floor,
                         over_floor=r["rest_ms"] / floor, k=k,
                         measured=measured[r["shape"]]["measured"],
                         share_at_floor=share_at_floor, s_at_floor=amdahl(share_at_floor, k)))
    return Table(rows, dict(shape="shape", rest_ms="rest ms", rest_floor_ms="rest floor ms",
                            over_floor="rest / floor", k="SSD speedup k",
                            measured="mixer S measured", share_at_floor="share s, rest at floor",
                            s_at_floor="S, rest at floor"),
                 dict(rest_ms="{:.3f}", rest_floor_ms="{:.3f}", over_floor="{:.1f}x",
                      k="{:.2f}x", measured="{:.3f}x", share_at_floor=pct,
                      s_at_floor="{:.2f}x"))


# ----------------------------------------------------------------------------- figures


def plot_time_split(endtoend):
    """Stacked bars, one pair per shape: the SSD and the rest of the mixer, each backend,
    in units of the mamba_ssm mixer's time; the label is the SSD's share."""
    split = time_split(endtoend)
    row = {(r["shape"], r["key"]): r for r in split}
    groups = []
    for s in dict.fromkeys(split.column("shape")):
        ref, bars = row[(s, BASE)]["mixer_ms"], []
        for b in (BASE, NEW):
            r = row[(s, b)]
            bars.append((f"{s}, {'ours' if b == NEW else 'mamba_ssm'}",
                         [(r["ssd_ms"] / ref, dict(color=COLOR[b], label=f"SSD, {LABEL[b]}")),
                          ((r["mixer_ms"] - r["ssd_ms"]) / ref,
                           dict(color="0.8", label="rest of the mixer (PyTorch)"))],
                         pct(r["share"])))
        groups.append(bars)
    return paired_bars(groups, xlim=1.15, height=3.0,
                       xlabel="mixer forward time / mamba_ssm mixer's (label: SSD share)",
                       title="Where one Mamba-2 mixer's time goes")


def plot_amdahl(endtoend, shares=(0.05, 0.1, 0.15, 0.2, 0.3), k_max=4.0):
    """Amdahl's curves S(k) for a few shares s, with every measured point (SSD speedup k,
    job speedup S) of the mixer and the prefill stacks, coloured by its own share: a point
    on the curve of its colour is a job that behaved as the law predicts."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib import cm, colors

    mixer, stack = amdahl_table(endtoend, "share"), amdahl_table(endtoend, "prefill")
    lo = min(min(shares), *mixer.column("share"), *stack.column("share"))
    hi = max(max(shares), *mixer.column("share"), *stack.column("share"))
    norm, cmap = colors.Normalize(lo, hi), plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=90)
    k = np.linspace(1, k_max, 200)
    for s in shares:
        ax.plot(k, [amdahl(s, v) for v in k], color=cmap(norm(s)), lw=1)
        ax.text(k_max, amdahl(s, k_max), f" s = {s:.0%}", fontsize=7, va="center",
                color=cmap(norm(s)))
    layers = "/".join(str(n) for n in sorted(set(stack.column("n_layers"))))
    for table, marker, label in ((mixer, "o", "one mixer"),
                                 (stack, "^", f"{layers}-layer prefill")):
        ax.scatter(table.column("kernel_speedup"), table.column("measured"), marker=marker,
                   c=[cmap(norm(s)) for s in table.column("share")], edgecolors="k",
                   linewidths=0.5, s=30, zorder=3, label=label)
    ax.axhline(1, color="k", lw=0.5)
    ax.set_xlim(1, k_max * 1.12)
    ax.set_xlabel("SSD speedup k (mamba_ssm time / ours, inside the job)", fontsize=8)
    ax.set_ylabel("job speedup S (measured)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7, loc="upper left")
    fig.colorbar(cm.ScalarMappable(norm, cmap), ax=ax, pad=0.1).set_label(
        "share s of the SSD in the old job", fontsize=7)
    ax.set_title("Amdahl's law: curves predicted, points measured", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["LABEL", "amdahl_grid", "rest_costs", "rest_floor_ms", "ssd_floor_ms", "cost_table",
           "time_split", "amdahl_table", "prefill_table", "rest_floor_table", "plot_time_split",
           "plot_amdahl"]
