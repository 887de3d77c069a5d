"""Benchmark harness: ``python -m ssd.tools.bench --suite models`` (library + command line).

What it does, in order, for every shape of a suite:

1. **Correctness gate.** Every implementation runs once on the shape's inputs and its output
   for the last batch row and two heads is compared with the float64 reference
   (``ssd.problem``); an implementation that fails the gate is recorded as failed and not
   timed.
2. **Timing** with CUDA events around each call, ``reps`` times after ``warmup`` untimed calls;
   we report the median and the 20/80 % quantiles. Two L2 conditions: ``flushed`` (a 512 MiB
   buffer is zeroed before every call, so inputs come from HBM, as in a model where other
   layers ran in between) and ``warm`` (back-to-back calls; inputs may sit in the 60 MiB
   L2). Two launch modes: ``eager`` (Python launches every kernel) and ``graph`` (one CUDA
   graph replay: host launch overhead removed, the fair comparison at small shapes).
3. **Peers in the same process, on the same inputs**: mamba_ssm's Triton forward and ours at
   chunk sizes 64/128/256 (each implementation's fastest counts), TileGym's cuTile forward
   untuned (and tuned, when asked, with its tuning time recorded). Times on these machines
   vary by up to 30 % between two machines of one kind, so results are compared as ratios
   within one run.
4. **Floors** from ceilings measured in the same run (device-to-device copy bandwidth, bf16
   matmul rate) and the model in :func:`floor_ms`.
5. **Compile time** apart from steady state: each record keeps the first call's wall time
   (``first_call_s``: compilation or autotuning for a new configuration, plus one run) beside
   the steady-state median; for the "new shape" goal, ``--suite first-call`` times the first
   call in a fresh process with an empty cuTile kernel cache of its own, and the seconds each
   kernel took to compile in it. A first call of ours runs chunk_scan's quick build while its
   tuned build compiles in a child process (:mod:`ssd.launch`): ``tuned_s`` is when that was
   ready, and nothing is gated or timed before it is.

6. **Where the minutes go**: a shape's first calls (compiling, autotuning) cost far more than
   its timed runs. Each shape's wall seconds per phase are recorded (``phase_s``) and printed.
   A suite's :class:`SuitePolicy` says how it spends first calls: the chunk sizes ours runs at
   (the robust suite: one, :data:`OUR_CHUNK`, against mamba_ssm's best of three) and whether
   our kernels for all its shapes are compiled first in parallel processes
   (:func:`compile_ahead`; ours' records then say ``precompiled``, and their ``first_call_s``
   is a cache hit, no compile time).

Results go to ``results/<gpu>/<suite>.json``: a list of records with ``shape``, ``dims``,
``impl``, ``chunk_size``, ``mode``, ``l2``, ``median_ms``, quantiles, ``floor_ms`` and the
environment record (``ssd.tools.env.environment``).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..config import NARROW_STATE, SSDConfig, default_config
from .env import RESULTS, ROOT, environment, gpu_slug, write_json


@dataclass(frozen=True)
class Shape:
    """A benchmark problem: (batch, seqlen, heads, headdim, dstate, groups) and a name.

    ``seq_boundaries``: positions where a new packed sequence starts, the same in every batch
    row (empty: one sequence a row). A packed shape's inputs carry seq_idx (b, l), seq_idx[t] =
    the number of boundaries <= t, so the state resets at each boundary (mamba_ssm's packing).
    """

    name: str
    b: int
    l: int
    h: int
    p: int
    n: int
    g: int = 1
    seq_boundaries: tuple = ()

    @property
    def dims(self):
        return (self.b, self.l, self.h, self.p, self.n, self.g)

    @property
    def packed(self) -> bool:
        return bool(self.seq_boundaries)


@dataclass(frozen=True)
class ModelHeads:
    """The SSD problem of one published model's Mamba-2 layers: h heads of headdim p, state
    size n, g groups of B and C (batch and sequence length are the caller's)."""

    name: str
    h: int
    p: int
    n: int
    g: int


# The Mamba-2 layers of published models, each from its published configuration:
#
# - mamba2-130m .. mamba2-2.7b: d_model 768, 1024, 1536, 2048, 2560 (state-spaces/mamba README,
#   "Pretrained Models": https://github.com/state-spaces/mamba#pretrained-models; e.g.
#   https://huggingface.co/state-spaces/mamba2-130m/blob/main/config.json: d_model 768,
#   ssm_cfg {"layer": "Mamba2"} and nothing else), with the Mamba2 module's defaults expand 2,
#   headdim 64, d_state 128, ngroups 1 (mamba_ssm/modules/mamba2.py,
#   https://github.com/state-spaces/mamba/blob/main/mamba_ssm/modules/mamba2.py): h = 2 d_model / 64.
# - codestral-7b: num_heads 128, head_dim 64, state_size 128, n_groups 8, read from two
#   conversions of mistralai/Mamba-Codestral-7B-v0.1 that agree (quantisation leaves the SSM
#   sizes as they are): https://huggingface.co/mlx-community/Mamba-Codestral-7B-v0.1-8bit/blob/main/config.json
#   and https://huggingface.co/Molbap/code2/blob/main/config.json
# - nemotron-h-4b/8b/56b, nemotron-nano-9b-v2: mamba_num_heads 112/128/256/128, mamba_head_dim
#   64/64/64/80, mamba_state_dim 128/128/256/128, mamba_num_groups 8 (NVIDIA's Megatron Bridge
#   model providers: https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/src/megatron/bridge/models/nemotronh/nemotron_h_provider.py;
#   Nemotron-H's Mamba width is heads x head_dim, not 2 d_model).
# - bamba-9b: mamba_n_heads 128, mamba_d_head 64, mamba_d_state 128, mamba_n_groups 1:
#   https://huggingface.co/ibm-fms/Bamba-9B-1.8T/blob/main/config.json
# - granite-4.0-h-small/-tiny/-350m, read from the GGUF metadata of IBM's and Ollama's builds
#   (llama.cpp's Mamba-2 keys: ssm.time_step_rank is the head count, head dim = ssm.inner_size
#   / heads): inner 8192 / 3072 / 1536, heads 128 / 48 / 48, state 128, groups 1
#   (https://ollama.com/ibm/granite4:small-h-q6_K, https://ollama.com/library/granite4:7b-a1b-h,
#   https://ollama.com/ibm/granite4:350m-h-base-q4_K_S).
# - zamba2-2.7b: n_mamba_heads 80, mamba_headdim 64, mamba_d_state 64, mamba_ngroups 1:
#   https://huggingface.co/Zyphra/Zamba2-2.7B-Instruct-v2/blob/main/config.json
#   Left out: Zamba2-1.2B and -7B (the configs found do not state ngroups).
MAMBA2_MODELS = (
    ModelHeads("mamba2-130m", 24, 64, 128, 1), ModelHeads("mamba2-370m", 32, 64, 128, 1),
    ModelHeads("mamba2-780m", 48, 64, 128, 1), ModelHeads("mamba2-1.3b", 64, 64, 128, 1),
    ModelHeads("mamba2-2.7b", 80, 64, 128, 1), ModelHeads("codestral-7b", 128, 64, 128, 8),
    ModelHeads("nemotron-h-4b", 112, 64, 128, 8), ModelHeads("nemotron-h-8b", 128, 64, 128, 8),
    ModelHeads("nemotron-h-56b", 256, 64, 256, 8),
    ModelHeads("nemotron-nano-9b-v2", 128, 80, 128, 8),
    ModelHeads("bamba-9b", 128, 64, 128, 1), ModelHeads("granite-4.0-h-small", 128, 64, 128, 1),
    ModelHeads("granite-4.0-h-tiny", 48, 64, 128, 1),
    ModelHeads("granite-4.0-h-350m", 48, 32, 128, 1), ModelHeads("zamba2-2.7b", 80, 64, 64, 1),
)


@dataclass(frozen=True)
class RobustDraw:
    """How :func:`robust_shapes` draws: ``per_model`` shapes of every model of ``models``, batch
    and sequence length log-uniform over ``batch`` and ``seqlen`` (inclusive), half of the shapes
    packed with 2 to ``max_sequences`` sequences a row, half of the lengths a power of two and
    half ragged, at most ``token_heads`` b x l x h each (the cap keeps the largest inputs under a
    GB and a forward well under a second: a shape above it loses batch rows first, then tokens)."""

    seed: int = 20240531
    per_model: int = 2
    batch: tuple = (1, 32)
    seqlen: tuple = (256, 32768)
    max_sequences: int = 8
    token_heads: int = 2**22
    models: tuple = MAMBA2_MODELS


def _stratified(rng, count: int):
    """``count`` draws of U(0, 1), one in each of ``count`` equal strata, in random order: a
    small sample still reaches both ends of the range."""
    return (rng.permutation(count) + rng.random(count)) / count


def robust_shapes(draw: RobustDraw = RobustDraw()) -> list:
    """The ``robust`` suite: shapes drawn with ``draw.seed`` from the Mamba-2 layers of published
    models (:data:`MAMBA2_MODELS`) x batch x sequence length x packed or not, the same list on
    every machine (numpy's Generator). Named ``r<i>-<model>-b<b>-l<l>`` plus ``-s<k>`` for k
    packed sequences a row: the names say what a shape is, nothing is chosen by name."""
    rng = np.random.default_rng(draw.seed)
    count = draw.per_model * len(draw.models)
    models = np.resize(np.arange(len(draw.models)), count)
    rng.shuffle(models)
    (b_lo, b_hi), (l_lo, l_hi) = draw.batch, draw.seqlen
    batch = np.rint(b_lo * (b_hi / b_lo) ** _stratified(rng, count)).astype(int)
    log_l = np.log2(l_lo) + np.log2(l_hi / l_lo) * _stratified(rng, count)
    ragged = rng.permutation(count) % 2 == 1
    packed = rng.permutation(count) % 2 == 0
    shapes = []
    for i in range(count):
        m = draw.models[models[i]]
        b = int(batch[i])
        l = int(np.rint(2.0 ** log_l[i])) if ragged[i] else int(2 ** np.rint(log_l[i]))
        if b * l * m.h > draw.token_heads:  # fewer rows first, then a shorter sequence
            b = max(1, draw.token_heads // (l * m.h))
            l = min(l, draw.token_heads // (b * m.h))
        boundaries = ()
        if packed[i]:
            k = int(rng.integers(2, draw.max_sequences + 1))
            boundaries = tuple(int(t) for t in np.sort(rng.choice(np.arange(1, l), k - 1,
                                                                   replace=False)))
        tag = f"-s{len(boundaries) + 1}" if boundaries else ""
        shapes.append(Shape(f"r{i:02d}-{m.name}-b{b}-l{l}{tag}", b, l, m.h, m.p, m.n, m.g,
                            boundaries))
    return shapes


SUITES = {
    "models": [Shape("130m", 8, 2048, 24, 64, 128, 1), Shape("2.7b", 4, 4096, 80, 64, 128, 1),
               Shape("long-16k", 1, 16384, 80, 64, 128, 1),
               Shape("codestral-7b", 2, 8192, 128, 64, 128, 8),
               Shape("small-state", 16, 1024, 32, 64, 64, 1)],
    # A serving-style prefill: one short prompt on the 2.7b layer, and a small batch of them.
    "serving": [Shape("prompt-512", 1, 512, 80, 64, 128, 1),
                Shape("prompts-8x1k", 8, 1024, 80, 64, 128, 1)],
    # Sequence-length sweep on the 2.7b layer at a fixed token budget of 64k tokens.
    "seqlen": [Shape(f"2.7b-l{l}", max(1, 65536 // l), l, 80, 64, 128, 1)
               for l in (1024, 2048, 4096, 8192, 16384, 32768, 65536)],
    # Shapes drawn from the Mamba-2 layers of published models, packed or not (robust_shapes).
    "robust": robust_shapes(),
}
# The suites time every implementation that takes a chunk size at each of these and count its
# fastest: the issue asks it of mamba_ssm, and ours is held to the same rule (TileGym tuned picks
# its own in its search). The output does not depend on the chunk size, only the time does.
SUITE_CHUNKS = (64, 128, 256)
STUDY_SHAPES = ("130m", "2.7b")
# The chunk size of the tiling study's default point (chapter 09 times 128 and 256 beside it) and
# of the first-call suite: the fastest of SUITE_CHUNKS for ours on four of the five models shapes
# in the models run (small-state is 4 % faster at 128).
OUR_CHUNK = 64


@dataclass(frozen=True)
class SuitePolicy:
    """How a suite spends its first calls (most of a shape's minutes: compiling, autotuning).

    ``our_chunks``: the chunk sizes ours is timed at, its fastest counting. Every peer that
    takes a chunk size keeps all of :data:`SUITE_CHUNKS` and its fastest: timing ours at fewer
    can only make ours look slower, never faster.
    ``precompile``: our kernels for every shape of the run are compiled before any timing, in
    parallel processes (:func:`compile_ahead`), so ours' first calls are cache hits; its
    records then say ``precompiled`` and their ``first_call_s`` is no compile time. Off where
    first-call seconds are a result (the models suite's, the first-call suite's)."""

    our_chunks: tuple = SUITE_CHUNKS
    precompile: bool = False


#: Each suite's :class:`SuitePolicy` (a suite not named here: the default, as models).
#: robust asks whether ours beats mamba_ssm's best chunk size on every shape (issue 46): ours runs
#: at the one chunk size the API is recommended at (OUR_CHUNK), mamba_ssm at its best of three.
#: serving reports no first call: its kernels are compiled ahead.
SUITE_POLICIES = {
    "robust": SuitePolicy(our_chunks=(OUR_CHUNK,), precompile=True),
    "serving": SuitePolicy(precompile=True),
}


# ----------------------------------------------------------------------------- inputs


def make_inputs(shape: Shape, dtype="bfloat16", seed=0, device="cuda") -> dict:
    """Model-like inputs: what a Mamba-2 layer passes (D per head, dt_bias, softplus).

    x, B, C ~ N(0, 1); dt_bias chosen so dt' = softplus(dt + dt_bias) lies in the
    Mamba-2 initialisation range [1e-3, 1e-1]; A = -exp(U(0, log 16)). A packed shape
    (``shape.seq_boundaries``) adds seq_idx (b, l) int32, the same in every row.
    """
    import torch

    t = getattr(torch, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    b, l, h, p, n, g = shape.dims

    def randn(*size, dt=t):
        return torch.randn(*size, device=device, dtype=torch.float32, generator=gen).to(dt)

    target = torch.exp(torch.empty(h, device=device).uniform_(math.log(1e-3), math.log(1e-1),
                                                              generator=gen))
    inputs = dict(
        x=randn(b, l, h, p), B=randn(b, l, g, n), C=randn(b, l, g, n),
        dt=(0.5 * randn(b, l, h, dt=torch.float32)).to(t),
        dt_bias=torch.log(torch.expm1(target)),  # inverse softplus of the target step
        A=-torch.exp(torch.empty(h, device=device).uniform_(0, math.log(16), generator=gen)),
        D=randn(h, dt=torch.float32),
    )
    if shape.packed:
        inputs["seq_idx"] = packed_seq_idx(shape, device)
    return inputs


def packed_seq_idx(shape: Shape, device="cuda"):
    """seq_idx (b, l) int32 of a packed shape: at t, the number of its seq_boundaries <= t."""
    import torch

    starts = torch.tensor(shape.seq_boundaries, dtype=torch.int32, device=device)
    positions = torch.arange(shape.l, dtype=torch.int32, device=device)
    row = torch.searchsorted(starts, positions, right=True).to(torch.int32)  # (l,)
    return row.expand(shape.b, shape.l).contiguous()


def _forward_args(inputs):
    """x, dt, A, B, C, D, dt_bias from a ``make_inputs`` dict, in the forward's order."""
    return tuple(inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))


def positive_dt(inputs):
    """dt' = softplus(dt + dt_bias) for peers that take the step already transformed."""
    import torch

    return torch.nn.functional.softplus(inputs["dt"].float() + inputs["dt_bias"]).to(inputs["dt"].dtype)


# ----------------------------------------------------------------------------- implementations


def implementations(inputs, names=("ssd", "mamba_ssm", "tilegym"), config=None,
                    our_chunks=SUITE_CHUNKS):
    """name -> {chunk_size: zero-argument callable returning y}, for the peers available, and
    name -> why, for those skipped: ours at ``our_chunks`` (:class:`SuitePolicy`), mamba_ssm at
    every one of SUITE_CHUNKS. Packed inputs (a ``seq_idx`` key) go with their seq_idx to
    every implementation that takes it (ours, mamba_ssm's)."""
    import torch

    from .. import api
    from . import peers

    x, dt, A, B, C, D, bias = _forward_args(inputs)
    packed = {"seq_idx": inputs["seq_idx"]} if "seq_idx" in inputs else {}
    out, skipped = {}, {}
    if "ssd" in names:
        out["ssd"] = {q: (lambda q=q: api.mamba_chunk_scan_combined(
            x, dt, A, B, C, q, D=D, dt_bias=bias, dt_softplus=True, config=config, **packed))
            for q in our_chunks}
    if "mamba_ssm" in names:
        try:
            mamba = peers.mamba_ssm_forward()
            out["mamba_ssm"] = {q: (lambda q=q: mamba(x, dt, A, B, C, q, D=D, dt_bias=bias,
                                                      dt_softplus=True, **packed))
                                for q in SUITE_CHUNKS}
        except peers.PeerUnavailable as exc:
            skipped["mamba_ssm"] = str(exc)
    for name in ("tilegym", "tilegym_tuned"):
        if name not in names:
            continue
        if packed:
            skipped[name] = "TileGym's forward takes no seq_idx (packed sequences)"
            continue
        try:
            tg = peers.tilegym_adapter()
        except peers.PeerUnavailable as exc:
            skipped[name] = str(exc)
            continue
        if x.shape[1] % 64:
            skipped[name] = "seqlen not a multiple of TileGym's chunk size"
            continue
        dtp = positive_dt(inputs)  # TileGym takes dt' directly: its softplus is not timed
        init = torch.zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1], device=x.device)
        out[name] = {64: lambda dtp=dtp, init=init: tg(x, dtp, A, B, C, 64, D=D,
                                                       initial_states=init)[0]}
    return out, skipped


# ----------------------------------------------------------------------------- timing


_FLUSH = {}


def _flush_buffer():
    import torch

    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(512 * 2**20, dtype=torch.int8, device="cuda")
    return _FLUSH["buf"]


def graph_replay(fn):
    """``fn`` captured into a CUDA graph; returns the graph's ``replay``. Two calls on a side
    stream come first: they compile, autotune and allocate, none of which a capture may do."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_fn(fn, *, mode="graph", l2="flushed", reps=50, warmup=5) -> dict:
    """Median and quantiles (ms) of ``fn`` timed with CUDA events, warm-up excluded.

    mode "graph" captures one call into a CUDA graph and times its replay; "eager" times the
    Python call. l2 "flushed" zeroes a 512 MiB buffer (outside the timed region) before each
    call; "warm" does not.
    """
    import torch

    from .. import launch

    launch.wait_tuned()  # steady state is the tuned kernels'
    call = graph_replay(fn) if mode == "graph" else fn
    for _ in range(warmup):
        call()
    flush = _flush_buffer() if l2 == "flushed" else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        call()
        ends[i].record()
    torch.cuda.synchronize()
    ms = np.array([s.elapsed_time(e) for s, e in zip(starts, ends)])
    return dict(median_ms=float(np.median(ms)), q20_ms=float(np.quantile(ms, 0.2)),
                q80_ms=float(np.quantile(ms, 0.8)), min_ms=float(ms.min()), reps=reps)


def measure_ceilings() -> dict:
    """Device-to-device copy bandwidth, bf16 matmul rate and fp32 FMA rate of the CUDA cores
    (:mod:`ssd.tools.rate_kernel`), measured now on this GPU. (No L2
    tile ceiling: a kernel that only loaded bf16 [64, 64] tiles from L2 took them at 4.0 TB/s on
    the H200, below the modelled tile traffic the stages reach, so it bounds nothing.)"""
    import torch

    from .rate_kernel import launch_fma_chain

    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = time_fn(lambda: dst.copy_(src), mode="eager", l2="warm", reps=20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = time_fn(lambda: a @ a, mode="eager", l2="warm", reps=20)
    x = torch.rand(2**24, device="cuda")
    y = torch.empty_like(x)
    fma_flops = launch_fma_chain(x, y)  # the first launch compiles
    fma = time_fn(lambda: launch_fma_chain(x, y), mode="eager", l2="warm", reps=20)
    return dict(copy_bytes_per_s=2 * 2**30 / (copy["median_ms"] * 1e-3),
                bf16_flops_per_s=2 * 8192**3 / (mm["median_ms"] * 1e-3),
                fp32_fma_flops_per_s=fma_flops / (fma["median_ms"] * 1e-3))


def floor_ms(shape: Shape, ceilings: dict, dtype_bytes=2) -> dict:
    """The time no implementation of this forward can beat on this GPU (ms).

    Traffic: the compulsory bytes of the whole forward: read x, dt, B, C once, write y and
    the fp32 final state (intermediates kept on chip). FLOPs: the chunked algorithm at the
    chunk size among 64/128/256 that needs the fewest, counting only the causal half of the
    q x q blocks, C Bᵀ once per group, and chunk_state + state_passing + the off-diagonal
    term (``ssd.cost.ssd_costs`` with the diagonal-block terms halved). floor = max(bytes /
    copy bandwidth, FLOPs / bf16 matmul rate).
    """
    from ..cost import ssd_costs

    b, l, h, p, n, g = shape.dims
    bytes_ = (2 * b * l * h * p + b * l * h + 2 * b * l * g * n) * dtype_bytes + b * h * p * n * 4
    best = None
    for q in SUITE_CHUNKS:
        c = math.ceil(l / q)
        costs = ssd_costs(shape.dims, q, cb_per_group=True)
        square = 2 * b * c * q * q * (n * g + h * p)  # C Bᵀ and (L o C Bᵀ) x, full blocks
        flops = costs["total"]["flops"] - square // 2
        best = flops if best is None else min(best, flops)
    t_bytes = bytes_ / ceilings["copy_bytes_per_s"] * 1e3
    t_flops = best / ceilings["bf16_flops_per_s"] * 1e3
    return dict(floor_ms=max(t_bytes, t_flops), floor_bytes=bytes_, floor_flops=best,
                floor_bound="memory" if t_bytes >= t_flops else "compute")


# ----------------------------------------------------------------------------- gate


class Gate:
    """The correctness gate of one shape's inputs: the float64 reference on the last batch row
    and the last ``heads`` heads (full sequence), computed once, then compared with each
    implementation's output (a reference takes seconds on the CPU; a shape is gated a dozen
    times or more)."""

    def __init__(self, shape: Shape, inputs: dict, heads=2, tol=1.5e-2):
        """``tol``: the bf16 tolerance of the GPU tests (relative Frobenius error)."""
        from ..problem import ProblemSpec

        if heads > shape.h // shape.g:
            raise ValueError(f"heads: the gate checks heads of one group (at most "
                             f"{shape.h // shape.g})")
        self.heads, self.tol = slice(shape.h - heads, shape.h), tol
        gsel = slice(shape.g - 1, shape.g)  # the last heads read the last group's B and C
        spec = ProblemSpec(1, shape.l, heads, shape.p, shape.n, 1, chunk_size=256, D="h",
                           dt_bias=True, dt_softplus=True, name=shape.name)
        hs = self.heads
        sl = dict(x=_np64(inputs["x"][-1:, :, hs]), dt=_np64(inputs["dt"][-1:, :, hs]),
                  A=_np64(inputs["A"][hs]), B=_np64(inputs["B"][-1:, :, gsel]),
                  C=_np64(inputs["C"][-1:, :, gsel]), D=_np64(inputs["D"][hs]),
                  dt_bias=_np64(inputs["dt_bias"][hs]))
        if "seq_idx" in inputs:  # packed: the last row's sequences, as the forward saw them
            sl["seq_idx"] = inputs["seq_idx"][-1:].cpu().numpy().astype(np.int32)
        self.ref = spec.reference(sl)["y"]  # (1, l, heads, p)

    def __call__(self, y) -> float:
        """Relative error of ``y`` (b, l, h, p) on the gated slice; negative: failed."""
        out = _np64(y[-1:, :, self.heads])
        if not np.isfinite(out).all():
            return math.inf
        err = float(np.linalg.norm(out - self.ref) / np.linalg.norm(self.ref))
        return err if err <= self.tol else -err


def _np64(t):
    return t.detach().double().cpu().numpy()


def worst(*errs: float) -> float:
    """The worst of several :class:`Gate` results (a failure, negative or inf, before any pass)."""
    return max(errs, key=lambda e: (e < 0 or not math.isfinite(e), abs(e)))


def first_call(fn):
    """Call ``fn`` for the first time and then once more after every tuned build it started in
    the background is ready (:mod:`ssd.launch`). Returns (the first call's seconds, compilation
    included; the seconds from its start until the tuned builds were ready, None where it started
    none; the first output; the later one, which the tuned kernels computed)."""
    import torch

    from .. import launch

    torch.cuda.synchronize()
    start = time.perf_counter()
    y_first = fn()
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    tuned_s = time.perf_counter() - start if launch.wait_tuned() else None
    return first_s, tuned_s, y_first, fn()


# ----------------------------------------------------------------------------- stages


# the stage-time key of the one-kernel stages 2 and 3 (ssd.kernels.fused_scan)
FUSED_SCAN_STAGE = "chunk_state+state_passing+chunk_scan"


def stage_times(inputs, chunk_size=OUR_CHUNK, config=None, reps=30) -> dict:
    """Per-stage times (ms, eager, L2 flushed) of ours, from the intermediates of one run: its
    kernels, each alone (stages fused into one kernel under one key, "+" between their names)."""
    from .. import api
    from ..kernels import chunk_cumsum
    from ..kernels import chunk_scan
    from ..kernels import chunk_state
    from ..kernels import fused_scan
    from ..kernels import state_passing

    x, dt, A, B, C, D, bias = _forward_args(inputs)
    config = api.resolve_config(config, chunk_size, x, B)
    r = api.forward_stages(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias, dt_softplus=True,
                           config=config)
    t = {}
    t["chunk_cumsum"] = time_fn(lambda: chunk_cumsum.chunk_cumsum(
        dt, A, chunk_size, dt_bias=bias, dt_softplus=True, config=config.cumsum),
        mode="eager", reps=reps)["median_ms"]
    if api.takes_fused_scan(config, None):
        t[FUSED_SCAN_STAGE] = time_fn(lambda: fused_scan.fused_scan(
            B, C, x, r["dt_out"], r["dA_cumsum"], D=D, config=config.fused_scan), mode="eager",
            reps=reps)["median_ms"]
        return t
    groups = None
    if config.state.groups > 1:  # both kernels of the grouped walk
        groups = state_passing.Groups(r["chunk_decay"], r["group_enter"],
                                      state_passing.chunks_per_group(r["dA_cumsum"].shape[2],
                                                                     config.state.groups))
        t["chunk_state+state_passing"] = time_fn(lambda: state_passing.grouped_chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], config=config.state), mode="eager",
            reps=reps)["median_ms"]
    elif config.state.fused:
        t["chunk_state+state_passing"] = time_fn(lambda: state_passing.chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], config=config.state), mode="eager",
            reps=reps)["median_ms"]
    else:
        t["chunk_state"] = time_fn(lambda: chunk_state.chunk_state(
            B, x, r["dt_out"], r["dA_cumsum"], config=config.state), mode="eager",
            reps=reps)["median_ms"]
        t["state_passing"] = time_fn(lambda: state_passing.state_passing(
            r["states"], r["dA_cumsum"], config=config.state), mode="eager", reps=reps)["median_ms"]
    t["chunk_scan"] = time_fn(lambda: chunk_scan.chunk_scan(
        B, C, x, r["dt_out"], r["dA_cumsum"], r["prev_states"], D=D, config=config.scan,
        groups=groups),
        mode="eager", reps=reps)["median_ms"]
    return t


def mamba_ssm_stage_times(inputs, chunk_size, reps=30) -> dict:
    """Per-stage times (ms, eager, L2 flushed) of mamba_ssm's five Triton kernels."""
    import torch

    from . import peers

    peers.mamba_ssm_forward()  # makes mamba_ssm's Triton submodules importable
    from mamba_ssm.ops.triton.ssd_bmm import _bmm_chunk_fwd
    from mamba_ssm.ops.triton.ssd_chunk_scan import _chunk_scan_fwd
    from mamba_ssm.ops.triton.ssd_chunk_state import _chunk_cumsum_fwd, _chunk_state_fwd
    from mamba_ssm.ops.triton.ssd_state_passing import _state_passing_fwd

    x, dt, A, B, C, D, bias = _forward_args(inputs)
    b, l, h, p = x.shape
    dA, dto = _chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=bias, dt_softplus=True)
    st = _chunk_state_fwd(B, x, dto, dA, states_in_fp32=True)
    flat = st.reshape(*st.shape[:-2], -1)
    prev, _ = _state_passing_fwd(flat, dA[:, :, :, -1], chunk_size=chunk_size, out_dtype=C.dtype)
    prev = prev.reshape(st.shape)
    cb = _bmm_chunk_fwd(C, B, chunk_size, output_dtype=torch.float32)
    run = {
        "chunk_cumsum": lambda: _chunk_cumsum_fwd(dt, A, chunk_size, dt_bias=bias, dt_softplus=True),
        "chunk_state": lambda: _chunk_state_fwd(B, x, dto, dA, states_in_fp32=True),
        "state_passing": lambda: _state_passing_fwd(flat, dA[:, :, :, -1], chunk_size=chunk_size,
                                                    out_dtype=C.dtype),
        "bmm": lambda: _bmm_chunk_fwd(C, B, chunk_size, output_dtype=torch.float32),
        "chunk_scan": lambda: _chunk_scan_fwd(cb, x, dto, dA, C, prev, D=D),
    }
    return {k: time_fn(f, mode="eager", reps=reps)["median_ms"] for k, f in run.items()}


def tilegym_stage_times(inputs, chunk_size=64, reps=30) -> dict:
    """Per-stage times (ms, eager, L2 flushed) of TileGym's three cuTile kernels, each with the
    configuration its forward chose on these inputs (call it after the timed forward, so that a
    tuned process has tuned this shape): chunk_cumsum, the fused state walk, the outputs."""
    import torch

    from tilegym.ops.cutile import mamba2 as tg

    x, dt, A, B, C, D, bias = _forward_args(inputs)
    dtp = positive_dt(inputs)
    init = torch.zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1], device=x.device)
    dec_bth, dec_bht, dt_bht = tg._chunk_cumsum(A, dtp, chunk_size=chunk_size)
    hid, _ = tg._fwd_pass_state(x, B, dtp, dt_bht, dec_bth, dec_bht, init, chunk_size=chunk_size,
                                state_dtype=C.dtype)
    run = {
        "chunk_cumsum": lambda: tg._chunk_cumsum(A, dtp, chunk_size=chunk_size),
        "state": lambda: tg._fwd_pass_state(x, B, dtp, dt_bht, dec_bth, dec_bht, init,
                                            chunk_size=chunk_size, state_dtype=C.dtype),
        "out": lambda: tg._compute_out(x, B, C, D, dt_bht, dec_bht, hid, chunk_size=chunk_size),
    }
    return {k: time_fn(f, mode="eager", reps=reps)["median_ms"] for k, f in run.items()}


