"""The implementations we measure against, loaded without their packaging getting in the way.

* mamba_ssm's Triton SSD, ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``, and
  its decode step, ``mamba_ssm.ops.triton.selective_state_update.selective_state_update``
  (:func:`mamba_ssm_forward`, :func:`mamba_ssm_state_update`: the layer's backend loader,
  :mod:`ssd.mamba_ssm_loader`, re-exported here), with the configurations its autotuner chose.
* mamba_ssm's own Mamba-2 module, ``mamba_ssm.modules.mamba2.Mamba2`` (:func:`mamba_ssm_mixer`),
  the peer of the whole layer, and which conv and norm it runs here.
* TileGym's cuTile Mamba-2, ``tilegym.ops.cutile.mamba2.mamba2_chunk_forward(x, a, b, c, d,
  dt, init_state, chunk_size)``: dt already positive (no bias, no softplus), D per head,
  initial state required, sequence length a multiple of the chunk size. Autotuning is on
  unless ``TILEGYM_DISABLE_AUTOTUNE=1`` is set before the first call; :func:`tilegym_replaying`
  replays a recorded tuning run's choices instead of searching again.
* TileGym's cuTile Mamba-2 backward, ``mamba2_chunk_backward(x, a, b, c, d, dt, init_state,
  dout, dfinal_state, chunk_size)`` -> (dx, da, db, dc, dd, ddt, dinit_state), which TileGym
  wraps in no ``torch.autograd.Function``: :func:`tilegym_training_adapter` does, behind the
  signature of ``mamba_chunk_scan_combined``.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import types

from ..mamba_ssm_loader import (PeerUnavailable, mamba_ssm_forward, mamba_ssm_module,
                                mamba_ssm_state_update)

__all__ = ["PeerUnavailable", "mamba_ssm_forward", "mamba_ssm_state_update", "MAMBA2_MODULE",
           "mamba_ssm_mixer", "mamba_ssm_mixer_ssd", "retune_mamba_ssm", "mamba_ssm_configs",
           "tilegym_configs", "tilegym_replaying", "mamba_ssm_version", "tilegym_forward",
           "tilegym_adapter", "tilegym_backward", "tilegym_autotune", "retune_tilegym",
           "tilegym_training_adapter", "TILEGYM_CHUNK"]


#: mamba_ssm's Mamba-2 module, the peer of the whole layer.
MAMBA2_MODULE = "mamba_ssm.modules.mamba2"
#: The parameters ``ssd.layer.Mamba2Mixer`` and mamba_ssm's ``Mamba2`` share, by the same names.
_MIXER_PARAMETERS = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D",
                     "norm.weight", "out_proj.weight")
_NORM = "Triton gated RMSNorm (mamba_ssm.ops.triton.layernorm_gated)"


def mamba_ssm_mixer(mixer):
    """mamba_ssm's own ``Mamba2`` module with the sizes and weights of ``mixer`` (an
    ``ssd.layer.Mamba2Mixer``), on its device, for inference, and the path it takes here.

    ``Mamba2`` fuses the conv, the SSD and the gated norm into one call
    (``mamba_split_conv1d_scan_combined``, its default ``use_mem_eff_path``) only where the
    ``causal_conv1d`` package's CUDA conv loads; elsewhere it is built with
    ``use_mem_eff_path=False``: its conv is ``causal_conv1d_fn`` if that loads, else
    ``nn.Conv1d`` over the transposed xBC and a SiLU, then its Triton SSD and its Triton gated
    RMSNorm. A_log, dt_bias, D and the norm weight stay in fp32 as ours (mamba_ssm would round
    A_log and dt_bias to the model dtype), so both modules compute the same function.

    Returns:
        (module, path): ``path`` = dict(fused, conv, norm, ssd) saying what runs.
    Raises:
        PeerUnavailable: mamba_ssm (or its module's imports: einops, huggingface_hub) is
            missing, or its Mamba2 names its parameters otherwise.
    """
    import torch

    module = mamba_ssm_module(MAMBA2_MODULE)
    combined = mamba_ssm_module("mamba_ssm.ops.triton.ssd_combined")
    fused = getattr(combined, "causal_conv1d_fwd_function", None) is not None
    cfg, weight = mixer.config, mixer.in_proj.weight
    peer = module.Mamba2(d_model=cfg.d_model, d_state=cfg.d_state, d_conv=cfg.d_conv,
                         expand=cfg.expand, headdim=cfg.headdim, ngroups=cfg.ngroups,
                         chunk_size=mixer.ssd.chunk_size, dt_limit=mixer.ssd.dt_limit,
                         use_mem_eff_path=fused, device=weight.device, dtype=weight.dtype)
    ours, theirs = mixer.state_dict(), dict(peer.named_parameters())
    if set(theirs) != set(_MIXER_PARAMETERS):
        raise PeerUnavailable(f"mamba_ssm's Mamba2 has the parameters {sorted(theirs)}, expected "
                              f"{sorted(_MIXER_PARAMETERS)}: another mamba_ssm version?")
    with torch.no_grad():
        for name, param in theirs.items():
            param.data = ours[name].detach().clone()  # ours' dtype: fp32 for the small ones
    peer.requires_grad_(False).eval()
    # Said without apostrophes: the book pastes these strings into its prose.
    if fused:
        conv = ("the CUDA conv of causal_conv1d inside mamba_split_conv1d_scan_combined (conv, "
                "SSD and gated norm in one call)")
    elif getattr(module, "causal_conv1d_fn", None) is not None:
        conv = "causal_conv1d_fn (the CUDA conv of the causal_conv1d package)"
    else:
        conv = "nn.Conv1d over transposed xBC, then SiLU (causal_conv1d not installed)"
    return peer, dict(fused=fused, conv=conv, norm=_NORM,
                      ssd="Triton mamba_chunk_scan_combined" + (" (inside the fused call)"
                                                                if fused else ""))


@contextlib.contextmanager
def mamba_ssm_mixer_ssd(fn):
    """Inside the block mamba_ssm's unfused ``Mamba2`` forward calls ``fn`` (the signature of
    ``mamba_chunk_scan_combined``) for its SSD: to capture the tensors it passes, or to time it
    without its SSD. The fused path (``mamba_split_conv1d_scan_combined``) is not affected."""
    module = mamba_ssm_module(MAMBA2_MODULE)
    saved = module.mamba_chunk_scan_combined
    module.mamba_chunk_scan_combined = fn
    try:
        yield
    finally:
        module.mamba_chunk_scan_combined = saved


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


def _tilegym_caches() -> dict:
    """kernel -> its ``_<kernel>_tune_cache`` dict in TileGym's Mamba-2 module (empty when
    TileGym was never imported): each key ends with whether autotuning was disabled, each
    value starts with the configuration chosen."""
    module = sys.modules.get("tilegym.ops.cutile.mamba2")
    if module is None:
        return {}
    return {name.removeprefix("_").removesuffix("_tune_cache"): cache
            for name, cache in vars(module).items()
            if name.endswith("_tune_cache") and isinstance(cache, dict)}


def tilegym_configs(tuned=None) -> dict:
    """kernel -> [chosen configuration, as a string] for every TileGym Mamba-2 kernel that has
    chosen one in this process: tuned ones (``tuned=True``), untuned ones, its first candidate
    (``tuned=False``), or both (None). Empty when TileGym was never imported."""
    out = {}
    for name, cache in _tilegym_caches().items():
        chosen = [str(v[0]) for k, v in cache.items() if tuned is None or k[-1] is not tuned]
        if chosen:
            out[name] = chosen
    return out


def retune_tilegym() -> int:
    """Forget every configuration TileGym's Mamba-2 kernels have chosen in this process (its
    caches are keyed by shape, so this only matters for recording them): what
    :func:`tilegym_configs` returns next is the next shape's. Returns how many were reset."""
    reset = 0
    for cache in _tilegym_caches().values():
        if cache:
            cache.clear()
            reset += 1
    return reset


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


