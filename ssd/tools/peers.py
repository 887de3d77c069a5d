"""The implementations we measure against, loaded without their packaging getting in the way.

* mamba_ssm's Triton SSD, ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, and
  its decode step, ``mamba_ssm.ops.triton.selective_state_update.selective_state_update``.
  mamba_ssm 2.3.2.post1's package ``__init__`` imports its compiled CUDA extension
  (``selective_scan_cuda``) and fails wherever that was not built, although the Triton kernels
  need none of it. :func:`mamba_ssm_forward` and :func:`mamba_ssm_state_update` then register a
  bare ``mamba_ssm`` package whose ``__path__`` points at the installed sources, and import
  only the Triton submodule.
* TileGym's cuTile Mamba-2, ``tilegym.ops.cutile.mamba2.mamba2_chunk_forward(x, a, b, c, d,
  dt, init_state, chunk_size)``: dt already positive (no bias, no softplus), D per head,
  initial state required, sequence length a multiple of the chunk size. Autotuning is on
  unless ``TILEGYM_DISABLE_AUTOTUNE=1`` is set before the first call; :func:`tilegym_replaying`
  replays a recorded tuning run's choices instead of searching again.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types


class PeerUnavailable(ImportError):
    """A peer implementation is not installed or cannot be imported here."""


def _mamba_ssm_triton(module: str, name: str):
    """``name`` from mamba_ssm's Triton submodule ``mamba_ssm.ops.triton.<module>``."""
    qualified = f"mamba_ssm.ops.triton.{module}"
    try:
        return getattr(importlib.import_module(qualified), name)
    except ImportError as first:
        spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
        if spec is None and "mamba_ssm" not in sys.modules:
            raise PeerUnavailable(
                "mamba_ssm is not installed: `pip install mamba-ssm --no-build-isolation` "
                "(its Triton kernels need only torch and triton; set MAMBA_SKIP_CUDA_BUILD=TRUE "
                "to skip the CUDA extension)") from first
        # The package __init__ failed (no CUDA extension): drop the half-imported modules and
        # stand in a bare package so that only the pure-Triton submodules are imported.
        path = (spec.submodule_search_locations if spec is not None
                else sys.modules["mamba_ssm"].__path__)
        for loaded in [m for m in sys.modules if m == "mamba_ssm" or m.startswith("mamba_ssm.")]:
            del sys.modules[loaded]
        bare = types.ModuleType("mamba_ssm")
        bare.__path__ = list(path)
        sys.modules["mamba_ssm"] = bare
        try:
            return getattr(importlib.import_module(qualified), name)
        except ImportError as exc:
            raise PeerUnavailable(f"mamba_ssm's Triton {module} cannot be imported: {exc}") from exc


def mamba_ssm_forward():
    """Return mamba_ssm's Triton ``mamba_chunk_scan_combined`` (same signature as ours)."""
    return _mamba_ssm_triton("ssd_combined", "mamba_chunk_scan_combined")


def mamba_ssm_state_update():
    """Return mamba_ssm's Triton ``selective_state_update``, the decode step (same signature as
    :func:`ssd.selective_state_update` without its keyword-only arguments)."""
    return _mamba_ssm_triton("selective_state_update", "selective_state_update")


def _mamba_ssm_autotuners():
    """(name, triton Autotuner) for every autotuned kernel of mamba_ssm's imported Triton modules."""
    from triton.runtime.autotuner import Autotuner

    for name, module in list(sys.modules.items()):
        if not name.startswith("mamba_ssm.ops.triton.") or module is None:
            continue
        for attr, obj in vars(module).items():
            if isinstance(obj, Autotuner):
                yield f"{name.rsplit('.', 1)[-1]}.{attr}", obj


def retune_mamba_ssm() -> int:
    """Forget every configuration mamba_ssm's Triton kernels have chosen in this process, so
    that each one tunes again on the next problem it gets; return how many kernels were reset.

    Their ``triton.autotune`` keys are the chunk size, head dim and state size (and the head
    count for chunk_cumsum), not the batch or the sequence length: without this, the first
    shape a process runs picks the configuration that every later shape with the same key
    reuses, tuned or not for it. The benchmark calls this before each shape's first mamba_ssm
    call, so the peer is timed with configurations chosen for the shape being timed.
    """
    reset = 0
    for _, tuner in _mamba_ssm_autotuners():
        if tuner.cache:
            tuner.cache.clear()
            reset += 1
    return reset