# ----------------------------------------------------------------------------- suites


def _progress(items, desc):
    try:
        from tqdm.auto import tqdm

        return tqdm(items, desc=desc, file=sys.stdout)
    except ImportError:
        return items


#: The clock of :class:`PhaseClock` (a name of its own, so that a test can stub it).
_now = time.perf_counter


class PhaseClock:
    """Wall seconds per phase of a run: ``with clock("gate"): ...`` adds the block's seconds to
    "gate" (a phase entered several times adds up). :meth:`stop` returns them with ``other``
    (what no phase covered) and ``total`` (since the clock was made)."""

    def __init__(self):
        self.started, self.seconds = _now(), {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        start = _now()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + _now() - start

    def stop(self) -> dict:
        total = _now() - self.started
        return dict(self.seconds, other=total - sum(self.seconds.values()), total=total)


def phase_line(name: str, seconds: dict) -> str:
    """One line of a :meth:`PhaseClock.stop` result: the total, then each phase in the order
    it first ran, ``other`` last."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in seconds.items() if k != "total")
    return f"[bench] {name}: {seconds['total']:.1f} s: {parts}"


def run_suite(shapes, *, impls=("ssd", "mamba_ssm", "tilegym"), modes=("graph", "eager"),
              l2s=("flushed", "warm"), reps=50, config=None, stages=True, ceilings=None,
              dtype="bfloat16", tilegym_replay=None, policy=SuitePolicy(),
              compile_workers=None) -> dict:
    """Gate, then time every implementation on every shape; return the suite's payload.

    mamba_ssm's autotuned kernels are reset before each shape (:func:`ssd.tools.peers.retune_mamba_ssm`),
    so its first call on a shape tunes for that shape; the tuning is in ``first_call_s``, never
    in the steady-state times. ``tilegym_replay`` (shape -> a recorded TileGym tuning run, see
    :func:`tilegym_replay_source`): TileGym tuned takes that run's configurations instead of
    searching (:func:`ssd.tools.peers.tilegym_replaying`); its records say ``tuning="replayed"`` and its
    ``first_call_s`` holds no tuning (the run it replays kept that).

    ``policy`` (:class:`SuitePolicy`): the chunk sizes ours runs at, and whether our kernels
    for every shape are compiled first, in ``compile_workers`` processes (default
    :data:`COMPILE_WORKERS`); then ours' records say ``precompiled``.

    Where the minutes go: ``phase_s`` (shape -> phase -> wall seconds: ``inputs``, ``gate``
    (the float64 reference and the comparisons), ``first/<impl>`` (first calls: compiling,
    autotuning, waiting for tuned builds, plus two runs), ``timed/<impl>``, ``stages``,
    ``other``, ``total``), printed a line a shape; ``run_phase_s``: a list of one row (shapes,
    ``precompile``, ``ceilings``, ``total``, ...), a list so that merged runs keep each one's.
    """
    import torch

    from . import peers

    if "tilegym" in impls and "tilegym_tuned" not in impls:
        os.environ["TILEGYM_DISABLE_AUTOTUNE"] = "1"  # untuned default, chunk 64
    precompiled = policy.precompile and "ssd" in impls
    workers = compile_workers or COMPILE_WORKERS
    run_clock = PhaseClock()
    records, failures, skipped_all, stage_rows, tuned = [], [], {}, [], {}
    tilegym_tuned, tilegym_stages, phase_s = {}, {}, {}
    with contextlib.ExitStack() as stack:
        if precompiled:
            with run_clock("precompile"):
                compile_ahead([(s, q, config) for s in shapes for q in policy.our_chunks],
                              workers)
            # the tuned builds are in the cache: a first call launches them, no quick build
            stack.enter_context(_environ(SSD_QUICK_FIRST_CALL="0"))
        if ceilings is None:
            with run_clock("ceilings"):
                ceilings = measure_ceilings()
        with run_clock("all_shapes"):
            for shape in _progress(shapes, "shapes"):
                clock = PhaseClock()
                with clock("inputs"):
                    inputs = make_inputs(shape, dtype)
                with clock("gate"):
                    gate = Gate(shape, inputs)
                table, skipped = implementations(inputs, impls, config, policy.our_chunks)
                skipped_all.update({f"{shape.name}/{k}": v for k, v in skipped.items()})
                floor = floor_ms(shape, ceilings)
                packing = dict(seq_boundaries=list(shape.seq_boundaries)) if shape.packed else {}
                if "mamba_ssm" in table:
                    peers.retune_mamba_ssm()  # tune on this shape, not on the first one
                replayed = (tilegym_replay or {}).get(shape.name)
                replaying = (peers.tilegym_replaying(replayed["configs"])
                             if replayed and "tilegym_tuned" in table
                             else contextlib.nullcontext())
                with replaying:
                    for impl, by_chunk in table.items():
                        for q, fn in by_chunk.items():
                            try:
                                with clock(f"first/{impl}"):
                                    first_s, tuned_s, y_first, y = first_call(fn)
                            except Exception as exc:  # a peer that crashes is a result
                                failures.append(dict(shape=shape.name, impl=impl, chunk_size=q,
                                                     error=f"{type(exc).__name__}: {exc}"[:400]))
                                continue
                            with clock("gate"):
                                err = worst(gate(y_first), gate(y))
                            if err < 0 or not math.isfinite(err):
                                failures.append(dict(
                                    shape=shape.name, impl=impl, chunk_size=q,
                                    error=f"correctness gate: rel err {abs(err):.3e}"))
                                continue
                            tuning = {} if tuned_s is None else dict(tuned_s=tuned_s)
                            if impl == "tilegym_tuned":
                                tuning = dict(tuning="replayed" if replayed else "searched")
                            if impl == "ssd" and precompiled:  # first_call_s: a cache hit
                                tuning["precompiled"] = True
                            with clock(f"timed/{impl}"):
                                for mode in modes:
                                    for l2 in l2s:
                                        stats = time_fn(fn, mode=mode, l2=l2, reps=reps)
                                        records.append(dict(
                                            shape=shape.name, dims=list(shape.dims), impl=impl,
                                            chunk_size=q, mode=mode, l2=l2, dtype=dtype,
                                            **packing, **stats, **floor, gate_rel_err=err,
                                            first_call_s=first_s, **tuning))
                    # ours' stage times at its fastest chunk size, as the peers' at theirs
                    our_q = fastest_chunk(records, shape.name, "ssd") or OUR_CHUNK
                    if stages and not shape.packed:  # stage_times times the unpacked kernels
                        with clock("stages"):
                            stage_rows.append(_stage_row(shape, inputs, records, our_q, config))
                    if "mamba_ssm" in table:
                        tuned[shape.name] = peers.mamba_ssm_configs()
                    if "tilegym_tuned" in table:
                        tilegym_tuned[shape.name] = peers.tilegym_configs()
                        with clock("stages"):
                            tilegym_stages[shape.name] = dict(
                                ssd_chunk_size=our_q,
                                ssd=stage_times(inputs, our_q, config=config),
                                tilegym_tuned=tilegym_stage_times(inputs))
                del inputs
                torch.cuda.empty_cache()
                phase_s[shape.name] = clock.stop()
                print(phase_line(shape.name, phase_s[shape.name]), flush=True)
    run_phase = dict(shapes=[s.name for s in shapes], **run_clock.stop())
    if precompiled:
        run_phase["compile_workers"] = workers
    settings = dict(reps=reps, warmup=5, flush_bytes=512 * 2**20, timer="CUDA events",
                    statistic="median", mamba_ssm_autotune="per shape",
                    our_chunk_sizes=list(policy.our_chunks), precompiled=precompiled)
    payload = dict(records=records, stages=stage_rows, failures=failures, skipped=skipped_all,
                   mamba_ssm_configs=tuned, tilegym_configs=tilegym_tuned,
                   tilegym_stages=tilegym_stages, ceilings=ceilings, settings=settings,
                   phase_s=phase_s, run_phase_s=[run_phase])
    if tilegym_replay:
        payload["tilegym_replayed_from"] = {s: {k: v for k, v in r.items() if k != "configs"}
                                            for s, r in tilegym_replay.items()}
    return payload


def _stage_row(shape, inputs, records, our_q, config) -> dict:
    """:func:`run_suite`'s stage times of one shape: ours' at ``our_q``, mamba_ssm's at its
    fastest chunk size where it ran."""
    row = dict(shape=shape.name, ssd_chunk_size=our_q,
               ssd=stage_times(inputs, our_q, config=config))
    mamba_q = fastest_chunk(records, shape.name, "mamba_ssm")
    if mamba_q:
        row["mamba_ssm_chunk_size"] = mamba_q
        row["mamba_ssm"] = mamba_ssm_stage_times(inputs, mamba_q)
    return row


#: TileGym's tuned configurations per GPU and shape (``make gpu-tilegym`` writes it): the input
#: of ``--tilegym-replay``, not a recording of ours.
TILEGYM_TUNED = RESULTS / "tilegym_tuned.json"


def tilegym_tuning(run: dict, shape: str) -> dict:
    """What a searched TileGym run of ``shape`` (a models-suite payload with ``--impl
    tilegym_tuned``) chose: its configurations, the TileGym version, GPU, date and tuning time
    (its first call's seconds)."""
    configs = run.get("tilegym_configs", {}).get(shape)
    tuned = [r for r in run["records"] if r["impl"] == "tilegym_tuned" and r["shape"] == shape
             and r.get("tuning", "searched") == "searched"]
    if not configs or not tuned:
        raise ValueError(f"no searched TileGym tuning of {shape} in this run")
    env = run["environment"]
    return dict(configs=configs, tilegym=env.get("tilegym"), gpu=env.get("gpu"),
                date=env.get("date"), tuning_s=tuned[0]["first_call_s"])


def _tilegym_table(path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).is_file() else {}


def write_tilegym_table(folder, path=TILEGYM_TUNED) -> Path:
    """Merge the searched runs ``folder/<shape>.json`` into the table at ``path``, under their
    GPU (each run's environment names it)."""
    table = _tilegym_table(path)
    for run_path in sorted(Path(folder).glob("*.json")):
        run = json.loads(run_path.read_text())
        table.setdefault(gpu_slug(run["environment"]), {})[run_path.stem] = tilegym_tuning(
            run, run_path.stem)
    return write_json(path, table)


def tilegym_replay_source(gpu: str, shape: str, path=TILEGYM_TUNED) -> dict:
    """What ``--tilegym-replay`` replays for ``shape`` on ``gpu`` (a slug such as "h200"): the
    configurations TileGym's search chose there, from the table at ``path``."""
    table = _tilegym_table(path)
    if shape not in table.get(gpu, {}):
        raise FileNotFoundError(f"--tilegym-replay: {path} has no tuning of {shape} on {gpu}: "
                                "tune it (make gpu-tilegym)")
    return table[gpu][shape]


def fastest_chunk(records, shape: str, impl: str) -> int | None:
    """The chunk size of ``impl``'s fastest graph-replay, L2-flushed record of ``shape`` (None
    where there is none): the one its stage times are taken at."""
    best = best_records(records, impl).get(shape)
    return best and best["chunk_size"]


def best_records(records, impl, mode="graph", l2="flushed") -> dict:
    """shape -> the fastest record of ``impl`` over its chunk sizes."""
    best = {}
    for r in records:
        if r["impl"] == impl and r["mode"] == mode and r["l2"] == l2:
            if r["shape"] not in best or r["median_ms"] < best[r["shape"]]["median_ms"]:
                best[r["shape"]] = r
    return best


def speedups(records, over="mamba_ssm", mode="graph", l2="flushed") -> dict:
    """shape -> ours / peer speedup (peer at its best chunk size), plus the geometric mean."""
    ours, theirs = best_records(records, "ssd", mode, l2), best_records(records, over, mode, l2)
    common = [s for s in ours if s in theirs]
    out = {s: theirs[s]["median_ms"] / ours[s]["median_ms"] for s in common}
    if out:
        out["geomean"] = float(np.exp(np.mean(np.log(list(out.values())))))
    return out


#: What the robust suite is held to: in CUDA-graph replay a geometric mean of at least 2.0x
#: mamba_ssm's best chunk size and at least 1.6x on every shape; launched eagerly, at least as
#: fast as mamba_ssm launched eagerly on every shape (each bound inclusive).
ROBUST_GOALS = dict(graph_geomean=2.0, graph_min=1.6, eager_min=1.0)


def speedup_summary(records, over="mamba_ssm", l2="flushed", goals=None) -> dict:
    """mode ("graph", "eager") -> ours over ``over``, each at its best chunk size
    (:func:`speedups`): the geometric mean, the slowest shape's speedup and name, and the number
    of shapes both timed. With ``goals`` (as :data:`ROBUST_GOALS`), each mode also says whether
    it met them (``met``)."""
    out = {}
    for mode in ("graph", "eager"):
        sp = speedups(records, over, mode, l2)
        per = {k: v for k, v in sp.items() if k != "geomean"}
        if not per:
            continue
        slowest = min(per, key=per.get)
        out[mode] = dict(geomean=sp["geomean"], min=per[slowest], min_shape=slowest,
                         shapes=len(per))
        if goals:
            want = {k.removeprefix(f"{mode}_"): v for k, v in goals.items()
                    if k.startswith(f"{mode}_")}
            out[mode]["met"] = all(out[mode][k] >= v for k, v in want.items())
    return out


# ----------------------------------------------------------------------------- compile time


# The first-call suite's never-seen shapes. The launchers pick kernels by more than the dims: the
# last chunk (ragged, or every chunk full, where whole-chunk tiles that load once may run), the
# groups and the state size. So one shape of each: a ragged last chunk at every chunk size, four
# groups with a small state and a head dim of 96, and full chunks at 64, 128 and 256 (the models
# shapes' case, where whole-chunk tiles compile for longest, which the first two never reach),
# and two long sequences whose default walks its chunks in groups (GROUPED_WALK:
# three kernels of its own), one with a ragged last chunk and one with full chunks only (the
# grouped walk's whole-chunk tiles are the slowest to compile).
FIRST_CALL_SHAPES = (Shape("unseen-3x3000", 3, 3000, 40, 64, 128, 1),
                     Shape("unseen-1x777-g4", 1, 777, 32, 96, 64, 4),
                     Shape("unseen-2x1536-full", 2, 1536, 48, 64, 128, 1),
                     Shape("unseen-1x17000-grouped", 1, 17000, 72, 64, 128, 1),
                     Shape("unseen-1x12288-grouped-full", 1, 12288, 64, 64, 128, 1))


def first_call_seconds(shape: Shape, chunk_size=OUR_CHUNK) -> dict:
    """Wall time of the very first call on a never-seen shape, in a fresh process with an empty
    cuTile kernel cache of its own: compilation included, nothing reused. ``compile_s``: the
    seconds tileiras took for each of our kernels in that call, as the cache recorded them
    (:func:`kernel_compile_seconds`). With a cache, cuTile also has tileiras write its remarks,
    which makes each compile a few per cent slower than with the cache off, so first_s errs on
    the slow side. ``tuned_s``: from the first call's start until chunk_scan's tuned build,
    compiled in the background meanwhile (:mod:`ssd.launch`), was ready; ``second_s``: the call
    after that (the tuned kernel's launch reads it from the cache)."""
    call = ("ssd.mamba_chunk_scan_combined(i['x'],i['dt'],i['A'],i['B'],i['C'],"
            f"{chunk_size},D=i['D'],dt_bias=i['dt_bias'],dt_softplus=True);torch.cuda.synchronize()")
    code = ("import json,time,torch,ssd;from ssd.tools.bench import Shape,make_inputs;"
            f"s=Shape(*{tuple([shape.name, *shape.dims])!r});i=make_inputs(s);torch.cuda.synchronize();"
            f"t=time.perf_counter();{call};a=time.perf_counter()-t;"
            "w=ssd.wait_tuned() and time.perf_counter()-t;"
            f"t=time.perf_counter();{call};"
            "print(json.dumps(dict(first_s=a,tuned_s=w or None,second_s=time.perf_counter()-t)))")
    with tempfile.TemporaryDirectory(prefix="ssd-first-call-") as cache:
        env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=300)
        if out.returncode:
            return dict(shape=shape.name, error=out.stderr[-500:])
        times = json.loads(out.stdout.splitlines()[-1])
        return dict(shape=shape.name, dims=list(shape.dims), **times,
                    compile_s=kernel_compile_seconds(cache))


def kernel_compile_seconds(cache_dir) -> dict:
    """{kernel: [seconds, ...]} tileiras took to compile each kernel found in the cuTile kernel
    cache at ``cache_dir``, one entry per build in the order they finished (chunk_scan: its quick
    build, then its tuned one), named by its function without ``_kernel`` (``chunk_scan``). The
    seconds are those cuTile stores with each entry (its cache inspector, ``cutile_cache``, has
    no public API yet)."""
    from cutile_cache._cache import cache_entries

    seconds = {}
    entries = sorted(cache_entries(str(cache_dir)), key=lambda e: e.metadata.compilation_timestamp)
    for entry in entries:
        meta = entry.metadata
        if not meta.kernel_names or meta.compilation_time_seconds is None:
            raise ValueError(f"cuTile cache entry {entry.key} records no kernel or compile time")
        name = meta.kernel_names[0].split("_kernel_")[0]
        seconds.setdefault(name, []).append(meta.compilation_time_seconds)
    return seconds


# ----------------------------------------------------------------------------- configs


def shape_default(dims, sms: int, capability=(9, 0), chunk_size=OUR_CHUNK) -> SSDConfig:
    """The default the API picks for a shape of ``dims`` (b, l, h, p, n, g) at ``chunk_size`` on
    a GPU with ``sms`` SMs (see :func:`ssd.config.default_config`), before clamping to the
    problem."""
    b, l, h, p, n, _ = dims
    return default_config(capability, problem=(b, h, p, n), sms=sms, chunk_size=chunk_size,
                          seqlen=l)


def three_stages(cfg: SSDConfig) -> SSDConfig:
    """``cfg`` with stages 2 and 3 as kernels of their own: what packed sequences (seq_idx) take
    where ``cfg`` runs them as one kernel (``SSDConfig.fused_scan``), and the default a study
    recorded before the one kernel timed."""
    return replace(cfg, fused_scan=replace(cfg.fused_scan, enabled=False))


def three_stage_space(space):
    """A :func:`config_space` as it was before the one kernel: its "one kernel" factors left out
    and every point in three stages (:func:`three_stages`)."""
    return [(f, q, three_stages(c)) for f, q, c in space if not f.startswith("one kernel")]


def config_space(dims=None, sms: int | None = None):
    """The searched space of the tiling study: (factor, chunk_size, SSDConfig) triples.

    One factor at a time around the sm_90 default at chunk size ``OUR_CHUNK``, or, given a
    shape's ``dims`` and the GPU's ``sms``, around the default the API picks for that shape
    there (:func:`shape_default`; it differs where stage 2 would have few blocks or need a
    second wave), so that the study times what ships and every factor changes one thing of it.
    The first triple is that default. The factors: the chunk size (given ``dims``,
    what the API picks at each); where the default runs stages 2 and 3 as one kernel, the three
    stages instead, and the one kernel's channel block and occupancy hint (the stage factors
    below then vary the three stages it configures); stage 2 (fused or split, entering-state dtype, the state
    slice ``block_n``, its layout, the narrow slices of few-block problems, other counts of chunk
    groups where the default walks groups, the occupancy hint); chunk_scan (heads per block,
    occupancy hint, persistent or one block per tile, whole-chunk tiles of one or two heads,
    loaded once or per row block, tile shape); for each
    stage the other compiler hints (a low DRAM-latency hint on its streamed loads, 8 worker warps
    instead of the compiler's 4).
    Choices interact, so this is not a grid: it shows what each knob is worth at the default.
    A point is built by applying its factor's values to the shape's default, so where the
    default differs it carries that difference (on 2.7b every chunk-64 stage-2 point has its
    whole-state block_k and occupancy), except the narrow slices, which are the API's own
    (absent where the shape ships them). No point repeats another, or the default.
    """

    def shipped(q):
        return default_config((9, 0), chunk_size=q) if dims is None else \
            shape_default(dims, sms, chunk_size=q)

    shipped_d = shipped(OUR_CHUNK)
    # Where the default runs stages 2 and 3 as one kernel, the three stages it configures
    # (which seq_idx takes) are a point, and the stage factors vary them; the one kernel's own
    # factors are its channel block and hint.
    fs = shipped_d.fused_scan
    d = three_stages(shipped_d)
    st = lambda **kw: replace(d, state=replace(d.state, **kw))  # noqa: E731
    sc = lambda **kw: replace(d, scan=replace(d.scan, **kw))  # noqa: E731
    space = [("default", OUR_CHUNK, shipped_d)]
    space += [("chunk size", q, shipped(q)) for q in SUITE_CHUNKS if q != OUR_CHUNK]
    if fs.enabled:
        space += [("one kernel", OUR_CHUNK, d)]
        space += [("one kernel block_p", OUR_CHUNK, replace(shipped_d, fused_scan=replace(
            fs, block_p=32)))]
        space += [("one kernel occupancy", OUR_CHUNK, replace(shipped_d, fused_scan=replace(
            fs, occupancy=v))) for v in (None, 3)]
    space += [("stage 2 split", OUR_CHUNK, st(fused=False, groups=1))]
    space += [("state dtype", OUR_CHUNK, st(state_dtype="float32"))]
    space += [("state block_n", OUR_CHUNK, st(block_n=v)) for v in (16, 32, 64, 128)
              if v != d.state.block_n]
    space += [("state layout", OUR_CHUNK, st(transposed=not d.state.transposed))]
    # the narrow slices as the API takes them for few stage-2 blocks: on the sm_90 default's
    # state, not on a shape's own (2.7b's whole states), and only where the shape does not ship them
    narrow = replace(default_config((9, 0), chunk_size=OUR_CHUNK).state, **NARROW_STATE)
    space += [("state narrow", OUR_CHUNK, replace(d, state=narrow))] if narrow != d.state else []
    # where the default walks groups of chunks (few sequences), other group counts
    space += [("state groups", OUR_CHUNK, st(groups=v)) for v in (1, 2, 8)
              if d.state.groups > 1 and v != d.state.groups]
    space += [("state occupancy", OUR_CHUNK, st(occupancy=v)) for v in (None, 1, 2, 8)
              if v != d.state.occupancy]
    space += [("state hints", OUR_CHUNK, st(latency=2)), ("state hints", OUR_CHUNK, st(warps=8))]
    space += [("scan block_h", OUR_CHUNK, sc(block_h=v)) for v in (1, 4) if v != d.scan.block_h]
    space += [("scan occupancy", OUR_CHUNK, sc(occupancy=v)) for v in (None, 1, 2, 3, 4)
              if v != d.scan.occupancy]
    space += [("scan hints", OUR_CHUNK, sc(latency=2)), ("scan hints", OUR_CHUNK, sc(warps=8))]
    if not d.scan.whole_chunk:  # whole-chunk tiles need the persistent grid
        space += [("scan grid", OUR_CHUNK, sc(persistent=not d.scan.persistent))]
    # whole-chunk tiles (loaded once) of one or two heads; for a default that has them, rows of
    # two heads instead, and its whole-chunk tiles reloading what their row blocks share
    space += [("scan whole chunk", OUR_CHUNK, sc(whole_chunk=wc, shared=wc, block_h=v))
              for wc, v in ((True, 1), (True, 2), (False, 2))
              if (wc, v) != (d.scan.whole_chunk, d.scan.block_h) and (wc or d.scan.whole_chunk)]
    if d.scan.whole_chunk:
        space += [("scan loads", OUR_CHUNK, sc(shared=not d.scan.shared))]
    # tiles of at most one chunk (a block_m past it would be clamped back to the default's)
    space += [("scan tile", OUR_CHUNK, sc(block_m=bm, block_s=bs, block_p=bp))
              for bm, bs, bp in ((32, 32, 64), (64, 32, 64), (64, 64, 32))
              if (bm, bs, bp) != (d.scan.block_m, d.scan.block_s, d.scan.block_p)]
    # each point once (around whole-chunk tiles, "scan block_h" and "scan whole chunk" meet)
    seen = set()
    return [p for p in space if (p[1], p[2]) not in seen and not seen.add((p[1], p[2]))]


_CONSTANTS = {"None": None, "True": True, "False": False}


def _parse_value(text: str):
    """A --vary value: None, True/False, an int, or a string (a dtype name)."""
    if text in _CONSTANTS:
        return _CONSTANTS[text]
    try:
        return int(text)
    except ValueError:
        return text


def vary_space(specs, base: SSDConfig | None = None):
    """A one-factor-at-a-time space around ``base`` (default: the sm_90 default) from specs
    such as ``"state.block_k=16,32"`` (one point per value), ``"q=128"`` (the chunk size) or
    ``"scan.block_m=32+scan.block_s=32"`` (one point changing several fields together): the
    default first, then the points, as ``config_space()`` returns them."""
    base = base or default_config((9, 0), chunk_size=OUR_CHUNK)
    space = [("default", OUR_CHUNK, base)]
    for spec in specs:
        parts = spec.split("+")
        if len(parts) > 1 and any("," in part for part in parts):
            raise ValueError(f"--vary {spec!r}: one value per field when fields are joined by +")
        name, _, values = parts[0].partition("=")
        points = [[(name, v)] for v in values.split(",")] if len(parts) == 1 else \
            [[tuple(part.partition("=")[::2]) for part in parts]]
        for point in points:
            if not all(value for _, value in point):
                raise ValueError(f"--vary {spec!r}: expected STAGE.FIELD=V1,V2 or q=V1,V2")
            space.append((spec, *_changed(spec, base, point)))
    return space


def _changed(spec, base, point):
    """(q, cfg): ``base`` at OUR_CHUNK with the (``q`` or STAGE.FIELD, value) pairs of
    ``point`` applied, each stage rebuilt once (its checks see all of its changes together)."""
    q, changes = OUR_CHUNK, {}
    for field_path, value in point:
        value = _parse_value(value)
        if field_path == "q":
            q = value
            continue
        stage, _, field_name = field_path.partition(".")
        if stage not in ("cumsum", "state", "scan") or \
                field_name not in getattr(base, stage).__dataclass_fields__:
            known = {st: list(getattr(base, st).__dataclass_fields__)
                     for st in ("cumsum", "state", "scan")}
            raise ValueError(f"--vary {spec!r}: unknown field {field_path!r}; known: {known}")
        changes.setdefault(stage, {})[field_name] = value
    return q, replace(base, **{st: replace(getattr(base, st), **kw) for st, kw in changes.items()})


def _hints_label(stage) -> str:
    """'o4', plus 'L2' / 'w8' where a latency or worker-warp hint is set."""
    extra = "".join(f" {tag}{v}" for tag, v in (("L", stage.latency), ("w", stage.warps)) if v)
    return f"o{stage.occupancy or '-'}{extra}"


def config_label(q, cfg: SSDConfig) -> str:
    st, sc = cfg.state, cfg.scan
    if cfg.fused_scan.enabled:  # stage 2 and chunk_scan's configs unused
        fs = cfg.fused_scan
        return f"q{q} stages 2+3 one kernel p{fs.block_p} o{fs.occupancy or '-'}"
    dtype = {"input": "in", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[st.state_dtype]
    # Fields the study keeps at their defaults appear only when changed (k16, sp32, ch4, g4).
    d = SSDConfig()
    extra = "".join(f" {tag}{v}" for tag, v, dv in (
        ("k", st.block_k, d.state.block_k), ("sp", st.block_p, d.state.block_p),
        ("ch", cfg.cumsum.block_h, d.cumsum.block_h), ("g", st.groups, d.state.groups)) if v != dv)
    flags = lambda pairs: "".join(f" {tag}" for tag, on in pairs if on)  # noqa: E731
    st_flags = flags((("T", st.transposed and st.fused),))  # the split kernels ignore it
    sc_extra = flags((("pers", sc.persistent), ("wc", sc.whole_chunk), ("sh", sc.shared)))
    return (f"q{q} {'fused' if st.fused else 'split'} {dtype} n{st.block_n}{extra}{st_flags} "
            f"{_hints_label(st)} | h{sc.block_h} m{sc.block_m} s{sc.block_s} p{sc.block_p}"
            f"{sc_extra} {_hints_label(sc)}")


def study_points(shapes, space, sms) -> dict:
    """shape name -> its study points (see :func:`run_study`), built for every shape before any
    is timed: a point that is no valid configuration on a later shape (a ``--vary`` around a
    shape's shipped default, say) fails here, in a second, not after the earlier shapes' timing."""
    return {shape.name: space(shape, sms) if callable(space) else space or config_space(shape.dims, sms)
            for shape in shapes}


def compile_ahead(calls, workers: int) -> float:
    """Build our kernels for ``calls`` ((Shape, chunk size, SSDConfig or None: the API's
    default on this GPU) triples) into cuTile's kernel cache (``CUDA_TILE_CACHE_DIR``, which
    must name a folder) in ``workers`` processes at once; returns the wall seconds. tileiras
    compiles on one core: a study's hundred builds, or a suite's shapes, take minutes one after
    another and a fraction of that spread over the machine's cores. The timings that follow are
    unchanged: a cache hit launches the same cubin. Each process runs each call of its share
    once, on the shape's inputs (a packed shape's seq_idx included), tuned builds only
    (``SSD_QUICK_FIRST_CALL=0``)."""
    cache = os.environ.get("CUDA_TILE_CACHE_DIR")
    if not cache or cache == "off":
        raise RuntimeError("compile_ahead: CUDA_TILE_CACHE_DIR names no cache folder to fill")
    env = {**os.environ, "SSD_QUICK_FIRST_CALL": "0",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    start, running = time.perf_counter(), []
    with contextlib.ExitStack() as stack:
        for share in (calls[i::workers] for i in range(workers)):
            if not share:
                continue
            job = json.dumps([[asdict(shape), q, cfg and asdict(cfg)] for shape, q, cfg in share])
            err = stack.enter_context(tempfile.TemporaryFile())
            proc = subprocess.Popen([sys.executable, "-m", "ssd.tools.bench", "--compile-job"],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=err, env=env, cwd=ROOT, text=True)
            proc.stdin.write(job)
            proc.stdin.close()
            running.append((proc, err))
        failed = []
        for proc, err in running:
            if proc.wait():
                err.seek(0)
                failed.append(err.read().decode(errors="replace")[-800:])
    if failed:
        raise RuntimeError(f"compile_ahead: {len(failed)} of {len(running)} workers failed; "
                           f"the first:\n{failed[0]}")
    return time.perf_counter() - start


def _compile_job(job: list) -> None:
    """One :func:`compile_ahead` worker: each call of ``job`` (its JSON: [shape fields, chunk
    size, config fields or None]) run once, each shape's inputs made once."""
    import torch

    from .. import api

    made = None
    for fields, q, cfg in job:
        shape = Shape(**dict(fields, seq_boundaries=tuple(fields["seq_boundaries"])))
        if made is None or made[0] != shape:
            made = None  # the last shape's inputs freed before the next one's are made
            made = shape, make_inputs(shape)
        inputs = made[1]
        packed = {"seq_idx": inputs["seq_idx"]} if shape.packed else {}
        x, dt, A, B, C, D, bias = _forward_args(inputs)
        api.mamba_chunk_scan_combined(x, dt, A, B, C, q, D=D, dt_bias=bias, dt_softplus=True,
                                      config=cfg and SSDConfig.from_dict(cfg), **packed)
    torch.cuda.synchronize()


#: Processes :func:`compile_ahead` compiles in: most of a 16-core GPU machine's cores, each
#: with a CUDA context and one shape's inputs (under 2 GB of GPU memory).
COMPILE_WORKERS = min(12, max(1, (os.cpu_count() or 2) - 2))


def run_study(shapes, space=None, reps=30, stages=False,
              compile_workers=COMPILE_WORKERS) -> dict:
    """Time ours over the config space on each shape (graph replay, L2 flushed): ``space`` (a
    list of (factor, chunk size, SSDConfig), or a function of the shape and the GPU's SM count
    returning one), or per shape ``config_space(shape.dims, sms)``, whose first point is what
    the API ships there. ``stages``: each point also times each of its kernels alone
    (:func:`stage_times`: eager, L2 flushed), so a screen sees which stage a change moved.
    ``compile_workers`` > 1: each shape's kernels are built first in that many processes
    (:func:`compile_ahead`), and every point runs its tuned build from its first call, so a
    row's ``first_call_s`` is a cache hit and its ``tuned_s`` None (compile seconds are the
    first-call suite's subject)."""
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    points_of = study_points(shapes, space, sms)
    with contextlib.ExitStack() as stack:
        if compile_workers > 1:
            stack.enter_context(_environ(SSD_QUICK_FIRST_CALL="0"))
        return dict(rows=_study_rows(shapes, points_of, reps, stages, compile_workers))


@contextlib.contextmanager
def _environ(**values):
    """These environment variables set for the block, restored after it."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _study_rows(shapes, points_of, reps, stages, compile_workers) -> list:
    import torch

    from .. import api

    rows = []
    for shape in _progress(shapes, "study"):
        if compile_workers > 1:
            seconds = compile_ahead([(shape, q, cfg) for _, q, cfg in points_of[shape.name]],
                                    compile_workers)
            print(f"[bench] {shape.name}: {len(points_of[shape.name])} points compiled in "
                  f"{seconds:.0f} s by {compile_workers} processes", flush=True)
        inputs = make_inputs(shape)
        gate = Gate(shape, inputs)
        x, dt, A, B, C, D, bias = _forward_args(inputs)
        for factor, q, cfg in points_of[shape.name]:
            fn = lambda q=q, cfg=cfg: api.mamba_chunk_scan_combined(  # noqa: E731
                x, dt, A, B, C, q, D=D, dt_bias=bias, dt_softplus=True, config=cfg)
            first, tuned_s, y_first, y = first_call(fn)
            err = worst(gate(y_first), gate(y))
            stats = time_fn(fn, mode="graph", l2="flushed", reps=reps)
            extra = dict(stages=stage_times(inputs, chunk_size=q, config=cfg)) if stages else {}
            rows.append(dict(shape=shape.name, dims=list(shape.dims), chunk_size=q,
                             factor=factor, label=config_label(q, cfg), config=asdict(cfg),
                             gate_rel_err=err, first_call_s=first, tuned_s=tuned_s, **stats,
                             **extra))
        del inputs
        torch.cuda.empty_cache()
    return rows


def study_base(rows, shape: str) -> dict:
    """The row of ``rows`` (one :func:`run_study`) whose stages the stage factors of ``shape``
    vary: its default, or where the default runs stages 2 and 3 as one kernel, the three stages
    that kernel replaces (:func:`config_space`'s point "one kernel")."""
    mine = [r for r in rows if r["shape"] == shape]
    return next((r for r in mine if r["factor"] == "one kernel"),
                next(r for r in mine if r["factor"] == "default"))


def study_reference(rows, r) -> dict:
    """The row of ``rows`` (one :func:`run_study`) that point ``r`` is read against: for a stage
    factor :func:`study_base`; for the default, the chunk sizes and the one kernel's own factors
    the default that ships."""
    if r["factor"] in ("default", "chunk size") or r["factor"].startswith("one kernel"):
        return next(x for x in rows if x["shape"] == r["shape"] and x["factor"] == "default")
    return study_base(rows, r["shape"])


def study_ratios(rows) -> dict:
    """shape -> [(factor, label, forward time / its reference's, {stage: time / the
    reference's})] for the rows of one :func:`run_study` (stage ratios where it timed them): what
    a screen reads, each point against the point of its own run it varies
    (:func:`study_reference`: the default, or where that is the one kernel, for the stage factors
    the three stages)."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        out[shape] = []
        for r in (r for r in rows if r["shape"] == shape):
            base = study_reference(rows, r)
            out[shape].append((r["factor"], r["label"], r["median_ms"] / base["median_ms"],
                               {k: v / base["stages"][k] for k, v in r.get("stages", {}).items()
                                if k in base.get("stages", {})}))
    return out


# ----------------------------------------------------------------------------- plots


def plot_suite(payload, ax=None, mode="graph", l2="flushed"):
    """Bar chart: median time per shape and implementation (best chunk size), with the floor."""
    import matplotlib.pyplot as plt

    records = payload["records"]
    shapes = list(dict.fromkeys(r["shape"] for r in records))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    ax = ax or plt.subplots(figsize=(7, 3.5), dpi=90)[1]
    width = 0.8 / (len(impls) + 1)
    for i, impl in enumerate(impls):
        best = best_records(records, impl, mode, l2)
        vals = [best[s]["median_ms"] if s in best else np.nan for s in shapes]
        ax.bar(np.arange(len(shapes)) + i * width, vals, width, label=impl)
    floors = [next(r["floor_ms"] for r in records if r["shape"] == s) for s in shapes]
    ax.bar(np.arange(len(shapes)) + len(impls) * width, floors, width, label="floor", color="0.7")
    ax.set_xticks(np.arange(len(shapes)) + 0.4 - width / 2, shapes)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"SSD forward, bf16, {mode}, L2 {l2}")
    ax.legend(fontsize=8)
    return ax


# ----------------------------------------------------------------------------- CLI


#: The compile caches a first call could find warm: cuTile's (ours, TileGym's) and Triton's
#: (mamba_ssm's). A machine that ran the GPU tests before a benchmark holds our kernels in the
#: first, where a first call then times no compilation (under a second, against several seconds
#: in a fresh process).
KERNEL_CACHE_VARS = ("CUDA_TILE_CACHE_DIR", "TRITON_CACHE_DIR")


def fresh_kernel_caches(stack: contextlib.ExitStack) -> dict:
    """Point each of :data:`KERNEL_CACHE_VARS` that the caller left unset at an empty folder of
    this process's own (removed when ``stack`` closes), so that every first call of the run
    compiles (and mamba_ssm's autotunes) from nothing, as a never-seen shape would. Must run before
    cuda.tile or triton is imported: they read the variables then. Returns {variable: "fresh" or
    "caller's"} for the environment record."""
    loaded = [m for m in ("cuda.tile", "triton") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"fresh_kernel_caches: {', '.join(loaded)} already imported; "
                           "it would keep the cache it found")
    root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ssd-bench-caches-")))
    state = {}
    for var in KERNEL_CACHE_VARS:
        if os.environ.get(var):
            state[var] = "caller's"
            continue
        os.environ[var] = str(root / var.lower())
        os.makedirs(os.environ[var])
        stack.callback(os.environ.pop, var, None)
        state[var] = "fresh"
    return state


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=[*SUITES, "study", "first-call"], default="models")
    parser.add_argument("--impl", action="append", help="ssd, mamba_ssm, tilegym, tilegym_tuned")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="graph + flushed only, no stages")
    parser.add_argument("--out", help="output JSON (default results/<gpu>/<suite>.json)")
    parser.add_argument("--merge", action="store_true",
                        help="with --shapes or --shard: merge these shapes into the suite's "
                             "recording (made at the same revision with the same settings) "
                             "instead of writing a file of their own, so a suite can be split "
                             "over several commands")
    parser.add_argument("--shard", metavar="I/K",
                        help="only every K-th shape of the suite, starting with the I-th (1 <= I "
                             "<= K): K commands with --merge record the whole suite")
    parser.add_argument("--vary", action="append", metavar="STAGE.FIELD=V1,V2",
                        help="study only: time these values of one field each around the default "
                             "instead of the study's space (e.g. state.block_k=16,32, q=128, or "
                             "scan.block_m=32+scan.block_s=32 for one point changing both); "
                             "written to results/<gpu>/study-vary.json unless --out")
    parser.add_argument("--around", choices=("global", "shipped"), default="shipped",
                        help="with --vary: the points change what the API ships for each shape "
                             "(shipped, the default: narrow or whole state slices, small-state "
                             "tiles, as the study does) or the sm_90 default (global)")
    parser.add_argument("--stages", action="store_true",
                        help="study only: time each point's kernels alone too (eager, L2 flushed)")
    parser.add_argument("--tilegym-replay", action="store_true",
                        help="TileGym tuned takes the configurations its search chose on this GPU "
                             "(results/tilegym_tuned.json, make gpu-tilegym) instead of searching "
                             "again; needs --impl tilegym_tuned")
    parser.add_argument("--tilegym-table", metavar="FOLDER",
                        help="write the searched TileGym runs FOLDER/<shape>.json into "
                             "results/tilegym_tuned.json and exit")
    parser.add_argument("--shapes", metavar="NAME,NAME",
                        help="only these shapes of the suite (the study: of the models suite; "
                             f"default {','.join(STUDY_SHAPES)})")
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction,
                        help="compile our kernels for every shape of the run first, in parallel "
                             "processes (ours' first calls then hit the cache; its records say "
                             "precompiled); default: the suite's policy (SUITE_POLICIES: on for "
                             "robust and serving)")
    parser.add_argument("--our-chunks", metavar="Q,Q",
                        help="the chunk sizes ours runs at, of "
                             f"{','.join(map(str, SUITE_CHUNKS))} (default: the suite's policy: "
                             f"robust {OUR_CHUNK} only, the others all); peers keep all")
    parser.add_argument("--compile-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_job:  # a compile_ahead worker: its job on stdin, the parent's kernel cache
        _compile_job(json.load(sys.stdin))
        return 0
    if args.tilegym_table:
        print(f"wrote {write_tilegym_table(args.tilegym_table)}")
        return 0
    if args.merge and not (args.shapes or args.shard):
        parser.error("--merge goes with --shapes or --shard")
    if args.shard and (args.shapes or args.suite in ("study", "first-call")):
        parser.error("--shard goes with a suite's whole list, not with --shapes, study or first-call")
    shard = _parse_shard(parser, args.shard) if args.shard else None
    if args.vary and args.suite != "study":
        parser.error("--vary goes with --suite study")
    if args.stages and args.suite != "study":
        parser.error("--stages goes with --suite study")
    if args.around != "shipped" and not args.vary:
        parser.error("--around goes with --vary")
    if args.tilegym_replay and "tilegym_tuned" not in (args.impl or ()):
        parser.error("--tilegym-replay goes with --impl tilegym_tuned")
    if (args.precompile is not None or args.our_chunks) and args.suite in ("study", "first-call"):
        parser.error("--precompile and --our-chunks go with a suite of shapes, not with study or "
                     "first-call")
    args.policy = _suite_policy(parser, args)
    pool = {s.name: s for s in SUITES.get("models" if args.suite == "study" else args.suite, ())}
    names = args.shapes.split(",") if args.shapes else (
        list(STUDY_SHAPES) if args.suite == "study" else list(pool))
    if unknown := [n for n in names if n not in pool]:
        parser.error(f"--shapes: {', '.join(unknown)} not in the {args.suite} suite "
                     f"(it has: {', '.join(pool) or 'no named shapes'})")
    if shard:
        names = names[shard[0] - 1::shard[1]]
    shapes = [pool[n] for n in names]
    with contextlib.ExitStack() as stack:
        caches = fresh_kernel_caches(stack)
        return _run(parser, args, shapes, names, caches)


def _suite_policy(parser, args) -> SuitePolicy:
    """The suite's :class:`SuitePolicy` with the command line's --precompile and --our-chunks."""
    policy = SUITE_POLICIES.get(args.suite, SuitePolicy())
    if args.precompile is not None:
        policy = replace(policy, precompile=args.precompile)
    if args.our_chunks:
        chunks = tuple(int(q) if q.isdigit() else q for q in args.our_chunks.split(","))
        if not set(chunks) <= set(SUITE_CHUNKS):
            parser.error(f"--our-chunks {args.our_chunks}: expected some of "
                         f"{','.join(map(str, SUITE_CHUNKS))}")
        policy = replace(policy, our_chunks=tuple(sorted(set(chunks))))
    return policy


def _parse_shard(parser, text: str) -> tuple:
    """--shard "I/K" -> (I, K), 1 <= I <= K."""
    i, _, k = text.partition("/")
    if not (i.isdigit() and k.isdigit() and 1 <= int(i) <= int(k)):
        parser.error(f"--shard {text!r}: expected I/K with 1 <= I <= K, e.g. 2/4")
    return int(i), int(k)


def _suite_path(args, names, env) -> Path:
    name = "study-vary" if args.vary else args.suite
    if (args.shapes or args.shard) and not args.merge:  # a subset never overwrites the suite's
        i, _, k = (args.shard or "").partition("/")
        name += f"-shard{i}of{k}" if args.shard else "-" + "+".join(names)
    return RESULTS / gpu_slug(env) / f"{name}.json"


def _merge_target(args, env) -> dict | None:
    """With --merge, the recording this run of some shapes merges into: the suite's file when
    it was made at this revision on this GPU; None (it is replaced) when there is none or it is
    of another revision: one recording, one revision."""
    path = Path(args.out) if args.out else _suite_path(args, (), env)
    if not (args.merge and path.is_file()):
        return None
    old = json.loads(path.read_text())
    mine = all(old.get("environment", {}).get(k) == env.get(k) for k in ("git_revision", "gpu"))
    return old if mine else None


def merge_runs(old: dict, new: dict) -> dict:
    """A recording of some shapes merged into one of other shapes, made at the same revision
    with the same settings (a suite split over several commands): lists of per-shape rows (or
    per-run rows naming their ``shapes``, as ``run_phase_s``) and dicts keyed by shape take the
    new run's entries for its shapes and keep the old run's for the others; ``skipped`` is keyed
    "shape/impl"; the rest (settings, environment) is the new run's. Raises ValueError for
    another revision or other settings."""
    same = ("git_revision", "gpu")
    if any(old.get("environment", {}).get(k) != new["environment"].get(k) for k in same) or \
            old.get("settings") != new.get("settings"):
        raise ValueError("--merge: the recording there has another revision, GPU or settings "
                         "(--reps, --quick, --precompile, --our-chunks): run these shapes as "
                         "it was run")
    shapes = {r["shape"] for key in ("records", "rows", "stages", "failures")
              for r in new.get(key, []) if isinstance(r, dict) and "shape" in r}
    shapes |= {k for key in ("mamba_ssm_configs", "tilegym_configs", "tilegym_stages",
                             "tilegym_replayed_from", "phase_s") for k in new.get(key, {})}
    out = dict(new)
    for key, value in new.items():
        if isinstance(value, list) and key in old:  # rows of a shape, or of a run's "shapes"
            out[key] = [r for r in old[key] if r.get("shape") not in shapes
                        and not shapes & set(r.get("shapes", ()))] + value
        elif key in ("skipped", "phase_s") or key.endswith(("_configs", "_stages", "_from")):
            out[key] = {**{k: v for k, v in old.get(key, {}).items()
                           if k.split("/")[0] not in shapes}, **value}
    return out


def print_suite(payload, file=None):
    """The suite's table (graph replay, L2 flushed; the eager speedup beside) and its summary."""
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    records = payload["records"]
    sp, eager = payload["speedup_vs_mamba_ssm"], speedups(records, mode="eager")
    ours, mamba = best_records(records, "ssd"), best_records(records, "mamba_ssm")
    width = max([16, *map(len, ours)])
    p(f"\n{'shape':{width}s}  ours ms   mamba_ssm best ms   speedup   eager x   floor ms   "
      "ours/floor")
    for s, r in ours.items():
        m = mamba.get(s)
        p(f"{s:{width}s} {r['median_ms']:8.3f}   {m['median_ms'] if m else float('nan'):8.3f} "
          f"(q{m['chunk_size'] if m else '-'})   {sp.get(s, float('nan')):6.2f}x  "
          f"{eager.get(s, float('nan')):6.2f}x  {r['floor_ms']:8.3f}   "
          f"{r['floor_ms'] / r['median_ms']:6.1%}")
    for mode, row in payload.get("summary", {}).items():
        met = "" if "met" not in row else ("  goals met" if row["met"] else "  goals missed")
        p(f"{mode}: geomean speedup over mamba_ssm {row['geomean']:.2f}x, slowest "
          f"{row['min']:.2f}x ({row['min_shape']}), {row['shapes']} shapes{met}")


def _run(parser, args, shapes, names, caches) -> int:
    env = dict(environment(), kernel_caches=caches)
    replay = None
    if args.tilegym_replay:
        replay = {s.name: tilegym_replay_source(gpu_slug(env), s.name) for s in shapes}
        if stale := {s: r["tilegym"] for s, r in replay.items() if r["tilegym"] != env["tilegym"]}:
            parser.error(f"--tilegym-replay: recorded with TileGym {stale}, installed "
                         f"{env['tilegym']}: tune again (make gpu-tilegym)")
    if args.suite == "first-call":
        payload = dict(rows=[first_call_seconds(s) for s in FIRST_CALL_SHAPES])
    elif args.suite == "study":
        space = vary_space(args.vary) if args.vary else None
        if args.vary and args.around == "shipped":
            space = lambda shape, sms: vary_space(args.vary, shape_default(shape.dims, sms))  # noqa: E731
        payload = run_study(shapes, space=space, reps=args.reps, stages=args.stages)
        payload["settings"] = dict(around=args.around if args.vary else "study", stages=args.stages,
                                   compile_workers=COMPILE_WORKERS)
        for shape, points in study_ratios(payload["rows"]).items():
            print(f"\n{shape}: time / default, or for the stage factors around a one-kernel default /"
                  " its three stages (forward, graph, L2 flushed"
                  + ("; each stage alone, eager)" if args.stages else ")"))
            for factor, label, fwd, st in points:
                print(f"  {fwd:6.3f}  " + "".join(f"{k} {v:.3f}  " for k, v in st.items())
                      + f"{factor}: {label}")
    else:
        quick = dict(modes=("graph",), l2s=("flushed",), stages=False) if args.quick else {}
        if args.suite == "robust":  # its question is graph and eager, inputs from HBM: no warm-L2
            quick = dict(dict(l2s=("flushed",), stages=False), **quick)  # runs, no stage times
        # a merged recording keeps one set of ceilings: the floors of all its records use them
        ceilings = merged.get("ceilings") if (merged := _merge_target(args, env)) else None
        payload = run_suite(shapes, impls=tuple(args.impl or ("ssd", "mamba_ssm", "tilegym")),
                            reps=args.reps, tilegym_replay=replay, ceilings=ceilings,
                            policy=args.policy, **quick)
        if merged:
            payload["environment"] = env
            payload = merge_runs(merged, payload)
        sp = speedups(payload["records"])
        payload["speedup_vs_mamba_ssm"] = sp
        goals = ROBUST_GOALS if args.suite == "robust" else None
        payload["summary"] = speedup_summary(payload["records"], goals=goals)
        if goals:
            payload["goals"] = goals
        print_suite(payload)
        for f in payload["failures"]:
            print("FAILED", f)
    payload["environment"] = env
    if args.suite == "study" and (merged := _merge_target(args, env)):
        payload = merge_runs(merged, payload)
    path = args.out or _suite_path(args, names, env)
    write_json(path, payload)
    print(f"[bench] wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
