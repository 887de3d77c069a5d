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
