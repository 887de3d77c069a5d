"""Compile every cuTile kernel ahead of time, without a GPU: ``python -m ssd.tools.aot``.

The stage launchers run on CPU tensors inside :func:`ssd.launch.capture`, which records each
launch instead of queuing it; every record is then exported as a cubin with
:func:`cuda.tile.compilation.export_kernel` for each target architecture, under the signature
cuTile's launcher would derive from the same tensors (:func:`ssd.launch.signature`). This
exercises exactly the kernels, argument types and compile-time constants the GPU path would
use, so a kernel that stops compiling fails CI (``tests/test_aot.py``) long before anyone runs it.

The same cubins say what the compiler made of each configuration: registers per thread, the
per-thread stack (where registers spill) and shared memory, read with ``cuobjdump
--dump-resource-usage``. :func:`resource_table` does that for every point of the tiling study
(:func:`resource_points`: the generic space and each study shape's own; ``python -m ssd.tools.aot
--resources`` records it, with each kernel's compile time on the CPU), so the layout chapter can
set measured register budgets and spills beside the measured times, and the peers chapter can
say what each configuration costs a first call.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import launch

ARCHS = ("sm_80", "sm_90", "sm_100")
# Compile-time facts, not GPU measurements: they live apart from results/<gpu>/.
RESOURCES = Path(__file__).resolve().parents[2] / "results" / "compile" / "sm_90_resources.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Compiled:
    kernel: str
    arch: str
    variant: str
    cubin_bytes: int
    seconds: float


# "unpacked": every optional input but seq_idx, all the one-kernel stages 2 and 3 take;
# "varlen": every optional input on one batch row of packed sequences, with cu_seqlens (each
# sequence's final state too, ssd.kernels.chunk_state_varlen)
FEATURES = ("none", "layer", "all", "unpacked", "varlen")
# capture_forward's default shape has a ragged last chunk; this one has full chunks of
# FULL_CHUNK, which the walk takes in two K blocks: the case it unrolls (state_passing FULL).
FULL_CHUNK = 128
FULL_DIMS = (2, 2 * FULL_CHUNK, 8, 64, 128, 2)


def capture_forward(dtype: str, features: str, fused: bool, chunk_size: int = 256, config=None,
                    dims=None):
    """Run the forward's launchers on small CPU tensors and return the recorded launches.

    features: "none" (x, dt, A, B, C only), "layer" (plus D, dt_bias and softplus, as a Mamba-2
    layer and the benchmark call it), "all" (every optional input), "unpacked" (all but
    seq_idx, which the one-kernel stages 2 and 3 do not take) or "varlen" (all, on a batch of
    one row: a one-token sequence, one across the first chunk border, one to the end, and
    their final states from cu_seqlens). The configuration is the sm_90 default at
    ``chunk_size`` with ``fused`` overriding its stage 2, or ``config`` when given. ``dims``
    (b, l, h, p, n, g) replaces the small default shape (a ragged last chunk, two groups).
    """
    import torch

    from ..api import forward_stages
    from ..config import SSDConfig, StateConfig, default_config

    if features not in FEATURES:
        raise ValueError(f"features: expected one of {FEATURES}, got {features!r}")
    t = getattr(torch, dtype)
    # Two heads per group at least, so chunk_scan's head block (block_h) is compiled as shipped.
    b, l, h, p, n, g = dims or (2 if features != "varlen" else 1, chunk_size + chunk_size // 2,
                                8, 64, 128, 2)
    if features == "varlen" and b != 1:
        raise ValueError(f"dims: varlen packs sequences along one batch row, got batch {b}")
    x = torch.randn(b, l, h, p, dtype=t)
    B, C = torch.randn(b, l, g, n, dtype=t), torch.randn(b, l, g, n, dtype=t)
    dt, A = torch.rand(b, l, h, dtype=t), -torch.rand(h)
    extra = {}
    if features in ("layer", "all", "varlen"):
        extra = dict(D=torch.randn(h), dt_bias=torch.randn(h), dt_softplus=True)
    if features in ("all", "unpacked", "varlen"):
        extra.update(D=torch.randn(h, p), z=torch.randn(b, l, h, p, dtype=t),
                     initial_states=torch.randn(b, h, p, n), dt_limit=(0.001, 0.1))
    if features == "all":
        extra.update(seq_idx=torch.zeros(b, l, dtype=torch.int32))
    if features == "varlen":
        cu = torch.tensor(sorted({0, 1, min(chunk_size + 3, l - 1), l}), dtype=torch.int32)
        ids = torch.arange(len(cu) - 1, dtype=torch.int32)
        extra.update(seq_idx=torch.repeat_interleave(ids, cu.diff()).reshape(1, l),
                     cu_seqlens=cu)
    if config is None:
        base = default_config((9, 0), chunk_size=chunk_size)
        config = SSDConfig(cumsum=base.cumsum, scan=base.scan,
                           state=StateConfig(**{**base.state.__dict__, "fused": fused}))
    with launch.capture() as records:
        forward_stages(x, dt, A, B, C, chunk_size, config=config, **extra)
    return records


# The decode step's feature sets: "none" (per-head A and dt, nothing optional), "layer" (as
# mamba_ssm's Mamba-2 layer calls it: A, dt, dt_bias and D per head expanded over the head dim
# and the state, softplus) and "all" (every argument per channel, z, a paged cache, a clamp).
DECODE_FEATURES = ("none", "layer", "all")
DECODE_DIMS = (2, 8, 64, 128, 2)  # (b, h, p, n, g)


def capture_decode(dtype: str, features: str, state_dtype: str = "float32", dims=None,
                   config=None, sms: int | None = None):
    """Run the decode step's launcher (:func:`ssd.kernels.state_update.state_update`) on small
    CPU tensors and return the recorded launch. ``features``: one of DECODE_FEATURES; inputs in
    ``dtype``, the state in ``state_dtype``; ``dims`` (b, h, p, n, g) replaces DECODE_DIMS;
    ``config`` a StateUpdateConfig (default: the default's on a GPU of ``sms`` SMs; None: the
    slice of STATE_UPDATE_TILE_BYTES, not narrowed for a small grid)."""
    import torch

    from ..config import StateUpdateConfig, state_update_config
    from ..kernels.state_update import state_update

    if features not in DECODE_FEATURES:
        raise ValueError(f"features: expected one of {DECODE_FEATURES}, got {features!r}")
    t = getattr(torch, dtype)
    b, h, p, n, g = dims or DECODE_DIMS
    x = torch.randn(b, h, p, dtype=t)
    B, C = torch.randn(b, g, n, dtype=t), torch.randn(b, g, n, dtype=t)
    rows, extra = b, {}
    if features == "none":
        dt, A = torch.rand(b, h, dtype=t), -torch.rand(h)
    elif features == "layer":
        dt = torch.rand(b, h, dtype=t)[..., None].expand(b, h, p)
        A = (-torch.rand(h))[:, None, None].expand(h, p, n)  # strides (1, 0, 0)
        extra = dict(D=torch.randn(h)[:, None].expand(h, p),
                     dt_bias=torch.randn(h)[:, None].expand(h, p), dt_softplus=True)
    else:
        rows = 2 * b
        dt, A = torch.rand(b, h, p, dtype=t), -torch.rand(h, p, n)
        extra = dict(D=torch.randn(h, p), dt_bias=torch.randn(h, p), dt_softplus=True,
                     z=torch.randn(b, h, p, dtype=t), dt_limit=(0.001, 0.1),
                     state_batch_indices=torch.randperm(rows)[:b].to(torch.int32))
    state = torch.randn(rows, h, p, n, dtype=getattr(torch, state_dtype))
    if config is None:
        config = state_update_config(StateUpdateConfig(), (b, h, p, n), state.element_size(),
                                     sms)
    with launch.capture() as records:
        state_update(state, x, dt, A, B, C, config=config, **extra)
    return records


def capture_layer(dtype: str, features: str, preset: str = "130m", batch: int = 2,
                  seqlen: int = 300):
    """Run the launchers of the layer's conv and norm (and their backwards) and conv step
    (:mod:`ssd.kernels.causal_conv1d`, :mod:`ssd.kernels.gated_rmsnorm`,
    :mod:`ssd.kernels.conv_step`) on empty CPU tensors in the
    layouts the mixer hands them, and return the recorded launches: xBC and z column slices of
    in_proj's (b, l, d_in_proj) output (one token's row for the step), y the SSD's contiguous
    output, for the ``preset`` layer (``ssd.layer.PRESETS``) at ``batch`` x ``seqlen`` (the
    default has a partial last row block).

    features: "none" (as the mixer calls them: bias and SiLU) or "all" (the conv with seq_idx
    and an initial conv state as well, the step with a paged cache; the norm has no
    options)."""
    import torch

    from ..kernels.causal_conv1d import causal_conv1d, causal_conv1d_backward
    from ..kernels.conv_step import conv_step
    from ..kernels.gated_rmsnorm import gated_rmsnorm, gated_rmsnorm_backward
    from ..layer import PRESETS

    if features not in ("none", "all"):
        raise ValueError(f"features: expected 'none' or 'all', got {features!r}")
    cfg, t = PRESETS[preset], getattr(torch, dtype)
    b, l = batch, seqlen
    zxbcdt = torch.empty(b, l, cfg.d_in_proj, dtype=t)
    z, xBC = zxbcdt[..., :cfg.d_inner], zxbcdt[..., cfg.d_inner:cfg.d_inner + cfg.conv_dim]
    extra, rows, paged = {}, b, {}
    if features == "all":
        extra = dict(seq_idx=torch.zeros(b, l, dtype=torch.int32),
                     initial_states=torch.empty(b, cfg.conv_dim, cfg.d_conv - 1, dtype=t))
        rows, paged = 2 * b, dict(state_batch_indices=torch.zeros(b, dtype=torch.int32))
    weight = torch.empty(cfg.conv_dim, cfg.d_conv, dtype=t)
    bias = torch.empty(cfg.conv_dim, dtype=t)
    with launch.capture() as records:
        causal_conv1d(xBC, weight, bias, **extra)
        causal_conv1d_backward(torch.empty(b, l, cfg.conv_dim, dtype=t), xBC, weight, bias,
                               **extra)
        y = torch.empty(b, l, cfg.d_inner, dtype=t)
        gated_rmsnorm(y, z, torch.empty(cfg.d_inner), cfg.d_inner // cfg.ngroups, 1e-5)
        gated_rmsnorm_backward(torch.empty_like(y), y, z, torch.empty(cfg.d_inner),
                               cfg.d_inner // cfg.ngroups, 1e-5)
        conv_step(torch.empty(rows, cfg.conv_dim, cfg.d_conv - 1, dtype=t), xBC[:, 0], weight,
                  bias, **paged)
    return records


# The backward's feature sets: "none" (no optional input; dt_out recomputed in the kernel) and
# "all" (dt_bias, softplus, a clamp, initial states, dfinal_states, seq_idx, the saved dt_out, and
# the SSM part of y that the z gate's gradient needs, rebuilt by chunk_scan's backward).
BACKWARD_FEATURES = ("none", "all")


def capture_backward(dtype: str, features: str, dprev_in_walk: bool | None = None,
                     fold: bool | None = True):
    """Run the launchers of the backward's cuTile stages (``ssd.kernels.<stage>_backward``:
    chunk_scan, state_passing, chunk_state, chunk_cumsum, in the order the backward calls them)
    on small CPU tensors and return the recorded launches: x, B, C, dt and the saved entering
    states in ``dtype``, as the forward leaves them; the upstream gradients, dt_out and dA_cumsum
    fp32. The shape is the forward's (:func:`capture_forward`): chunk 256, a ragged last chunk,
    two groups of four heads. ``dprev_in_walk`` (``ScanBackwardConfig``'s): the launches of the
    backward that forms dprev_states in state_passing's walk (True) or writes it from chunk_scan's
    states kernel (False); None records both ways. ``fold``: the backward with chunk_state's
    folded into chunk_scan's kernels (True, the default's: the walk, then chunk_scan's kernels
    given dstates; ``ssd.backward.StageBackwards.fold``), the stages one by one (False), or both
    (None; the fold where the walk forms dprev_states): None with dprev_in_walk None is every
    kernel variant."""
    import torch

    from ..backward import EnteringGradient
    from ..config import ScanBackwardConfig
    from ..kernels.chunk_cumsum_backward import chunk_cumsum_backward_cutile
    from ..kernels.chunk_scan_backward import chunk_scan_backward
    from ..kernels.chunk_state_backward import chunk_state_backward_cutile
    from ..kernels.state_passing_backward import state_passing_backward_cutile

    if features not in BACKWARD_FEATURES:
        raise ValueError(f"features: expected one of {BACKWARD_FEATURES}, got {features!r}")
    if fold and dprev_in_walk is False:
        raise ValueError("fold: chunk_state's backward folds only where the walk forms "
                         "dprev_states (dprev_in_walk True or None)")
    t = getattr(torch, dtype)
    q = 256
    b, l, h, p, n, g = 2, q + q // 2, 8, 64, 128, 2
    c = -(-l // q)
    every = features == "all"
    seq_idx = torch.zeros(b, l, dtype=torch.int32) if every else None
    dt_out = torch.rand(b, h, c, q)
    dy, C = torch.randn(b, l, h, p), torch.randn(b, l, g, n, dtype=t)
    unformed = EnteringGradient(dy.to(t), C, None if seq_idx is None else
                                launch.chunk_seq_last(seq_idx, q))

    def scan(**kw):
        return chunk_scan_backward(dy, torch.randn(b, l, g, n, dtype=t), C,
                                   torch.randn(b, l, h, p, dtype=t), dt_out,
                                   -torch.rand(b, h, c, q), torch.randn(b, c, h, p, n, dtype=t),
                                   seq_idx=seq_idx, rebuild_y=every,
                                   D=torch.randn(h) if every else None, **kw)

    def walk(dprev):
        return state_passing_backward_cutile(
            dprev, torch.randn(b, c, h, p, n, dtype=t), -torch.rand(b, h, c, q),
            torch.randn(b, h, p, n) if every else None, seq_idx,
            dfinal_states=torch.randn(b, h, p, n) if every else None,
            dstates_dtype=t)  # as the backward asks: in x's dtype, which chunk_state reads

    with launch.capture() as records:
        if fold is not True:  # the stages one by one
            scan(config=ScanBackwardConfig(dprev_in_walk=dprev_in_walk is True))
            formed = [] if dprev_in_walk else [torch.randn(b, c, h, p, n)]
            for dprev in formed + ([] if dprev_in_walk is False else [unformed]):
                passing = walk(dprev)
            ddt = chunk_state_backward_cutile(
                passing["dstates"], torch.randn(b, l, g, n, dtype=t),
                torch.randn(b, l, h, p, dtype=t), dt_out, -torch.rand(b, h, c, q), seq_idx,
                dx_prior=torch.randn(b, l, h, p),  # the backward's: scan's dx added, the sum in
                dx_dtype=t)["ddt_out"]  # x's dtype
        if fold is not False and dprev_in_walk is not False:  # the walk, then both stages
            ddt = scan(dstates=walk(unformed)["dstates"], dx_dtype=t)["ddt_out"]
        chunk_cumsum_backward_cutile(
            ddt, torch.randn(b, h, c, q), torch.randn(b, l, h, dtype=t), -torch.rand(h),
            q, dt_bias=torch.randn(h) if every else None, dt_softplus=every,
            dt_limit=(0.001, 0.1) if every else (0.0, float("inf")),
            dt_out=dt_out if every else None)
    return records


def compile_all(archs=ARCHS, dtypes=DTYPES, progress=print, forward_only=False) -> list[Compiled]:
    """Export every distinct (kernel, signature) of the forward, and unless ``forward_only`` of
    each packed sequence's final state, the backward's stage kernels (:func:`capture_backward`),
    the decode step and the layer's conv, norm and conv step (:func:`capture_layer`), for each arch.
    ``forward_only`` also keeps to the forward with every feature, whose kernels hold the
    featureless ones' code and more."""
    from ..config import FusedScanConfig, SSDConfig

    done, seen = [], set()
    one_kernel = SSDConfig(fused_scan=FusedScanConfig(enabled=True))
    for dtype in dtypes:
        for features in ("all",) if forward_only else ("none", "all"):
            records = []
            for fused in (True, False):
                records += capture_forward(dtype, features, fused)
                if fused:  # the fused walk's full-chunk variant (seqlen % chunk == 0) as well
                    full = capture_forward(dtype, features, fused, FULL_CHUNK, dims=FULL_DIMS)
                    records += [r for r in full
                                if r.kernel._pyfunc.__name__ == "state_passing_kernel"]
            if features == "all" and not forward_only:  # each packed sequence's final state:
                # its kernel alone (the others of that call are batch-of-one forms of the above)
                records += [r for r in capture_forward(dtype, "varlen", True)
                            if r.kernel._pyfunc.__name__ == "chunk_state_varlen_kernel"]
                # the backward's stage kernels with every option on (the options' flags only
                # take code out: the bare forms cost compile time and risk little; the GPU tests
                # compile every feature set on sm_90)
                records += capture_backward(dtype, "all", fold=None)
            # the one-kernel stages 2 and 3, at the chunk size the default takes them
            records += capture_forward(dtype, "unpacked" if features == "all" else features,
                                       True, 64, config=one_kernel)
            if not forward_only:
                # the decode step: an fp32 state, and one in the inputs' dtype with every feature
                records += capture_decode(dtype, features, "float32")
                if features == "all":
                    records += capture_decode(dtype, "layer", dtype)
                records += capture_layer(dtype, features)
            for record in records:
                sig = launch.signature(record)
                key = (record.kernel, repr(sig))
                if key in seen:
                    continue
                seen.add(key)
                for arch in archs:
                    start = time.perf_counter()
                    cubin = export_cubin(record, arch)
                    item = Compiled(record.kernel._pyfunc.__name__, arch,
                                    dtype if features == "none" else f"{dtype}+{features}",
                                    len(cubin), time.perf_counter() - start)
                    done.append(item)
                    progress(f"[aot] {item.kernel:28s} {item.arch:7s} {item.variant:18s} "
                             f"{item.cubin_bytes / 1024:7.0f} KiB {item.seconds:5.1f} s")
    return done