#: TileGym's default chunk size, the one the suites run it at.
TILEGYM_CHUNK = 64
#: The switch TileGym reads at each call (its caches are keyed by it as well).
TILEGYM_AUTOTUNE_ENV = "TILEGYM_DISABLE_AUTOTUNE"


def tilegym_backward():
    """Return TileGym's cuTile ``(mamba2_chunk_forward, mamba2_chunk_backward)``."""
    try:
        from tilegym.ops.cutile.mamba2 import mamba2_chunk_backward, mamba2_chunk_forward
    except Exception as exc:  # tilegym imports much at package level; any failure means absent
        raise PeerUnavailable(f"TileGym's cuTile Mamba-2 backward is unavailable: `pip install "
                              f"tilegym` ({type(exc).__name__}: {exc})") from exc
    return mamba2_chunk_forward, mamba2_chunk_backward


@contextlib.contextmanager
def tilegym_autotune(tuned: bool):
    """Within the block TileGym autotunes (``tuned``: an exhaustive search over its candidates
    at a kernel's first call of a shape) or takes each kernel's first candidate; the variable is
    restored after. TileGym reads it at every call and keys its caches by it, so untuned and
    tuned configurations live side by side in one process."""
    saved = os.environ.get(TILEGYM_AUTOTUNE_ENV)
    os.environ[TILEGYM_AUTOTUNE_ENV] = "0" if tuned else "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[TILEGYM_AUTOTUNE_ENV]
        else:
            os.environ[TILEGYM_AUTOTUNE_ENV] = saved


