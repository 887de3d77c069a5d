"""Helpers for the GPU chapters: run live on a GPU, replay the recorded run elsewhere.

A GPU chapter computes its numbers with :func:`live_or_recorded`: on a machine with an NVIDIA
GPU and cuTile it runs the measurement, stores the result (with the environment record) as
``results/<gpu>/<name>.json`` and returns it; on any other machine (CI, a laptop) it loads the
recorded file and says so. Either way the cells after it draw tables and plots from the same
dictionary, so the book always shows numbers from a real GPU run, never typed-in ones.
"""
from __future__ import annotations

import functools
from pathlib import Path

from ..tools.env import (BOOK_GPU, RESULTS, ROOT, environment, gpu_slug, is_packed, read_json,
                         unpack_rows, write_json)

DEFAULT_GPU = BOOK_GPU  # where the book's recorded results come from


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    """True when torch sees a CUDA GPU and cuda.tile imports (the GPU chapters can run live)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cuda.tile  # noqa: F401
    except Exception:
        return False
    return True


def result_path(name: str, gpu: str | None = None) -> Path:
    """``results/<gpu>/<name>.json``, or its gzipped form ``.json.gz`` where that exists."""
    path = RESULTS / (gpu or DEFAULT_GPU) / f"{name}.json"
    packed = path.with_name(path.name + ".gz")
    return packed if packed.is_file() else path


def load_recorded(name: str, gpu: str | None = None) -> dict:
    """The recording ``results/<gpu>/<name>.json``: by default this machine's GPU's own
    recording when it has one, else the book's (``DEFAULT_GPU``)."""
    if gpu is None and gpu_available():
        import torch

        slug = gpu_slug({"gpu": torch.cuda.get_device_name()})
        gpu = slug if result_path(name, slug).is_file() else None
    path = result_path(name, gpu)
    if not path.is_file():
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        raise FileNotFoundError(f"{shown}: no recorded result; run this chapter "
                                "on a GPU once (see the Reproducibility chapter)")
    record = read_json(path)
    # tables of rows written by ssd.tools.env.pack_rows come back as rows of dicts
    return {k: unpack_rows(v) if is_packed(v) else v for k, v in record.items()}


def live_or_recorded(name: str, measure, *, force_recorded: bool = False) -> dict:
    """Run ``measure()`` (-> JSON-able dict) on a GPU and record it, else load the recording.

    The returned dict always has ``environment`` (where the numbers were measured) and
    ``source`` ("live" or "recorded").
    """
    if gpu_available() and not force_recorded:
        payload = dict(measure())
        payload["environment"] = environment()
        write_json(result_path(name, gpu_slug(payload["environment"])), payload)
        payload["source"] = "live"
        print(f"Measured live on {payload['environment'].get('gpu')}; "
              f"recorded to results/{gpu_slug(payload['environment'])}/{name}.json")
        return payload
    payload = load_recorded(name)
    payload["source"] = "recorded"
    env = payload.get("environment", {})
    print(f"No GPU here: showing the run recorded on {env.get('gpu')} ({env.get('date')}, "
          f"git {env.get('git_revision')}) from results/{DEFAULT_GPU}/{name}.json")
    return payload


def glue(name: str, value, display: bool = True) -> None:
    """``myst_nb.glue`` without importing myst_nb (the GPU machine has no Sphinx stack).

    Emits the same display output myst_nb's glue does (a mimebundle tagged with
    ``metadata["scrapbook"]``), which the book build reads from the stored notebook. A string is
    pasted as its repr, so it may hold no markup (backticks) and no apostrophe, which would make
    the repr's quotes double and visible in the text. A NumPy scalar is stored as the Python
    number it holds: its repr (``np.float64(...)``) is not a number the book can format.
    """
    import numpy as np

    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, str) and ("'" in value or "`" in value):
        raise ValueError(f"glue {name!r}: a glued string renders as plain text in its repr; "
                         f"drop the apostrophe or backtick from {value!r}")
    import IPython
    from IPython.display import display as ipy_display

    bundle, metadata = IPython.core.formatters.format_display_data(value)
    prefix = "" if display else "application/papermill.record/"
    metadata["scrapbook"] = dict(name=name, mime_prefix=prefix)
    ipy_display({prefix + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