def export_cubin(record, arch: str) -> bytes:
    from cuda.tile import compilation

    buf = io.BytesIO()
    compilation.export_kernel(record.kernel, [launch.signature(record)], buf, gpu_code=arch,
                              output_format="cubin")
    return buf.getvalue()


def cuobjdump() -> str:
    """The cuobjdump binary: on PATH, or from the nvidia-cuda-cuobjdump wheel."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    import nvidia

    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(candidate)
    raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump")


RESOURCE_FIELDS = {"REG": "registers", "STACK": "stack_bytes", "SHARED": "shared_bytes",
                   "LOCAL": "local_bytes"}


def parse_resource_usage(text: str) -> dict:
    """The one function's line of ``cuobjdump --dump-resource-usage``: REG (per thread), STACK
    (bytes per thread: spills and the call stack), SHARED (bytes per block), LOCAL."""
    lines = [line for line in text.splitlines() if "REG:" in line]
    if len(lines) != 1:
        raise ValueError(f"expected one function's resource line, got {len(lines)}:\n{text}")
    found = dict(re.findall(r"(\w+):(\d+)", lines[0]))
    return {name: int(found[key]) for key, name in RESOURCE_FIELDS.items()}


def _dump(cubin: bytes, option: str) -> str:
    """``cuobjdump <option>`` of one cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([cuobjdump(), option, f.name], check=True, capture_output=True,
                              text=True).stdout


