"""The complete job: how much of a Mamba-2 layer is SSD, and what a faster SSD buys the model.

``python -m ssd.tools.endtoend`` (library + command line; the data of notebook 11).

A faster kernel is not a faster model: if a fraction ``share`` of the job's time is spent in
the part made ``s`` times faster, the job gets :func:`amdahl` ``(share, s)`` =
1 / ((1 - share) + share / s) faster. This module measures the three numbers that law needs,
on the Mamba-2 mixer of ``ssd.layer`` with random weights:

1. :func:`ssd_share` -- one mixer's forward time, and the time of its SSD call alone on the
   very tensors the mixer passed it (captured with a forward hook); share = ssd / mixer. The
   rest of the mixer is mixer - ssd (``rest_diff_ms``), set against its floor
   (``ssd.cost.rest_floor``: the projections at the matmul rate plus the conv's and norm's
   bytes at the copy bandwidth, both measured in the same run, :func:`measure_ceilings`).
   As a cross-check, the mixer is also timed with its SSD replaced by a stub that only
   allocates the output (``rest_ms``): mixer_ms ~ rest_ms + ssd_ms when the parts add up.
   Each mixer runs with both layers: the conv and norm in plain PyTorch (``kernels="torch"``,
   the plain layer) and as cuTile kernels (``kernels="cutile"``, the fast layer).
   :func:`peer_share` times mamba_ssm's own ``Mamba2`` module with the same weights the same
   way, and :func:`projections` in_proj and out_proj alone (``F.linear``).
2. :func:`prefill` -- a stack of N mixers (pre-norm, residuals) over a whole prompt:
   latency, tokens/s, and the share of the stack spent in SSD (N x one layer's SSD call).
3. :func:`run` -- sweeps the benchmark suite's shapes (``ssd.tools.bench.SUITES``) and a prefill
   grid for the backends "cutile" (ours) and "mamba_ssm" (Triton) in both layers, and writes
   ``results/<gpu>/endtoend.json`` with the environment record; :func:`amdahl_rows` puts the
   predicted end-to-end speedup (from the measured share and kernel speedup) next to the
   measured one, per layer. A run merges into an existing file of the same revision row by row
   (:func:`merge`), so a long sweep can be split over several commands::

       python -m ssd.tools.endtoend --only share
       python -m ssd.tools.endtoend --only prefill --configs 130m
       python -m ssd.tools.endtoend --only prefill --configs 2.7b
       python -m ssd.tools.endtoend --only prefill --configs codestral-7b

Timing: on a CUDA device every number comes from ``ssd.tools.bench.time_fn`` (CUDA events, warm-up
excluded, median and 20/80 % quantiles), by default as a CUDA-graph replay with L2 flushed
before every call -- the settings of the benchmark suite, so the SSD times here are
comparable with ``results/<gpu>/models.json``. Both the mixer and its SSD call are timed with
L2 flushed, so the SSD alone does not profit from inputs the mixer just left in L2 (in the
mixer they may partly be there: the share is then a slight over-estimate). On the CPU
(tests) a perf_counter loop stands in, with the same keys and ``timer`` saying which.

The plain layer around the SSD is PyTorch (cuBLAS GEMMs, a cuDNN depthwise conv, elementwise
ops, an unfused gated RMSNorm); the fast layer keeps the GEMMs and runs the conv and the norm
as one cuTile kernel each (``ssd.layer_ops``). The same SSD gain is diluted differently by each.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from .bench import SUITES, Shape, _progress
from .env import RESULTS, environment, gpu_slug, write_json

#: Backends compared end to end: ours and mamba_ssm's Triton forward.
SHARE_BACKENDS = ("cutile", "mamba_ssm")
#: The layers the SSD runs in: the conv and norm in plain PyTorch, or as cuTile kernels
#: (``ssd.layer.KERNELS``).
LAYER_KERNELS = ("torch", "cutile")
#: The ``kernels`` of a row that times mamba_ssm's own ``Mamba2`` module (its conv, SSD, norm).
PEER_KERNELS = "mamba_ssm"
#: Which backend is the baseline of a speedup, and which the new one.
BASE, NEW = "mamba_ssm", "cutile"
#: Relative error allowed between a backend's mixer output and the torch backend's on the
#: same weights and input (last batch row), per dtype, before timing; see tests/test_mamba2.py.
GATE_TOL = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4, "float64": 1e-10}
#: Prefill grid: (preset, batch, seqlen) -- batch 1 and 8 at three prompt lengths, plus each
#: preset's own benchmark-suite point -- the stack having the published model's depth.
_PREFILL_PRESETS = ("130m", "2.7b", "codestral-7b")
PREFILL_GRID = tuple(sorted(
    {(name, b, l) for name in _PREFILL_PRESETS for b in (1, 8) for l in (512, 2048, 8192)}
    | {(s.name, s.b, s.l) for s in SUITES["models"] if s.name in _PREFILL_PRESETS},
    key=lambda t: (_PREFILL_PRESETS.index(t[0]), t[1], t[2])))  # one stack built per preset
QUICK_PREFILL_GRID = tuple((name, b, l) for name in ("130m", "2.7b") for b in (1, 8)
                           for l in (512, 4096))
#: A CPU-sized run of the whole pipeline (tests, ``--suite smoke``): 4 heads in 2 groups,
#: seqlen 80 = two chunks of 32 and a tail.
SMOKE_SHAPES = (Shape("smoke", 2, 80, 4, 16, 8, 2),)
SMOKE_CHUNK = 32


# ----------------------------------------------------------------------------- Amdahl


def amdahl(share: float, kernel_speedup: float) -> float:
    """End-to-end speedup when a part taking fraction ``share`` of the time gets
    ``kernel_speedup`` times faster and the rest is unchanged (Amdahl's law)::

        speedup = 1 / ((1 - share) + share / kernel_speedup)

    The seed's example: half the time in the kernel (share 0.5), kernel twice as fast
    (speedup 2): 1 / (0.5 + 0.25) = 1.33x, i.e. the job takes 0.75 of its time -- doubling
    the kernel saves a quarter, not a half. However fast the kernel, the job is never more
    than 1 / (1 - share) times faster.

    Args:
        share: fraction of the job's time in the part, 0 <= share <= 1.
        kernel_speedup: old time / new time of that part, > 0 (< 1 is a slowdown).
    """
    share, kernel_speedup = float(share), float(kernel_speedup)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share: expected a fraction in [0, 1], got {share!r}")
    if not kernel_speedup > 0.0:
        raise ValueError(f"kernel_speedup: expected a positive number, got {kernel_speedup!r}")
    return 1.0 / ((1.0 - share) + share / kernel_speedup)


def amdahl_rows(rows, key=("shape",), total="mixer_ms", part="ssd_ms", base=BASE, new=NEW):
    """Predicted vs measured end-to-end speedup of ``new`` over ``base``, per group of rows.

    Rows with the same values of ``key`` and backends ``base`` and ``new`` are paired (a key
    field a row lacks reads None: rows recorded before the field existed pair among
    themselves); share = part / total of the base, kernel_speedup = base part / new part,
    predicted = amdahl(share, kernel_speedup), measured = base total / new total.
    Returns one dict per pair, in the order the base rows come.
    """
    index = {(tuple(r.get(k) for k in key), r["backend"]): r for r in rows}
    out = []
    for r in rows:
        if r["backend"] != base:
            continue
        k = tuple(r.get(f) for f in key)
        other = index.get((k, new))
        if other is None:
            continue
        share = r[part] / r[total]  # > 1 only by timing noise (part timed alone)
        speedup = r[part] / other[part]
        bounded = min(share, 1.0)
        out.append(dict(zip(key, k), base=base, new=new, share=share, kernel_speedup=speedup,
                        predicted=amdahl(bounded, speedup), measured=r[total] / other[total],
                        max_possible=1 / max(1e-12, 1 - bounded)))
    return out


# ----------------------------------------------------------------------------- timing


def _device(device=None):
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def cpu_time(fn, *, reps=10, warmup=2) -> dict:
    """The CPU stand-in for ``ssd.tools.bench.time_fn``: wall time of ``fn()`` with perf_counter,
    warm-up excluded; the same keys (median_ms, q20_ms, q80_ms, min_ms, reps)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(ms, n=5, method="inclusive") if len(ms) > 1 else [ms[0]] * 4
    return dict(median_ms=float(statistics.median(ms)), q20_ms=float(q[0]), q80_ms=float(q[3]),
                min_ms=float(min(ms)), reps=reps)


def timer(fn, device, *, mode="graph", l2="flushed", reps=20, warmup=5) -> dict:
    """Time ``fn`` on ``device``: ``ssd.tools.bench.time_fn`` (CUDA events; ``mode`` graph/eager,
    ``l2`` flushed/warm) on a CUDA device, :func:`cpu_time` elsewhere. The result says which
    in ``timer``."""
    import torch

    if torch.device(device).type == "cuda":
        from .bench import time_fn

        stats = time_fn(fn, mode=mode, l2=l2, reps=reps, warmup=warmup)
        return dict(stats, timer="CUDA events", mode=mode, l2=l2)
    return dict(cpu_time(fn, reps=reps, warmup=min(warmup, 2)), timer="perf_counter (CPU)",
                mode="eager", l2="n/a")


def _stub_ssd(x, *args, **kwargs):
    """Stands in for the SSD when timing the rest of the layer: allocates y, computes nothing."""
    import torch

    return torch.empty_like(x)


def _rel_err(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def _inputs(config, batch, seqlen, device, seed):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch, seqlen, config.d_model, generator=gen, device=device,
                       dtype=torch.float32).to(config.torch_dtype)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GateFailed(AssertionError):
    """A backend's layer output disagrees with the torch backend's beyond ``GATE_TOL``."""


def plain_output(mixer, u):
    """The plain layer's output on u with ``mixer``'s weights: the torch SSD backend (fp32) and
    the PyTorch conv and norm; the mixer's backend, chunk size and kernels are restored."""
    backend, chunk, kernels = mixer.backend, mixer.ssd.chunk_size, mixer.kernels
    try:
        return mixer.set_kernels("torch").set_backend("torch")(u)
    finally:
        mixer.set_backend(backend, chunk).set_kernels(kernels)


def gate(mixer, u, tol=None, *, module=None, name=None) -> float:
    """Relative error of the output of ``module`` (default ``mixer``) on the last batch row
    against the plain layer's with ``mixer``'s weights (:func:`plain_output`); raises
    :class:`GateFailed` above ``tol`` (default ``GATE_TOL[dtype]``)."""
    u1 = u[-1:]
    out = (module or mixer)(u1)
    ref = plain_output(mixer, u1)
    err = _rel_err(out, ref)
    tol = GATE_TOL[mixer.config.dtype] if tol is None else tol
    if not err <= tol:
        name = name or f"{mixer.backend} SSD, {mixer.kernels} conv and norm"
        raise GateFailed(f"{name}: mixer output differs from the plain layer's (torch SSD, "
                         f"PyTorch conv and norm) by rel err {err:.3e} > {tol:.0e}")
    return err


def _tune_on(backend, call, device):
    """Let an autotuned backend choose its configurations on the problem about to be timed:
    mamba_ssm's are reset (:func:`ssd.tools.peers.retune_mamba_ssm`) and ``call`` (the full-size
    forward) runs once, before the batch-1 gate could pick them instead."""
    if backend != "mamba_ssm":
        return
    from .peers import retune_mamba_ssm

    retune_mamba_ssm()
    call()
    _sync(device)


def ssd_share(config, batch, seqlen, backend, reps=20, *, mode="graph", l2="flushed", warmup=5,
              seed=0, device=None, check=True, rest=True, mixer=None, chunk_size=None,
              kernels="torch", tune=True, ceilings=None) -> dict:
    """Time one mixer's forward and the SSD call inside it; return their ratio.

    Args:
        config: a ``ssd.layer.Mamba2Config``.
        batch, seqlen: the input (batch, seqlen, d_model).
        backend: the SSD backend ("cutile", "mamba_ssm", "torch", ...).
        reps, mode, l2, warmup: timing settings (see :func:`timer`).
        seed: weights (when ``mixer`` is not given) and input.
        device: default "cuda" when available, else "cpu".
        check: first compare the layer's output with the plain layer's (:func:`gate`).
        rest: also time the mixer with its SSD stubbed out (``rest_ms``).
        mixer: an existing ``Mamba2Mixer`` to reuse (its backend is set to ``backend``).
        chunk_size: the chunk size the SSD is called with (default the config's).
        kernels: the conv and norm, "torch" (the plain layer) or "cutile" (the fast layer).
        tune: let mamba_ssm's autotuner choose on this problem first (:func:`_tune_on`);
            a sweep tunes once a shape.
        ceilings: {"copy_bytes_per_s", "bf16_flops_per_s"} (:func:`measure_ceilings`): with
            them the row carries the rest's floor (``ssd.cost.rest_floor``).
    Returns:
        dict with mixer_ms, ssd_ms, share = ssd_ms / mixer_ms, rest_diff_ms = mixer_ms -
        ssd_ms, rest_ms and share_by_rest = 1 - rest_ms / mixer_ms (when ``rest``), the
        quantiles of each (``mixer``, ``ssd``, ``rest`` sub-dicts), gate_rel_err, dims
        (b, l, h, p, n, g), d_model, chunk_size, dtype, backend, kernels, timer settings; with
        ``ceilings`` also rest_floor (the dict of ``ssd.cost.rest_floor``), rest_floor_ms and
        rest_over_floor = rest_diff_ms / rest_floor_ms.
    """
    import torch

    from ..layer import Mamba2Mixer, capture_ssd_calls, ssd_replaced

    device = _device(device)
    if mixer is None:
        mixer = Mamba2Mixer(config, backend, kernels=kernels, device=device, seed=seed)
    mixer.set_kernels(kernels).set_backend(backend, chunk_size or config.chunk_size)
    u = _inputs(config, batch, seqlen, device, seed + 1)
    with torch.no_grad():
        if tune:
            _tune_on(backend, lambda: mixer(u), device)
        plain = backend == "torch" and kernels == "torch"
        err = gate(mixer, u) if check and not plain else None
        out, calls = capture_ssd_calls(mixer, u)  # the tensors the layer hands its SSD
        args = calls[0]
        del out, calls
        _sync(device)
        t = dict(mode=mode, l2=l2, reps=reps, warmup=warmup)
        mixer_t = timer(lambda: mixer(u), device, **t)
        ssd_t = timer(lambda: mixer.ssd(*args), device, **t)
        rest_t = None
        if rest:
            with ssd_replaced(mixer, _stub_ssd):
                rest_t = timer(lambda: mixer(u), device, **t)
    row = dict(backend=backend, kernels=kernels, dims=list(config.ssd_dims(batch, seqlen)),
               d_model=config.d_model, chunk_size=mixer.ssd.chunk_size, dtype=config.dtype,
               gate_rel_err=err)
    return dict(row, **_split(mixer_t, ssd_t, rest_t, config, batch, seqlen, ceilings))


def _split(mixer_t, ssd_t, rest_t, config, batch, seqlen, ceilings) -> dict:
    """The timing fields of a share row: the mixer, its SSD, the rest (by difference, and
    stubbed when ``rest_t``), and with ``ceilings`` the rest's floor."""
    from ..cost import rest_floor

    mixer_ms, ssd_ms = mixer_t["median_ms"], ssd_t["median_ms"]
    row = dict(mixer_ms=mixer_ms, ssd_ms=ssd_ms, share=ssd_ms / mixer_ms,
               rest_diff_ms=mixer_ms - ssd_ms, timer=mixer_t["timer"], mode=mixer_t["mode"],
               l2=mixer_t["l2"], reps=mixer_t["reps"], mixer=_quantiles(mixer_t),
               ssd=_quantiles(ssd_t))
    if rest_t is not None:
        row.update(rest_ms=rest_t["median_ms"],
                   share_by_rest=1 - rest_t["median_ms"] / mixer_ms, rest=_quantiles(rest_t))
    if ceilings is not None:
        floor = rest_floor(config, batch, seqlen, ceilings)
        row.update(rest_floor=floor, rest_floor_ms=floor["floor_ms"],
                   rest_over_floor=(mixer_ms - ssd_ms) / floor["floor_ms"])
    return row


def peer_share(mixer, batch, seqlen, reps=20, *, mode="graph", l2="flushed", warmup=5, seed=0,
               check=True, tune=True, ceilings=None) -> dict:
    """:func:`ssd_share` for mamba_ssm's own ``Mamba2`` module, built with ``mixer``'s sizes,
    weights and chunk size (``ssd.tools.peers.mamba_ssm_mixer``, which says which conv and norm
    it runs here): the module's forward; its SSD call alone on the tensors the module passed
    it (captured by standing a recording function in for its ``mamba_chunk_scan_combined``); the
    module with that call stubbed (``rest_ms``). Where the module fuses the conv, SSD and norm
    into one call, the SSD is timed on the tensors ``mixer`` hands mamba_ssm's SSD at the same
    chunk size, and no stub is timed. The output is gated against the plain layer's.

    Returns:
        the keys of :func:`ssd_share` with backend "mamba_ssm" and kernels :data:`PEER_KERNELS`,
        plus module, path (dict: fused, conv, norm, ssd) and ssd_timed_on.
    Raises:
        ssd.tools.peers.PeerUnavailable: mamba_ssm or its Mamba2 cannot be loaded here.
    """
    import torch

    from ..layer import capture_ssd_calls
    from .peers import MAMBA2_MODULE, mamba_ssm_forward, mamba_ssm_mixer, mamba_ssm_mixer_ssd

    config, device = mixer.config, mixer.in_proj.weight.device
    peer, path = mamba_ssm_mixer(mixer)
    u = _inputs(config, batch, seqlen, device, seed + 1)
    forward = mamba_ssm_forward()
    with torch.no_grad():
        if tune:
            _tune_on("mamba_ssm", lambda: peer(u), device)
        err = gate(mixer, u, module=peer, name="mamba_ssm's Mamba2") if check else None
        if path["fused"]:
            backend, chunk = mixer.backend, mixer.ssd.chunk_size
            try:
                mixer.set_backend("mamba_ssm", peer.chunk_size)
                _, calls = capture_ssd_calls(mixer, u)
                call, timed_on = (lambda: mixer.ssd(*calls[0])), "the layer's SSD inputs"
                _sync(device)
                ssd_t = timer(call, device, mode=mode, l2=l2, reps=reps, warmup=warmup)
            finally:
                mixer.set_backend(backend, chunk)
        else:
            calls = []

            def recording(*args, **kwargs):
                calls.append((args, kwargs))
                return forward(*args, **kwargs)

            with mamba_ssm_mixer_ssd(recording):
                peer(u)
            args, kwargs = calls[0]
            del calls
            _sync(device)
            timed_on = "the tensors Mamba2 passed"
            ssd_t = timer(lambda: forward(*args, **kwargs), device, mode=mode, l2=l2, reps=reps,
                          warmup=warmup)
        t = dict(mode=mode, l2=l2, reps=reps, warmup=warmup)
        mixer_t = timer(lambda: peer(u), device, **t)
        rest_t = None
        if not path["fused"]:
            with mamba_ssm_mixer_ssd(_stub_ssd):
                rest_t = timer(lambda: peer(u), device, **t)
    row = dict(backend="mamba_ssm", kernels=PEER_KERNELS, module=f"{MAMBA2_MODULE}.Mamba2",
               path=path, ssd_timed_on=timed_on, dims=list(config.ssd_dims(batch, seqlen)),
               d_model=config.d_model, chunk_size=peer.chunk_size, dtype=config.dtype,
               gate_rel_err=err)
    return dict(row, **_split(mixer_t, ssd_t, rest_t, config, batch, seqlen, ceilings))


def projections(mixer, batch, seqlen, reps=20, *, mode="graph", l2="flushed", warmup=5, seed=0,
                ceilings=None) -> dict:
    """in_proj and out_proj of ``mixer`` timed alone, as the layer calls them
    (``torch.nn.functional.linear`` on cuBLAS): u (batch, seqlen, d_model) @ in_proj.weightᵀ and
    y (batch, seqlen, d_inner) @ out_proj.weightᵀ, random inputs in the model dtype.

    Returns:
        dict with in_proj_ms, out_proj_ms (medians), in_proj_flops, out_proj_flops (2 t i o
        over t = batch * seqlen tokens), in_proj_tflops and out_proj_tflops (achieved), and
        with ``ceilings`` in_proj_of_ceiling and out_proj_of_ceiling (achieved / the measured
        matmul rate).
    """
    import torch
    import torch.nn.functional as F

    cfg, w_in, w_out = mixer.config, mixer.in_proj.weight, mixer.out_proj.weight
    device = w_in.device
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    u = torch.randn(batch, seqlen, cfg.d_model, generator=gen, device=device).to(w_in.dtype)
    y = torch.randn(batch, seqlen, cfg.d_inner, generator=gen, device=device).to(w_out.dtype)
    tokens = batch * seqlen
    out = {}
    t = dict(mode=mode, l2=l2, reps=reps, warmup=warmup)
    with torch.no_grad():
        for name, x, w in (("in_proj", u, w_in), ("out_proj", y, w_out)):
            ms = timer(lambda: F.linear(x, w), device, **t)["median_ms"]
            flops = 2 * tokens * w.shape[0] * w.shape[1]
            out.update({f"{name}_ms": ms, f"{name}_flops": flops,
                        f"{name}_tflops": flops / (ms * 1e-3) / 1e12})
            if ceilings is not None:
                out[f"{name}_of_ceiling"] = flops / (ms * 1e-3) / ceilings["bf16_flops_per_s"]
    return out


def measure_ceilings(device) -> dict:
    """The copy bandwidth and matmul rate the floors use, measured now on ``device``: on a GPU
    ``ssd.tools.bench.measure_ceilings`` (a 1 GiB device-to-device copy, an 8192³ bf16
    matmul, the CUDA cores' fp32 FMA rate); on the CPU (tests) a 16 MiB copy and a 256³ fp32
    matmul timed with perf_counter stand in, with the same keys."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        from .bench import measure_ceilings as measure

        return dict(measure(), measured_on="cuda")
    src = torch.empty(2**24, dtype=torch.uint8)
    dst = torch.empty_like(src)
    a = torch.randn(256, 256)
    copy = cpu_time(lambda: dst.copy_(src), reps=5, warmup=1)["median_ms"]
    mm = cpu_time(lambda: a @ a, reps=5, warmup=1)["median_ms"]
    return dict(copy_bytes_per_s=2 * 2**24 / (copy * 1e-3),
                bf16_flops_per_s=2 * 256**3 / (mm * 1e-3),
                measured_on="cpu (fp32 matmul stands in)")


def _quantiles(stats):
    return {k: stats[k] for k in ("median_ms", "q20_ms", "q80_ms", "min_ms")}


def prefill(stack_config, n_layers, batch, seqlen, backend, reps=10, *, mode="graph",
            l2="flushed", warmup=2, seed=0, device=None, measure_ssd=True, stack=None,
            chunk_size=None, kernels="torch", tune=True) -> dict:
    """Prefill latency of a stack of ``n_layers`` mixers over (batch, seqlen) tokens.

    Args:
        stack_config: a ``Mamba2Config``; n_layers: the depth.
        backend, reps, mode, l2, warmup, seed, device: as :func:`ssd_share`.
        measure_ssd: also time layer 0's SSD call alone (captured with a hook) and report
            the stack's share in SSD, n_layers * ssd_ms_per_layer / latency (every layer's
            SSD has the same shape, so one layer's time stands for each).
        stack: an existing ``Mamba2Stack`` to reuse (its backend is set to ``backend``).
        chunk_size: the chunk size every layer's SSD is called with (default the config's).
        kernels, tune: as :func:`ssd_share` (every layer's conv and norm).
    Returns:
        dict with latency_ms (median of the whole forward), tokens_per_s = batch * seqlen /
        latency, quantiles, and with measure_ssd ssd_ms_per_layer, ssd_ms_total, ssd_share;
        peak_mem_gib on a GPU.
    """
    import torch

    from ..layer import Mamba2Stack, capture_ssd_calls

    device = _device(device)
    if stack is None:
        stack = Mamba2Stack(stack_config, n_layers, backend, kernels=kernels, device=device,
                            seed=seed)
    stack_config, n_layers = stack.config, len(stack.mixers)
    stack.set_kernels(kernels).set_backend(backend, chunk_size or stack_config.chunk_size)
    u = _inputs(stack_config, batch, seqlen, device, seed + 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        if tune:
            _tune_on(backend, lambda: stack(u), device)
        out, calls = capture_ssd_calls(stack, u, limit=1)  # keep only layer 0's tensors
        if not torch.isfinite(out).all():
            raise GateFailed(f"{backend}: the stack's output is not finite")
        args = calls[0]
        del out, calls
        t = dict(mode=mode, l2=l2, reps=reps, warmup=warmup)
        total = timer(lambda: stack(u), device, **t)
        ssd_t = timer(lambda: stack.mixers[0].ssd(*args), device, **t) if measure_ssd else None
    latency = total["median_ms"]
    row = dict(backend=backend, kernels=kernels, n_layers=n_layers, batch=batch, seqlen=seqlen,
               tokens=batch * seqlen, d_model=stack_config.d_model,
               dims=list(stack_config.ssd_dims(batch, seqlen)),
               chunk_size=stack.mixers[0].ssd.chunk_size, dtype=stack_config.dtype, latency_ms=latency,
               tokens_per_s=batch * seqlen / (latency * 1e-3), latency=_quantiles(total),
               timer=total["timer"], mode=total["mode"], l2=total["l2"], reps=reps)
    if ssd_t is not None:
        ssd_total = n_layers * ssd_t["median_ms"]
        row.update(ssd_ms_per_layer=ssd_t["median_ms"], ssd_ms_total=ssd_total,
                   ssd_share=ssd_total / latency)
    if device.type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return row


# ----------------------------------------------------------------------------- sweep


def _free(device):
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _failure(exc) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


#: The fields that pair a base row with a new one in each part: the same job, the same layer.
AMDAHL_KEYS = {"share": ("shape", "kernels"),
               "prefill": ("config", "n_layers", "batch", "seqlen", "kernels")}
#: The fields that identify a row of each part (a rerun replaces rows with the same key).
ROW_KEYS = {name: key + ("backend",) for name, key in AMDAHL_KEYS.items()}


def _amdahl_of(part_name, rows):
    if part_name == "share":
        return amdahl_rows(rows, key=AMDAHL_KEYS["share"])
    return amdahl_rows(rows, key=AMDAHL_KEYS["prefill"], total="latency_ms", part="ssd_ms_total")


def merge(old: dict, new: dict) -> dict:
    """Merge a new payload into a recorded one of the same revision: per part, rows of the new
    run replace the old
    rows with the same :data:`ROW_KEYS` key, other old rows are kept (so a sweep can be split
    over several commands); failures likewise; settings, skipped and environment are the new
    run's (the share part's ceilings too: :func:`run` reuses the recorded ones when it merges,
    so every floor of a recording comes from one measurement); ``amdahl`` is recomputed over
    the merged rows."""
    out = {k: v for k, v in old.items() if k in ROW_KEYS}
    for name, part in new.items():
        if name not in ROW_KEYS:
            continue
        key = ROW_KEYS[name]
        prev = old.get(name) or {}
        fresh = {tuple(r.get(k) for k in key) for r in part["rows"]}
        fresh |= {tuple(f.get(k) for k in key) for f in part["failures"]}
        rows = [r for r in prev.get("rows", []) if tuple(r.get(k) for k in key) not in fresh]
        fails = [f for f in prev.get("failures", []) if tuple(f.get(k) for k in key) not in fresh]
        rows += part["rows"]
        out[name] = dict(part, rows=rows, failures=fails + part["failures"],
                         amdahl=_amdahl_of(name, rows))
    out["environment"] = new.get("environment", old.get("environment"))
    return out


def run(shapes=SUITES["models"], backends=SHARE_BACKENDS, prefill_grid=PREFILL_GRID, *,
        parts=("share", "prefill"), reps=20, prefill_reps=10, mode="graph", l2="flushed",
        n_layers=None, chunk_size=256, chunk_sizes=None, dtype="bfloat16", device=None,
        kernels=LAYER_KERNELS, peer=True, ceilings=None, out=None, progress=True) -> dict:
    """Measure the mixer share at every shape and the prefill grid, for every backend and layer.

    Args:
        shapes: ``ssd.tools.bench.Shape`` list; each becomes the mixer whose SSD has its h, p, n, g
            (``ssd.layer.config_for_shape``), run at its batch and seqlen.
        backends: SSD backends; one that cannot run here is recorded under ``skipped``.
        prefill_grid: (config, batch, seqlen) triples; config is a preset name (weights in
            ``dtype``) or a ``Mamba2Config`` (used as is).
        parts: which of "share" and "prefill" to run.
        reps, prefill_reps, mode, l2: timing settings (see :func:`timer`).
        n_layers: stack depth; None takes ``PRESET_LAYERS`` for a preset name (else 2).
        chunk_size, dtype: of the mixers built from ``shapes`` (the layer's configuration).
        chunk_sizes: {backend: chunk size} for backends whose SSD is called with another
            chunk size than the layer's (each at its fastest, say); the rows record the one used.
        device: default "cuda" when available.
        kernels: the layers (``LAYER_KERNELS``); ones that cannot run here are skipped as
            ``kernels:<name>``.
        peer: the share part also times mamba_ssm's own ``Mamba2`` module (:func:`peer_share`,
            on a CUDA device). Each shape's projections are timed alone (:func:`projections`).
        ceilings: the copy bandwidth and matmul rate of the floors; default the ones recorded
            in ``out`` at this revision, else measured now (:func:`measure_ceilings`).
        out: path of the JSON to write, merged into an existing file (:func:`merge`); None
            writes nothing.
    Returns:
        {"share": {...}, "prefill": {...}, "environment": ...} (the merged payload when
        ``out`` is given); each part holds rows, failures, skipped, settings, its
        environment, and ``amdahl`` (predicted vs measured speedup of NEW over BASE, per
        layer); the share part also ``ceilings``. A share row of the peer module has kernels
        :data:`PEER_KERNELS`; every share row of a shape carries that shape's ``projections``.
    """
    from ..layer import PRESET_LAYERS, Mamba2Mixer, Mamba2Stack, config_for_shape, preset

    device = _device(device)
    env = environment()
    chunks = dict(chunk_sizes or {})
    if unknown := set(chunks) - set(backends):
        raise ValueError(f"chunk_sizes names backends that are not run: {sorted(unknown)}")
    out = None if out is None else Path(out)
    old = json.loads(out.read_text()) if out is not None and out.is_file() else {}
    # one recording, one revision: rows of another revision's run are dropped, not merged
    same = old.get("environment", {}).get("git_revision") == env.get("git_revision")
    old = old if same else {}
    usable, skipped = usable_backends(backends)
    layers, why = usable_kernels(kernels)
    skipped.update({f"kernels:{k}": v for k, v in why.items()})
    tasks = []
    if usable and layers and "share" in parts:
        tasks += [("share", s) for s in shapes]
        ceilings = ceilings or (old.get("share") or {}).get("ceilings") or measure_ceilings(device)
    if usable and layers and "prefill" in parts:
        tasks += [("prefill", p) for p in prefill_grid]
    t = dict(mode=mode, l2=l2)
    share_rows, share_fail, pre_rows, pre_fail = [], [], [], []
    stacks = {}  # (config, depth) -> the stack, reused over batch/seqlen points and backends
    for kind, task in (_progress(tasks, "endtoend") if progress else tasks):
        if kind == "share":
            shape = task
            config = config_for_shape(shape, chunk_size=chunk_size, dtype=dtype)
            ident = dict(shape=shape.name)
            try:  # one set of weights for every backend and layer
                mixer = Mamba2Mixer(config, usable[0], device=device, seed=0)
                proj = projections(mixer, shape.b, shape.l, reps, ceilings=ceilings, **t)
            except Exception as exc:  # a shape that fails is a result, not a crash
                share_fail += [dict(ident, backend=b, kernels=k, error=_failure(exc))
                               for k in layers for b in usable]
                continue
            tuned = set()  # mamba_ssm's autotuner chooses once a shape
            for k, backend in [(k, b) for k in layers for b in usable]:
                try:
                    row = ssd_share(config, shape.b, shape.l, backend, reps, device=device,
                                    mixer=mixer, chunk_size=chunks.get(backend), kernels=k,
                                    tune=backend not in tuned, ceilings=ceilings, **t)
                    share_rows.append(dict(ident, **row, projections=proj))
                except Exception as exc:
                    share_fail.append(dict(ident, backend=backend, kernels=k,
                                           error=_failure(exc)))
                tuned.add(backend)
                _free(device)
            if peer and device.type == "cuda":
                try:
                    mixer.set_kernels("torch").set_backend(usable[0], chunk_size)
                    row = peer_share(mixer, shape.b, shape.l, reps, ceilings=ceilings,
                                     tune="mamba_ssm" not in tuned, **t)
                    share_rows.append(dict(ident, **row, projections=proj))
                except Exception as exc:
                    share_fail.append(dict(ident, backend="mamba_ssm", kernels=PEER_KERNELS,
                                           error=_failure(exc)))
            del mixer
            _free(device)
            continue
        name, batch, seqlen = task
        config = preset(name, dtype=dtype) if isinstance(name, str) else name
        label = name if isinstance(name, str) else f"d{config.d_model}-n{config.d_state}"
        depth = n_layers or (PRESET_LAYERS.get(name, 2) if isinstance(name, str) else 2)
        ident = dict(config=label, n_layers=depth, batch=batch, seqlen=seqlen)
        if (config, depth) not in stacks:
            stacks.clear()  # one stack in memory at a time
            _free(device)
            try:
                stacks[(config, depth)] = Mamba2Stack(config, depth, usable[0], device=device,
                                                      seed=0)
            except Exception as exc:
                pre_fail += [dict(ident, backend=b, kernels=k, error=_failure(exc))
                             for k in layers for b in usable]
                continue
        tuned = set()
        for k, backend in [(k, b) for k in layers for b in usable]:
            try:
                row = prefill(config, depth, batch, seqlen, backend, prefill_reps, device=device,
                              stack=stacks[(config, depth)], chunk_size=chunks.get(backend),
                              kernels=k, tune=backend not in tuned, **t)
                pre_rows.append(dict(config=label, **row))
            except Exception as exc:
                pre_fail.append(dict(ident, backend=backend, kernels=k, error=_failure(exc)))
            tuned.add(backend)
            _free(device)
    stacks.clear()
    _free(device)
    cuda = device.type == "cuda"
    settings = dict(reps=reps, mode=mode if cuda else "eager", l2=l2 if cuda else "n/a",
                    dtype=dtype, chunk_size=chunk_size, statistic="median", kernels=list(layers),
                    **(dict(chunk_sizes=chunks) if chunks else {}),
                    timer="CUDA events (ssd.tools.bench.time_fn)" if cuda else "perf_counter (CPU)",
                    flush_bytes=512 * 2**20 if (cuda and l2 == "flushed") else 0)
    payload = {}
    if "share" in parts:
        no_peer = {} if peer and cuda else {PEER_KERNELS: "mamba_ssm's Mamba2 module: " + (
            "no CUDA device" if peer else "not asked for")}
        payload["share"] = dict(rows=share_rows, failures=share_fail,
                                skipped=dict(skipped, **no_peer), settings=settings,
                                environment=env, ceilings=ceilings,
                                amdahl=_amdahl_of("share", share_rows))
    if "prefill" in parts:
        payload["prefill"] = dict(rows=pre_rows, failures=pre_fail, skipped=skipped,
                                  settings=dict(settings, reps=prefill_reps), environment=env,
                                  amdahl=_amdahl_of("prefill", pre_rows))
    payload["environment"] = env
    if out is not None:
        if old:
            payload = merge(old, payload)
        write_json(out, payload)
    return payload


# ----------------------------------------------------------------------------- CLI


def report(payload, file=None):
    """Print the share and prefill tables, the rest against its floor, the projections' rates,
    and Amdahl's prediction next to the measurement."""
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    share, pre = payload.get("share") or {}, payload.get("prefill") or {}
    if share.get("rows"):
        p("\nshape            kernels   backend      mixer ms   ssd ms   rest ms   share  "
          "1-rest/mixer  rest/floor")
        for r in share["rows"]:
            p(f"{r['shape']:16s} {r.get('kernels', 'torch'):9s} {r['backend']:10s} "
              f"{r['mixer_ms']:9.3f} {r['ssd_ms']:8.3f} {r.get('rest_ms', math.nan):9.3f}  "
              f"{r['share']:6.1%}  {r.get('share_by_rest', math.nan):12.1%}  "
              f"{r.get('rest_over_floor', math.nan):9.2f}x")
            if "path" in r:
                p(f"{'':16s} mamba_ssm's Mamba2: conv {r['path']['conv']}; norm "
                  f"{r['path']['norm']}")
        for shape, r in {r["shape"]: r for r in share["rows"] if "projections" in r}.items():
            pr = r["projections"]
            p(f"{shape:16s} in_proj {pr['in_proj_tflops']:.0f} TFLOP/s, out_proj "
              f"{pr['out_proj_tflops']:.0f} TFLOP/s")
        for a in share.get("amdahl", []):
            p(f"{a['shape']:16s} {a.get('kernels', 'torch')} layer: {a['new']} SSD "
              f"{a['kernel_speedup']:.2f}x {a['base']}'s at share {a['share']:.1%}: Amdahl "
              f"predicts {a['predicted']:.3f}x, measured {a['measured']:.3f}x "
              f"(bound {a['max_possible']:.2f}x)")
    if pre.get("rows"):
        p("\nconfig         layers batch seqlen kernels   backend     latency ms   tokens/s   "
          "ssd share")
        for r in pre["rows"]:
            p(f"{r['config']:14s} {r['n_layers']:6d} {r['batch']:5d} {r['seqlen']:6d} "
              f"{r.get('kernels', 'torch'):9s} {r['backend']:10s} {r['latency_ms']:11.3f} "
              f"{r['tokens_per_s']:10.0f}   {r.get('ssd_share', math.nan):6.1%}")
        for a in pre.get("amdahl", []):
            p(f"{a['config']} b={a['batch']} l={a['seqlen']} {a.get('kernels', 'torch')} layer: "
              f"share {a['share']:.1%}, SSD {a['kernel_speedup']:.2f}x: predicted "
              f"{a['predicted']:.3f}x, measured {a['measured']:.3f}x")
    for f in share.get("failures", []) + pre.get("failures", []):
        p("FAILED", f)
    for name, why in {**share.get("skipped", {}), **pre.get("skipped", {})}.items():
        p("SKIPPED", why)


