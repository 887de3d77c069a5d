"""mamba_ssm's Triton kernels, imported without its package ``__init__`` getting in the way.

The layer (:mod:`ssd.layer`) runs mamba_ssm's SSD forward and decode step as a backend, and the
tools measure against them and against its ``Mamba2`` module (:mod:`ssd.tools.peers`). mamba_ssm
2.3.2.post1's package ``__init__`` imports its compiled CUDA extension (``selective_scan_cuda``)
and fails wherever that was not built, although the Triton kernels need none of it.
:func:`mamba_ssm_module` then registers a bare ``mamba_ssm`` package whose ``__path__`` points at
the installed sources, and imports only the submodule asked for.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

__all__ = ["PeerUnavailable", "mamba_ssm_module", "mamba_ssm_forward", "mamba_ssm_state_update"]


class PeerUnavailable(ImportError):
    """A peer implementation is not installed or cannot be imported here."""


def mamba_ssm_module(qualified: str):
    """The mamba_ssm submodule ``qualified`` (e.g. "mamba_ssm.ops.triton.ssd_combined"), imported
    through a bare ``mamba_ssm`` package where the real package ``__init__`` fails.

    Raises:
        PeerUnavailable: mamba_ssm is not installed, or the submodule cannot be imported.
    """
    try:
        return importlib.import_module(qualified)
    except ImportError as first:
        if getattr(sys.modules.get("mamba_ssm"), "__file__", False) is None:
            # Already the bare package: the submodule itself fails (a dependency missing). Keep
            # the submodules loaded so far; the layer and the autotuner reset hold on to them.
            raise PeerUnavailable(f"mamba_ssm's {qualified} cannot be imported: {first}") from first
        spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
        if spec is None and "mamba_ssm" not in sys.modules:
            raise PeerUnavailable(
                "mamba_ssm is not installed: `pip install mamba-ssm --no-build-isolation` "
                "(its Triton kernels need only torch and triton; set MAMBA_SKIP_CUDA_BUILD=TRUE "
                "to skip the CUDA extension)") from first
        # The package __init__ failed (no CUDA extension): drop the half-imported modules and
        # stand in a bare package so that only the submodules asked for are imported.
        path = (spec.submodule_search_locations if spec is not None
                else sys.modules["mamba_ssm"].__path__)
        for loaded in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
            del sys.modules[loaded]
        bare = types.ModuleType("mamba_ssm")
        bare.__path__, bare.__file__ = list(path), None  # no file: how a later call knows it
        sys.modules["mamba_ssm"] = bare
        try:
            return importlib.import_module(qualified)
        except ImportError as exc:
            raise PeerUnavailable(f"mamba_ssm's {qualified} cannot be imported: {exc}") from exc


def _triton(module: str, name: str):
    """``name`` from mamba_ssm's Triton submodule ``mamba_ssm.ops.triton.<module>``."""
    return getattr(mamba_ssm_module(f"mamba_ssm.ops.triton.{module}"), name)


def mamba_ssm_forward():
    """Return mamba_ssm's Triton ``mamba_chunk_scan_combined`` (same signature as ours)."""
    return _triton("ssd_combined", "mamba_chunk_scan_combined")


def mamba_ssm_state_update():
    """Return mamba_ssm's Triton ``selective_state_update``, the decode step (same signature as
    :func:`ssd.selective_state_update` without its keyword-only arguments)."""
    return _triton("selective_state_update", "selective_state_update")