def resource_usage(cubin: bytes) -> dict:
    return parse_resource_usage(_dump(cubin, "--dump-resource-usage"))


def sass(cubin: bytes) -> str:
    """The cubin's machine code as text (``cuobjdump -sass``; it needs nvdisasm, from the
    nvidia-cuda-nvdisasm wheel or on PATH beside cuobjdump)."""
    return _dump(cubin, "-sass")


def study_sms(gpu: str | None = None) -> int:
    """The SM count of the GPU the layout study ran on, from its recording's environment
    (``results/<gpu>/study.json``, default the book's GPU): the study's shapes vary their factors
    around what the API ships for them on that GPU, which depends on the SM count."""
    import json

    from .env import BOOK_GPU, RESULTS

    path = RESULTS / (gpu or BOOK_GPU) / "study.json"
    return json.loads(path.read_text())["environment"]["sm_count"]


def resource_points(sms: int) -> list[tuple]:
    """(space, factor, chunk size, SSDConfig) of every point ``--resources`` records: the generic
    space (``space`` "generic", ``ssd.tools.bench.config_space()``) first, then each study shape's own
    space (``space`` its name; ``config_space(shape.dims, sms)``, the points the study times
    around what the API ships for the shape on a GPU of ``sms`` SMs) without the points whose
    ``config_label`` is already listed. The shape spaces differ from the generic one where the
    shape ships another configuration (2.7b's one-wave stage 2 at chunk 64 on 132 SMs), and those
    kernels are what the study timed there; listing the generic points first, each label once,
    keeps every generic point's row where it was."""
    from .bench import STUDY_SHAPES, SUITES, config_label, config_space

    dims = {s.name: s.dims for s in SUITES["models"]}
    spaces = [("generic", config_space()),
              *((name, config_space(dims[name], sms)) for name in STUDY_SHAPES)]
    points, seen = [], set()
    for space, triples in spaces:
        for factor, q, cfg in triples:
            if config_label(q, cfg) not in seen:
                seen.add(config_label(q, cfg))
                points.append((space, factor, q, cfg))
    return points