@functools.cache
def _tilegym_function():
    """The ``torch.autograd.Function`` around TileGym's forward and backward (made once)."""
    import torch

    class TileGymSSD(torch.autograd.Function):
        """x (b, l, h, p), dt' (b, l, h) positive, A (h,), B and C (b, l, g, n), D (h,),
        init_state (b, h, p, n) fp32 -> y (b, l, h, p), final_state (b, h, p, n)."""

        @staticmethod
        def forward(ctx, x, dt, A, B, C, D, init, chunk_size, kernels, tuned):
            with tilegym_autotune(tuned):
                y, final = kernels[0](x, A, B, C, D, dt, init, chunk_size)
            # the inputs only: TileGym's backward takes them and recomputes the rest
            ctx.save_for_backward(x, dt, A, B, C, D, init)
            ctx.chunk_size, ctx.kernels, ctx.tuned = chunk_size, kernels, tuned
            return y, final

        @staticmethod
        def backward(ctx, dy, dfinal):
            saved = ctx.saved_tensors
            x, dt, A, B, C, D, init = saved
            with tilegym_autotune(ctx.tuned):
                dx, dA, dB, dC, dD, ddt, dinit = ctx.kernels[1](
                    x, A, B, C, D, dt, init, dy.contiguous(), dfinal.contiguous(), ctx.chunk_size)
            grads = (dx, ddt, dA, dB, dC, dD, dinit)
            return tuple(g.to(t.dtype) for g, t in zip(grads, saved)) + (None, None, None)

    return TileGymSSD


def tilegym_training_adapter(tuned=False, kernels=None):
    """TileGym's cuTile forward and backward behind the signature of mamba_ssm's
    ``mamba_chunk_scan_combined`` (x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
    initial_states=None, seq_idx=None, cu_seqlens=None, dt_softplus=False,
    dt_limit=(0, inf), return_final_states=False), differentiable: returns y (b, l, h, p), or
    (y, final_states (b, h, p, n) fp32) with ``return_final_states``.

    What runs: dt' = softplus(dt + dt_bias) (or dt + dt_bias, or dt) in PyTorch, in fp32, then
    rounded to dt's dtype as TileGym takes it (as the forward suite passes it); autograd
    differentiates those ops, which count in any time taken of the call. Then one
    ``torch.autograd.Function`` whose forward calls
    ``tilegym.ops.cutile.mamba2.mamba2_chunk_forward(x, A, B, C, D, dt', init_state,
    chunk_size)`` and saves its inputs only, and whose backward calls
    ``mamba2_chunk_backward(x, A, B, C, D, dt', init_state, dy, dfinal_state, chunk_size)``
    (state_dtype fp32, its default), which recomputes the chunk cumsum and the chunk-entry
    states itself (its ``_chunk_cumsum`` and ``_fwd_pass_state_dual``) before the state
    gradients and dx, dD, dA, dB, dC, ddt; nothing of the forward's is reused. D absent: zeros
    (h,); initial_states absent: zeros (b, h, p, n) fp32 (their gradients then go nowhere).
    ``tuned``: each call inside :func:`tilegym_autotune`.

    Raises:
        PeerUnavailable: TileGym is missing, or the call needs what TileGym's Mamba-2 lacks:
            z, seq_idx, cu_seqlens, D of shape (h, p), a dt_limit clamp, or a sequence length
            that is not a multiple of ``chunk_size``; the message names it.
    """
    kernels = kernels or tilegym_backward()

    def run(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
            seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
            return_final_states=False):
        import torch

        lacks = [name for name, given in (("z (the gate)", z is not None),
                                          ("seq_idx (packed sequences)", seq_idx is not None),
                                          ("cu_seqlens", cu_seqlens is not None),
                                          ("D per head and channel (h, p)",
                                           D is not None and D.dim() != 1),
                                          ("dt_limit", tuple(dt_limit) != (0.0, float("inf"))))
                 if given]
        b, l, h, p = x.shape
        if l % chunk_size:
            lacks.append(f"seqlen % chunk_size != 0 ({l} % {chunk_size})")
        if lacks:
            raise PeerUnavailable(f"TileGym's Mamba-2 takes no {', '.join(lacks)}")
        step = dt.float() + dt_bias if dt_bias is not None else dt.float()
        step = torch.nn.functional.softplus(step) if dt_softplus else step
        if D is None:
            D = torch.zeros(h, device=x.device, dtype=torch.float32)
        if initial_states is None:
            initial_states = torch.zeros(b, h, p, B.shape[-1], device=x.device,
                                         dtype=torch.float32)
        y, final = _tilegym_function().apply(x, step.to(dt.dtype), A, B, C, D, initial_states,
                                             chunk_size, kernels, tuned)
        return (y, final) if return_final_states else y

    return run
