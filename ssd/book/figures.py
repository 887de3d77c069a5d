"""Compact figures for the stored notebooks: matplotlib figures rendered as palette PNGs.

A line plot rendered by the inline backend is a 24-bit RGBA PNG of 30-60 KB; the book stores
every output in the notebook, and the checkout travels to the GPU machine, so that adds up.
Plots have a handful of colours: quantized to a 64-colour palette they are 3-4x smaller and
look the same. Call :func:`compact_figures` once, after ``import matplotlib.pyplot``.
"""
from __future__ import annotations

import io


def png_bytes(fig, colors: int = 64, dpi: float | None = None) -> bytes:
    """``fig`` as a palette PNG of at most ``colors`` colours (tight bounding box)."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=dpi or fig.dpi,
                facecolor="white")
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=colors)
    out = io.BytesIO()
    img.save(out, format="png", optimize=True)
    return out.getvalue()


def compact_figures(colors: int = 64) -> bool:
    """Make IPython render matplotlib figures with :func:`png_bytes`; False outside IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    if shell is None:
        return False
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    # Resolve the backend now: the inline backend registers its own PNG formatter when it is
    # first loaded, which would replace ours if that happened later.
    plt.close(plt.figure())
    formatter = shell.display_formatter.formatters["image/png"]
    formatter.for_type(Figure, lambda fig: png_bytes(fig, colors))
    return True


def paired_bars(groups, *, xlim: float, xlabel: str, title: str, height: float = 2.9,
                ncol: int = 3):
    """Horizontal stacked bars, a few to a group (one group a shape, one bar a backend).

    ``groups``: a list of groups, each a list of bars ``(tick, segments, note)``: ``tick`` the
    bar's y label, ``segments`` a list of ``(width, style)`` stacked from 0 (``style``: barh
    keywords, e.g. color, alpha and label, the legend entry; a label repeated on later bars is
    shown once), ``note`` the text printed after the bar. Returns the figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, height), dpi=90)
    ticks = []
    for i, bars in enumerate(groups):
        for j, (tick, segments, note) in enumerate(bars):
            y, left = 2.6 * i + j, 0.0
            for width, style in segments:
                ax.barh(y, width, left=left, height=0.85, **style)
                left += width
            ax.text(left + 0.01, y, note, va="center", fontsize=7)
            ticks.append((y, tick))
    ax.set_yticks([y for y, _ in ticks], [t for _, t in ticks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, xlim)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    handles, labels = ax.get_legend_handles_labels()
    legend = dict(zip(labels, handles))  # the first bar of each label
    ax.legend(legend.values(), legend.keys(), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.45, -0.2), ncol=ncol)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