def resource_table(points, arch="sm_90", dtype="bfloat16", progress=print) -> list[dict]:
    """Registers, stack, shared memory and compile time of the stage-2 and chunk_scan kernels
    for every (space name, factor, chunk size, SSDConfig) of ``points`` (:func:`resource_points`;
    each row names its space), compiled for ``arch`` with inputs of ``dtype`` and D, as the
    study runs them. The compiled code depends on the compile-time constants and on how the
    launcher specialises the arrays (which sizes are multiples of 16, which are 1:
    :func:`ssd.launch.array_constraint`), so the capture shape has the 2.7b shape's pattern:
    batch not a multiple of 16, sequence, heads, head dim and state multiples of 16, one group
    (130m's 24 heads and codestral-7b's 8 groups differ from it in one array property each)."""
    from .bench import config_label

    # compile_s: the wall time of one compile on this machine's CPU, what a first call pays for
    # the kernel on a GPU host up to the two CPUs' speeds. A kernel found in cuTile's on-disk
    # cache "compiles" in milliseconds, so without CUDA_TILE_CACHE_DIR=off (read when cuda.tile
    # is imported) there is no compile time to record.
    timed = os.environ.get("CUDA_TILE_CACHE_DIR") == "off"
    rows = []
    for space, factor, q, cfg in points:
        records = capture_forward(dtype, "layer", cfg.state.fused, chunk_size=q, config=cfg,
                                  dims=(2, 2 * q, 16, 64, 128, 1))
        for record in records:
            name = record.kernel._pyfunc.__name__
            if name == "chunk_cumsum_kernel":
                continue
            start = time.perf_counter()
            cubin = export_cubin(record, arch)
            rows.append(dict(space=space, factor=factor, label=config_label(q, cfg), kernel=name,
                             compile_s=time.perf_counter() - start if timed else None,
                             **resource_usage(cubin)))
            progress(f"[aot] {rows[-1]}")
    return rows