def mamba_ssm_configs() -> dict:
    """kernel -> {autotune key: chosen configuration}, as strings, for every mamba_ssm kernel
    that has tuned in this process: what the peer ran with, recorded beside its times."""
    return {name: {str(key): str(config) for key, config in tuner.cache.items()}
            for name, tuner in _mamba_ssm_autotuners() if tuner.cache}


def tilegym_configs() -> dict:
    """kernel -> [chosen configuration, as a string] for every TileGym Mamba-2 kernel that has
    chosen one in this process (tuned, or its untuned first configuration): the module keeps
    one ``_<kernel>_tune_cache`` dict per kernel whose values start with the configuration.
    Empty when TileGym was never imported."""
    module = sys.modules.get("tilegym.ops.cutile.mamba2")
    if module is None:
        return {}
    return {name.removeprefix("_").removesuffix("_tune_cache"): [str(v[0]) for v in cache.values()]
            for name, cache in vars(module).items()
            if name.endswith("_tune_cache") and isinstance(cache, dict) and cache}


@contextlib.contextmanager
def tilegym_replaying(chosen: dict):
    """Within the block, TileGym's autotuning takes for each of its kernels the configuration a
    recorded tuning run chose, instead of timing every candidate: ``chosen`` maps kernel to
    [configuration string], as :func:`tilegym_configs` records them. Everything else is TileGym's
    own code path (its candidates, its cache, its launch with the chosen configuration's hints),
    so the forward runs as that tuning left it, minus the minutes of search. A recorded
    configuration must be exactly one of the candidates TileGym offers: a TileGym whose search
    space changed raises :class:`PeerUnavailable`. Autotuning must be on
    (``TILEGYM_DISABLE_AUTOTUNE`` unset), or TileGym takes its first candidate without asking."""
    tilegym_forward()  # TileGym importable, or PeerUnavailable
    module = sys.modules["tilegym.ops.cutile.mamba2"]
    wanted = {config for configs in chosen.values() for config in configs}
    search = module.exhaustive_search

    def replay(configs, *args, **kwargs):
        hits = [c for c in configs if str(c) in wanted]
        if len(hits) != 1:
            raise PeerUnavailable(f"TileGym replay: {len(hits)} of its {len(configs)} candidate "
                                  f"configurations match the recorded ones {sorted(wanted)}; "
                                  "a TileGym with another search space?")
        return types.SimpleNamespace(best=types.SimpleNamespace(config=hits[0]))

    module.exhaustive_search = replay
    try:
        yield
    finally:
        module.exhaustive_search = search


def mamba_ssm_version() -> str | None:
    """The installed mamba_ssm version, also for a source tree on PYTHONPATH (no metadata)."""
    import re
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mamba_ssm")
    except PackageNotFoundError:
        spec = importlib.util.find_spec("mamba_ssm") if "mamba_ssm" not in sys.modules else None
        paths = spec.submodule_search_locations if spec else getattr(sys.modules.get("mamba_ssm"), "__path__", [])
        for path in paths or []:
            init = os.path.join(path, "__init__.py")
            if os.path.isfile(init):
                match = re.search(r'__version__\s*=\s*["\']([^"\']+)', open(init).read())
                return match.group(1) if match else None
        return None


def tilegym_forward():
    """Return TileGym's cuTile ``mamba2_chunk_forward``."""
    try:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_forward
    except Exception as exc:  # tilegym imports much at package level; any failure means absent
        raise PeerUnavailable(f"TileGym's cuTile Mamba-2 is unavailable: `pip install tilegym` "
                              f"({type(exc).__name__}: {exc})") from exc
    return mamba2_chunk_forward


def tilegym_adapter(forward=None):
    """TileGym's forward behind our argument names: ``f(x, dt, A, B, C, chunk_size, D=None,
    initial_states=None) -> (y, final_states)``; dt must already be positive."""
    forward = forward or tilegym_forward()

    def run(x, dt, A, B, C, chunk_size, D=None, initial_states=None):
        import torch

        b, l, h, p = x.shape
        if l % chunk_size:
            raise ValueError(f"x: TileGym needs seqlen % chunk_size == 0, got {l} % {chunk_size}")
        if D is None:
            D = torch.zeros(h, device=x.device, dtype=torch.float32)
        if initial_states is None:
            initial_states = torch.zeros(b, h, p, B.shape[-1], device=x.device, dtype=torch.float32)
        return forward(x, A, B, C, D, dt, initial_states, chunk_size)

    return run