def _usable(names, load) -> tuple[list, dict]:
    """The names that ``load`` accepts, and {name: why not} for the others."""
    from ..layer import BackendUnavailable

    usable, skipped = [], {}
    for name in names:
        try:
            load(name)
            usable.append(name)
        except BackendUnavailable as exc:
            skipped[name] = str(exc)
    return usable, skipped


def usable_backends(backends) -> tuple[list, dict]:
    """The SSD backends of ``backends`` that load here, and {backend: why not} for the others."""
    from ..layer import backend_function

    return _usable(backends, backend_function)


def usable_kernels(kernels) -> tuple[list, dict]:
    """The layer kernels of ``kernels`` that load here, and {kernels: why not} for the others."""
    from ..layer import kernel_ops

    return _usable(kernels, kernel_ops)


def parse_chunk_sizes(parser, specs) -> dict:
    """{backend: chunk size} from ``--chunk-size BACKEND=Q`` values; a malformed one is a usage
    error of ``parser``."""
    chunk_sizes = {}
    for spec in specs:
        backend, _, q = spec.partition("=")
        if not q.isdigit():
            parser.error(f"--chunk-size {spec!r}: expected BACKEND=Q, e.g. cutile=128")
        chunk_sizes[backend] = int(q)
    return chunk_sizes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.endtoend",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=[*SUITES, "smoke"], default="models",
                        help="shapes of the share measurement (smoke: CPU-sized, with a tiny "
                             "prefill)")
    parser.add_argument("--backend", action="append", help="cutile, mamba_ssm, torch "
                        "(repeatable; default cutile and mamba_ssm)")
    parser.add_argument("--kernels", action="append", choices=list(LAYER_KERNELS),
                        help="the layer's conv and norm: torch (plain), cutile (fast) "
                             "(repeatable; default both)")
    parser.add_argument("--no-peer", action="store_true",
                        help="skip mamba_ssm's own Mamba2 module")
    parser.add_argument("--shapes", metavar="NAME,NAME",
                        help="only these shapes of the suite (the share part; a run merges "
                             "into the recording, so the shapes can be split over commands)")
    parser.add_argument("--only", choices=["share", "prefill"], help="run one part")
    parser.add_argument("--configs", help="prefill presets, comma-separated (default: "
                        "130m,2.7b,codestral-7b)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--prefill-reps", type=int, default=10)
    parser.add_argument("--layers", type=int, help="stack depth (default: the published model's)")
    parser.add_argument("--mode", choices=["graph", "eager"], default="graph")
    parser.add_argument("--l2", choices=["flushed", "warm"], default="flushed")
    parser.add_argument("--quick", action="store_true", help="a smaller prefill grid")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--out", help="output JSON, merged into an existing one (default "
                        "results/<gpu>/endtoend.json)")
    parser.add_argument("--chunk-size", action="append", metavar="BACKEND=Q", default=[],
                        help="call BACKEND's SSD at chunk size Q instead of the layer's 256 "
                             "(repeatable; e.g. cutile=128, each backend at its fastest)")
    args = parser.parse_args(argv)
    chunk_sizes = parse_chunk_sizes(parser, args.chunk_size)

    from ..layer import config_for_shape

    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    shapes, chunk = SUITES.get(args.suite), 256
    grid = QUICK_PREFILL_GRID if args.quick else PREFILL_GRID
    if args.configs:
        names = args.configs.split(",")
        grid = [g for g in grid if g[0] in names]
    if args.suite == "smoke":
        shapes, chunk = list(SMOKE_SHAPES), SMOKE_CHUNK
        smoke = config_for_shape(SMOKE_SHAPES[0], chunk_size=chunk, dtype=dtype)
        grid = [(smoke, 1, SMOKE_SHAPES[0].l)]
    if args.shapes:
        names = args.shapes.split(",")
        if unknown := set(names) - {s.name for s in shapes}:
            parser.error(f"--shapes: {sorted(unknown)} not in the {args.suite} suite")
        shapes = [s for s in shapes if s.name in names]
    parts = (args.only,) if args.only else ("share", "prefill")
    out = (Path(args.out) if args.out
           else RESULTS / gpu_slug(environment()) / "endtoend.json")
    payload = run(shapes, tuple(args.backend or SHARE_BACKENDS), grid, parts=parts,
                  reps=args.reps, prefill_reps=args.prefill_reps, mode=args.mode, l2=args.l2,
                  n_layers=args.layers, chunk_size=chunk, chunk_sizes=chunk_sizes, dtype=dtype,
                  device=device, kernels=tuple(args.kernels or LAYER_KERNELS),
                  peer=not args.no_peer, out=out)
    report(payload)
    print(f"[endtoend] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