def tileir_text(record, arch: str = "sm_90") -> str | None:
    """The Tile IR of a captured launch as text (MLIR), or None without ``tileirdisasm``.

    Exports the architecture-independent TileIR bytecode that cuTile hands to ``tileiras``
    and disassembles it with ``tileirdisasm``, which ships next to ``tileiras``.
    """
    from ..kernels.primer import export
    from .doctor import locate_toolchain

    tileiras = locate_toolchain().tileiras.path
    disasm = os.path.join(os.path.dirname(tileiras), "tileirdisasm") if tileiras else None
    if not disasm or not os.path.isfile(disasm):
        return None
    data = export(record, arch, "tileir_bytecode").data
    with tempfile.NamedTemporaryFile(suffix=".tilebc") as f:
        f.write(data)
        f.flush()
        done = subprocess.run([disasm, f.name], capture_output=True, text=True, timeout=60)
    return done.stdout if done.returncode == 0 else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable)")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="input dtype (repeatable)")
    parser.add_argument("--resources", action="store_true",
                        help=f"record the kernels' resources over the tiling study's points "
                             f"(the generic space and each study shape's own) to "
                             f"{RESOURCES.relative_to(RESOURCES.parents[2])} instead")
    parser.add_argument("--sms", type=int,
                        help="with --resources: the SM count the study shapes' spaces are built "
                             "for (default: the sm_count of the layout study recording's "
                             "environment)")
    parser.add_argument("--vary", action="append", metavar="STAGE.FIELD=V1,V2",
                        help="with --resources: print the resources of these points around the "
                             "default (as python -m ssd.tools.bench --vary) instead of recording the "
                             "study's")
    args = parser.parse_args(argv)
    if (args.vary or args.sms) and not args.resources:
        parser.error("--vary and --sms go with --resources")
    if args.resources:
        from .bench import vary_space
        from .env import environment, write_json

        if args.vary:
            points = [("vary", *point) for point in vary_space(args.vary)]
            for row in resource_table(points, progress=lambda line: None):
                print(f"{row['label']:52s} {row['kernel']:22s} reg {row['registers']:3d} "
                      f"stack {row['stack_bytes']:5d} B  shared {row['shared_bytes']:6d} B")
            return 0
        if os.environ.get("CUDA_TILE_CACHE_DIR") != "off":  # compile for real, to time it
            return subprocess.call([sys.executable, "-m", "ssd.tools.aot", *(argv or sys.argv[1:])],
                                   env={**os.environ, "CUDA_TILE_CACHE_DIR": "off"})
        sms = args.sms or study_sms()
        rows = resource_table(resource_points(sms))
        path = write_json(RESOURCES, dict(arch="sm_90", dtype="bfloat16", study_sms=sms, rows=rows,
                                          environment=environment()))
        print(f"[aot] {len(rows)} kernels' resources written to {path}")
        return 0
    done = compile_all(tuple(args.arch or ARCHS), tuple(args.dtype or DTYPES))
    print(f"[aot] {len(done)} cubins, {sum(d.seconds for d in done):.0f} s of compilation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
