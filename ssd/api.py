"""The public entry point: ``mamba_chunk_scan_combined``, a drop-in for mamba_ssm's.

It validates the arguments (shapes, dtypes, devices: errors name the argument), then runs the
three cuTile stages on the inputs' device and current stream::

    chunk_cumsum  ->  chunk_state + state_passing (fused by default)  ->  chunk_scan

or, where the default finds it fills the GPU (:func:`ssd.config.fused_scan_fills`), the last
three in one kernel (:mod:`ssd.kernels.fused_scan`)::

    chunk_cumsum  ->  chunk_state + state_passing + chunk_scan

Packed prompts (mamba_ssm's varlen interface): ``seq_idx`` resets the state where each
sequence starts; with ``cu_seqlens`` and ``return_varlen_states`` a fourth kernel
(:mod:`ssd.kernels.chunk_state_varlen`) also gives each sequence's final state, from the chunk
where it ends and the state stage 2 stored for that chunk.

Where a gradient is required, the same forward runs inside a ``torch.autograd.Function``
(:mod:`ssd.autograd`, which says what it saves for the backward and what the backward
recomputes); the backward is :mod:`ssd.backward`, the stages' gradients, in cuTile kernels
where one exists (``ssd.kernels.<stage>_backward``) and PyTorch for the others.

A call's host path -- its checks, its configuration, what its launchers compute and allocate --
depends on its tensors' dtypes, shapes, strides and devices and on its other arguments, never on
its tensors' values. So the first call of each such signature (:func:`plan_key`) runs in full and
keeps its :class:`Plan` (checks passed, configuration); the second is traced once
(:func:`make_plan`, dearer than a call: a signature seen once, such as a new prompt length,
does not pay it); later calls replay the plan: fresh outputs, the recorded launches with this
call's tensors in place, none of the checks or launcher code again.

The invariant: a replay launches exactly what :func:`forward_stages` launches for this call --
the same kernels, grids and constants, each of this call's (prepared) tensors where the
launchers pass it, fresh outputs -- or the call does not replay. It replays only where its key
equals the traced call's, no input requires a gradient (:mod:`ssd.autograd` then runs the full
forward and saves what the backward reads), and the trace saw the stages only allocate and
launch, each argument an input, a fresh allocation, a stand-in or a constant. Otherwise it runs
in full: checked where its key is new (or cannot be made), configured, launched.

Value checks that would need the GPU to report back (A <= 0, finite inputs, seq_idx
non-decreasing, cu_seqlens' offsets) would force a device synchronisation and break CUDA-graph capture, so they run
only with ``check_values=True``. Inputs may be non-contiguous (kernels take strides); a tensor
whose last dimension is strided is copied once to make it contiguous.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import autograd as _autograd
from . import launch as _launch
from .kernels import chunk_cumsum as _cumsum
from .kernels import chunk_scan as _scan
from .kernels import chunk_state as _state
from .kernels import chunk_state_varlen as _varlen
from .kernels import fused_scan as _fused_scan
from .kernels import state_passing as _passing
from .config import CHUNK_SIZES, MAX_DSTATE, SSDConfig, default_config
from .launch import chunk_seq_last, gpu_facts
from .reference import check_cu_seqlens, check_shapes, check_varlen_shapes

STAGES = ("chunk_cumsum", "chunk_state", "state_passing", "chunk_scan")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_tensor(name, t, device, dtypes=FLOAT_DTYPES, optional=False, first="x"):
    """``t`` (argument ``name``) is a tensor of one of ``dtypes`` on ``device``, the device of the
    argument ``first``; None passes where ``optional``. Raises TypeError or ValueError naming
    the argument."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name}: expected a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, but {first} is on {device}; all inputs must "
                         "share one CUDA device")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; expected one of "
                        f"{', '.join(str(d) for d in dtypes)}")


def _last_dim_contiguous(t):
    return t if t is None or t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def validate(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
             seq_idx=None, dt_limit=(0.0, math.inf), check_values=False, cu_seqlens=None,
             return_varlen_states=False) -> dict:
    """Check every argument of the forward; return the sizes (b, l, h, p, n, g, c, q).

    cu_seqlens is checked only with return_varlen_states, the one call that reads it (as in
    mamba_ssm, which ignores it otherwise). CPU tensors pass only inside
    :func:`ssd.launch.capture`, which runs no kernel (how the CPU compiles the kernels and times
    the host path).

    Raises TypeError / ValueError whose message starts with the argument's name.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    for name, t, opt in (("dt", dt, False), ("A", A, False), ("B", B, False), ("C", C, False),
                         ("D", D, True), ("z", z, True), ("dt_bias", dt_bias, True),
                         ("initial_states", initial_states, True)):
        check_tensor(name, t, x.device, optional=opt)
    check_tensor("x", x, x.device)
    check_tensor("seq_idx", seq_idx, x.device, dtypes=(torch.int32, torch.int64), optional=True)
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError("return_varlen_states: needs cu_seqlens, the (num_sequences + 1,) "
                             "offsets of the packed sequences")
        check_tensor("cu_seqlens", cu_seqlens, x.device, dtypes=(torch.int32, torch.int64))
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size: the cuTile kernels take a power of two in {CHUNK_SIZES} "
                         f"(one chunk is one tile), got {chunk_size!r}")
    dims = check_shapes(chunk_size=chunk_size, **{
        name: None if t is None else tuple(t.shape)
        for name, t in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                        ("dt_bias", dt_bias), ("initial_states", initial_states),
                        ("seq_idx", seq_idx))})
    if return_varlen_states:
        check_varlen_shapes(tuple(cu_seqlens.shape), dims, seq_idx is not None)
    if dims["n"] > MAX_DSTATE:
        raise ValueError(f"B: dstate n={dims['n']} is larger than the {MAX_DSTATE} the kernels "
                         "keep on chip")
    try:
        lo, hi = (float(v) for v in dt_limit)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dt_limit: expected a pair (lo, hi), got {dt_limit!r}") from exc
    if math.isnan(lo) or math.isnan(hi) or not 0.0 <= lo <= hi:
        raise ValueError(f"dt_limit: expected 0 <= lo <= hi, got {tuple(dt_limit)!r}")
    if check_values:
        check_input_values(x, dt, A, B, C, z, seq_idx,
                           cu_seqlens if return_varlen_states else None, dims["l"])
    # The device last, so that every other error reads the same on any machine (and is tested
    # on the CPU).
    if not _launch.on_launch_device(x):
        raise ValueError(f"x: must be a CUDA tensor (got device {x.device}); the cuTile kernels "
                         "run on NVIDIA GPUs only. On the CPU use ssd.reference.ssd_chunked.")
    return dims


def check_input_values(x, dt, A, B, C, z, seq_idx, cu_seqlens, seqlen: int) -> None:
    """The checks of ``check_values=True`` (they read the tensors, so they synchronise): A finite
    and <= 0, x, dt, B, C, z finite, seq_idx >= 0 and non-decreasing, and cu_seqlens (None: not
    read) offsets from 0 to ``seqlen``, rising, where seq_idx changes."""
    if not torch.isfinite(A).all() or (A > 0).any():
        raise ValueError("A: must be finite and <= 0 so that every decay exp(dt*A) is <= 1")
    for name, t in (("x", x), ("dt", dt), ("B", B), ("C", C), ("z", z)):
        if t is not None and not torch.isfinite(t).all():
            raise ValueError(f"{name}: contains NaN or inf")
    if seq_idx is not None and ((seq_idx[:, 1:] < seq_idx[:, :-1]).any() or (seq_idx < 0).any()):
        raise ValueError("seq_idx: must be >= 0 and non-decreasing along the sequence")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens.cpu().numpy(), seqlen, seq_idx.cpu().numpy())


def problem_default(chunk_size: int, x, B, stores_states: bool = False) -> SSDConfig:
    """The default config for x's GPU (:func:`gpu_facts`), this problem's batch, length, heads
    and state and the chunk size (:func:`ssd.config.default_config`), not yet fitted to the
    problem. ``stores_states``: the default for a forward whose backward reads every chunk's
    entering state (training).

    Args: x (b, l, h, p), B (b, l, g, n)."""
    capability, sms = gpu_facts(x.device)
    problem = (x.shape[0], x.shape[2], x.shape[3], B.shape[3])  # (b, h, p, n)
    return default_config(capability, problem=problem, sms=sms, chunk_size=chunk_size,
                          seqlen=x.shape[1], stores_states=stores_states)


def resolve_config(config: SSDConfig | None, chunk_size: int, x, B) -> SSDConfig:
    """``config`` (None: :func:`problem_default`) fitted to the problem: tiles clamped to the
    chunk, head and state sizes, the head block to the heads per group, and the entering states'
    dtype resolved against x's (see :meth:`SSDConfig.for_problem`).

    Args: x (b, l, h, p), B (b, l, g, n)."""
    if config is None:
        config = problem_default(chunk_size, x, B)
    return config.for_problem(chunk_size, x.shape[-1], B.shape[-1], x.shape[2] // B.shape[2],
                              input_dtype=x.dtype)


def takes_fused_scan(config: SSDConfig, seq_idx) -> bool:
    """Whether the forward runs stages 2 and 3 as one kernel (:mod:`ssd.kernels.fused_scan`): where the
    config enables it, except for packed sequences (seq_idx), which it does not cover."""
    return config.fused_scan.enabled and seq_idx is None


def forward_stages(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                   initial_states=None, seq_idx=None, dt_softplus=False,
                   dt_limit=(0.0, math.inf), config: SSDConfig | None = None,
                   outputs: dict | None = None, cu_seqlens=None) -> dict:
    """Run the stages and return every intermediate, named as in ``ssd.reference``.

    Args:
        (as :func:`mamba_chunk_scan_combined`), plus
        cu_seqlens: optional (num_sequences + 1,) int offsets of the sequences packed along a
            batch of one row (with seq_idx): then also varlen_states, each one's final state.
        config: tile sizes and layout choices; None picks :func:`ssd.config.default_config`.
        outputs: optional preallocated tensors keyed like the result (tests fill them with NaN
            so that an element a kernel fails to write is caught).
    Returns:
        dict with dt_out, dA_cumsum (b, h, c, q) fp32; final_states (b, h, p, n) fp32; y
        (b, l, h, p) in x's dtype; and, unless stages 2 and 3 ran as one kernel
        (:func:`takes_fused_scan`), which stores no entering state: states (b, c, h, p, n) fp32 (split
        stage 2 only); prev_states (b, c, h, p, n), with ``StateConfig.groups > 1`` from each
        group's start, then also chunk_decay (b, h, c, DECAY_ROW) fp32 and group_enter (b, G, h, p, n)
        (:class:`ssd.kernels.state_passing.Groups`); with cu_seqlens, varlen_states
        (num_sequences, h, p, n) fp32.
    """
    config = resolve_config(config, chunk_size, x, B)
    inputs = prepare(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                     initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    return run_stages(inputs, chunk_size, dt_softplus, dt_limit, config, outputs)


class Inputs(NamedTuple):
    """The tensors the stages read, as :func:`prepare` readies them (None where absent; shapes
    as in :func:`mamba_chunk_scan_combined`)."""
    x: torch.Tensor                    # (b, l, h, p), last dimension of unit stride
    dt: torch.Tensor                   # (b, l, h), likewise
    A: torch.Tensor                    # (h,) fp32
    B: torch.Tensor                    # (b, l, g, n), last dimension of unit stride
    C: torch.Tensor                    # (b, l, g, n), likewise
    D: torch.Tensor | None             # (h,) or (h, p)
    z: torch.Tensor | None             # (b, l, h, p), last dimension of unit stride
    dt_bias: torch.Tensor | None       # (h,) fp32
    initial_states: torch.Tensor | None  # (b, h, p, n)
    seq_idx: torch.Tensor | None       # (b, l) int32
    seq_last: torch.Tensor | None      # (b, c) int32, seq_idx at each chunk's last position
    cu_seqlens: torch.Tensor | None    # (num_sequences + 1,) int32


def _fp32(t):
    """``t`` (None passes) as the kernels read A and dt_bias: fp32, contiguous."""
    return t if t is None or (t.dtype == torch.float32 and t.is_contiguous()) else (
        t.to(torch.float32).contiguous())


def prepare(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
            seq_idx=None, cu_seqlens=None) -> Inputs:
    """The arguments as the kernels take them (:class:`Inputs`): each the caller's own tensor
    where it already is so (no copy, no launch), else a copy (a strided last dimension, another
    dtype) or, for seq_last, computed from seq_idx. Everything the stages compute besides their
    kernels' outputs is here, so that a replayed call (:class:`Plan`) computes it too."""
    seq_last = None
    if seq_idx is not None:
        seq_idx = seq_idx.to(torch.int32)
        seq_last = chunk_seq_last(seq_idx, chunk_size)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    return Inputs(_last_dim_contiguous(x), _last_dim_contiguous(dt), _fp32(A),
                  _last_dim_contiguous(B), _last_dim_contiguous(C), D, _last_dim_contiguous(z),
                  _fp32(dt_bias), initial_states, seq_idx, seq_last, cu_seqlens)


def run_stages(inputs: Inputs, chunk_size: int, dt_softplus, dt_limit, config: SSDConfig,
               outputs: dict | None = None) -> dict:
    """The stages' launches on :func:`prepare`'d ``inputs`` with a resolved ``config``
    (:func:`resolve_config`); arguments and result as :func:`forward_stages`'."""
    x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, seq_last, cu_seqlens = inputs
    out = outputs or {}
    r = {}
    r["dt_out"], r["dA_cumsum"] = _cumsum.chunk_cumsum(
        dt, A, chunk_size, dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
        config=config.cumsum, out=_pair(out, "dt_out", "dA_cumsum"))
    if takes_fused_scan(config, seq_idx):
        r["y"], r["final_states"] = _fused_scan.fused_scan(
            B, C, x, r["dt_out"], r["dA_cumsum"], D=D, z=z, initial_states=initial_states,
            config=config.fused_scan, out=_pair(out, "y", "final_states"))
        return r
    stage2_out = None
    if "prev_states" in out and "final_states" in out:
        buffers = (_passing.Groups(out["chunk_decay"], out["group_enter"],
                                   _passing.chunks_per_group(r["dA_cumsum"].shape[2],
                                                             config.state.groups))
                   if "chunk_decay" in out and "group_enter" in out else None)
        stage2_out = _passing.StageTwo(out["prev_states"], out["final_states"], buffers)
    if config.state.fused and config.state.groups > 1:
        stage2 = _passing.grouped_chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], initial_states=initial_states, seq_idx=seq_idx,
            seq_last=seq_last, config=config.state, out=stage2_out)
        r["chunk_decay"], r["group_enter"] = stage2.groups.chunk_decay, stage2.groups.group_enter
    elif config.state.fused:
        stage2 = _passing.chunk_state_passing(
            B, x, r["dt_out"], r["dA_cumsum"], initial_states=initial_states, seq_idx=seq_idx,
            seq_last=seq_last, config=config.state, out=stage2_out)
    else:
        r["states"] = _state.chunk_state(B, x, r["dt_out"], r["dA_cumsum"], seq_idx=seq_idx,
                                         seq_last=seq_last, config=config.state,
                                         out=out.get("states"))
        stage2 = _passing.state_passing(
            r["states"], r["dA_cumsum"], initial_states=initial_states, seq_last=seq_last,
            config=config.state, out=stage2_out)
    r["prev_states"], r["final_states"] = stage2.prev_states, stage2.final_states
    r["y"] = _scan.chunk_scan(B, C, x, r["dt_out"], r["dA_cumsum"], r["prev_states"], D=D, z=z,
                              seq_idx=seq_idx, seq_last=seq_last, config=config.scan,
                              out=out.get("y"), groups=stage2.groups)
    if cu_seqlens is not None:
        r["varlen_states"] = _varlen.chunk_state_varlen(
            B, x, r["dt_out"], r["dA_cumsum"], r["prev_states"],
            cu_seqlens, seq_idx, seq_last, config=config.state,
            out=out.get("varlen_states"), groups=stage2.groups)
    return r


def _pair(out, a, b):
    return (out[a], out[b]) if a in out and b in out else None


# --- plans: a call's host path, traced once per signature and replayed ---------------------------

RESULTS = ("y", "final_states", "varlen_states")  # what the caller can get back
MAX_PLANS = 256  # beyond this many signatures the oldest plan is dropped


@dataclass(frozen=True)
class Plan:
    """What the calls of one :func:`plan_key` after the first skip: its checks passed (``dims``,
    :func:`validate`'s sizes) and its configuration resolved; from the second call on (the
    signature recurs: :func:`make_plan` traces it once), where it can be replayed, its launches.

    steps: the launches (:class:`ssd.launch.Step`), in order; None where the stages compute
        something besides allocating and launching (then each call runs :func:`run_stages`).
    blanks: (shape, stride, dtype) of each tensor the stages allocate (outputs, intermediates,
        scratch): allocated afresh at every call, as the launchers would.
    pool: the launches' constant arguments: scalars, compile-time constants and the stand-ins
        for absent inputs (never touched, so one serves every call).
    picks: per step, the positions of its arguments in ``pool + inputs + blanks``.
    results: per name of RESULTS, its position in blanks (None where the call has none).
    held: the caller's config object, kept alive: the key holds its id.
    traced: whether :func:`make_plan` made it (a first call's plan holds checks and config only).
    """
    config: SSDConfig
    dims: dict
    steps: tuple | None = None
    blanks: tuple = ()
    pool: tuple = ()
    picks: tuple = ()
    results: tuple = ()
    held: object = None
    traced: bool = False

    def allocate(self, device) -> tuple:
        """Fresh tensors for this call's blanks."""
        return tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device)
                     for shape, stride, dtype in self.blanks)

    def arguments(self, inputs: Inputs, blanks: tuple) -> list:
        """Each step's argument tuple, with this call's ``inputs`` and ``blanks`` in place."""
        pool = self.pool + inputs + blanks
        return [pick(pool) for pick in self.picks]

    def replay(self, inputs: Inputs, device) -> dict:
        """Launch this plan on ``inputs`` (:func:`prepare`'d); return RESULTS by name."""
        blanks = self.allocate(device)
        _launch.run(self.steps, self.arguments(inputs, blanks), device)
        return {name: blanks[i] for name, i in zip(RESULTS, self.results) if i is not None}


_plans: dict = {}  # plan_key -> Plan


def plan_key(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
             dt_softplus, dt_limit, return_varlen_states, config) -> tuple | None:
    """Everything a call's host path depends on: each tensor argument's dtype, shape, strides and
    device (None where absent; cu_seqlens only with return_varlen_states, the one call that
    reads it), chunk_size, dt_softplus, dt_limit, return_varlen_states, the config object by
    identity (its plan holds it, so no other object takes its id while the plan lives), and
    whether launches are captured (CPU tensors pass :func:`validate` there only). None
    where an argument is of a kind a key cannot hold exactly (such a call is checked and run in
    full): a chunk_size not an int (64.0 must still fail the checks), a dt_limit not a tuple of
    two numbers, an argument that is no tensor."""
    if type(chunk_size) is not int or type(dt_limit) is not tuple or len(dt_limit) != 2 or not (
            isinstance(dt_limit[0], (int, float)) and isinstance(dt_limit[1], (int, float))):
        return None
    key = [chunk_size, bool(dt_softplus), dt_limit, bool(return_varlen_states), id(config),
           _launch.capturing()]  # CPU tensors pass the checks under capture only
    for t in (x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx,
              cu_seqlens if return_varlen_states else None):
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.dtype, t.shape, t.stride(), t.device))
        else:
            return None
    return tuple(key)


def _remember(key, plan: Plan) -> None:
    if len(_plans) >= MAX_PLANS:
        _plans.pop(next(iter(_plans), None), None)
    _plans[key] = plan


def _picker(positions: tuple):
    """A function from a sequence to the tuple of its items at ``positions``."""
    if len(positions) > 1:
        return operator.itemgetter(*positions)
    return lambda pool: tuple(pool[i] for i in positions)  # itemgetter of one gives no tuple


BLANK_OPS = ("empty.memory_format", "empty_like.default", "empty_strided.default")


def make_plan(inputs: Inputs, chunk_size: int, dt_softplus, dt_limit, config: SSDConfig,
              dims: dict, held=None) -> Plan | None:
    """Run the stages once under :func:`ssd.launch.trace` (recorded, nothing launched) and
    record what they did as a :class:`Plan`: each launch argument is one of ``inputs``, a
    tensor the stages allocated blank, a stand-in for an absent input, or a constant. A plan
    without steps where the stages ran any other torch op or passed any other tensor; None where
    two inputs are one tensor (which role a launch argument plays is then unknown; the call runs
    in full and a later call traces again)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    roles = {id(t): i for i, t in enumerate(inputs) if t is not None}
    if len(roles) < sum(t is not None for t in inputs):
        return None

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.blank, self.other = {}, []  # blank: id -> tensor, held so no id is reused

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # torch hands a factory's result out through a detach (another tensor object)
            if func.__name__ in BLANK_OPS or (func.__name__ == "detach.default"
                                              and id(args[0]) in self.blank):
                self.blank[id(out)] = out
            else:
                self.other.append(func.__name__)
            return out

    with _launch.trace() as seen, Ops() as ops:
        r = run_stages(inputs, chunk_size, dt_softplus, dt_limit, config)
    plain = Plan(config, dims, held=held, traced=True)
    if ops.other:
        return plain
    pool, blanks, where, refs = [], [], {}, []
    for record, _ in seen.launches:
        step = []
        for arg in record.args:
            if not isinstance(arg, torch.Tensor) or id(arg) in seen.stand_ins:
                step.append(("pool", len(pool)))
                pool.append(arg)
            elif id(arg) in roles:
                step.append(("input", roles[id(arg)]))
            elif id(arg) in ops.blank:
                if id(arg) not in where:
                    where[id(arg)] = len(blanks)
                    blanks.append((tuple(arg.shape), arg.stride(), arg.dtype))
                step.append(("blank", where[id(arg)]))
            else:
                return plain
        refs.append(step)
    if any(name in r and id(r[name]) not in where for name in RESULTS):
        return plain
    base = dict(pool=0, input=len(pool), blank=len(pool) + len(inputs))
    steps = tuple(_launch.Step(record.kernel, record.grid, quick,
                               _launch.launch_key(record.kernel, record.args) if quick else None)
                  for record, quick in seen.launches)
    return Plan(config, dims, steps, tuple(blanks), tuple(pool),
                tuple(_picker(tuple(base[kind] + i for kind, i in step)) for step in refs),
                tuple(where[id(r[name])] if name in r else None for name in RESULTS), held,
                traced=True)


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                              initial_states=None, seq_idx=None, cu_seqlens=None,
                              dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, return_varlen_states=False, *,
                              config: SSDConfig | None = None, check_values: bool = False,
                              backwards=None):
    """Mamba-2 SSD with mamba_ssm's signature, shapes, dtypes and semantics.

    Differentiable: where grad mode is on and an input requires grad, the call goes through
    :class:`ssd.autograd.ChunkScanCombined` (this forward, saving what the backward reads; the
    backward of :mod:`ssd.backward`), and every float input gets its gradient in its own dtype.
    Otherwise nothing is saved and the forward runs alone.

    Args:
        x: (b, l, h, p) fp32 / bf16 / fp16 on a CUDA device.
        dt: (b, l, h); A: (h,), must be <= 0; B, C: (b, l, g, n) with h % g == 0.
        chunk_size: q, a power of two in 16..256.
        D: optional (h,) or (h, p) skip; z: optional (b, l, h, p) gate, y * silu(z).
        dt_bias: optional (h,); dt_softplus: softplus(dt + dt_bias); dt_limit: clamp (lo, hi).
        initial_states: optional (b, h, p, n); seq_idx: optional (b, l) int, packed sequences.
        cu_seqlens: (num_sequences + 1,) int32 or int64 on x's device, read only with
            return_varlen_states (as mamba_ssm): the offsets of the sequences packed along a
            batch of one row, 0 first, l last, strictly increasing, with seq_idx given and
            changing exactly at them.
        return_final_states: also return the (b, h, p, n) fp32 state after the last token.
        return_varlen_states: also return each packed sequence's state after its last token,
            (num_sequences, h, p, n) fp32 (mamba_ssm returns them in its stored states'
            dtype). The initial state enters the first sequence's where seq_idx[0, 0] == 0,
            as it does y; mamba_ssm leaves it out when that sequence ends in the first chunk.
        config: tile/layout choices (default per GPU architecture).
        check_values: also check A <= 0, finite inputs, seq_idx order and cu_seqlens' offsets
            (synchronises).
        backwards: the :class:`ssd.backward.StageBackwards` the backward composes (None: the
            cuTile kernels where one exists; ``ssd.backward.TORCH_BACKWARDS``: PyTorch alone).
    Returns:
        y (b, l, h, p) in x's dtype, or (y, final_states) with return_final_states; with
        return_varlen_states, varlen_states comes last: (y, varlen_states) or (y,
        final_states, varlen_states), mamba_ssm's order.

    A gradient flowing into varlen_states raises NotImplementedError (in the backward).

    A call whose tensors' dtypes, shapes, strides and devices and other arguments were seen
    before skips the checks but check_values'; from the second such call on it replays its
    :class:`Plan` (traced at that call): no launcher code either.
    The first call for a new shape or configuration compiles its kernels (seconds). chunk_scan's
    tuned build then compiles in a child process while a quick build computes the same values
    (:mod:`ssd.launch`); call :func:`ssd.wait_tuned` before timing this function.
    """
    key = plan_key(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states, seq_idx, cu_seqlens,
                   dt_softplus, dt_limit, return_varlen_states, config)
    plan = _plans.get(key) if key is not None else None
    if plan is None:
        dims = validate(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                        initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
                        check_values=check_values, cu_seqlens=cu_seqlens,
                        return_varlen_states=return_varlen_states)
    elif check_values:  # the rest passed for this key; values change from call to call
        check_input_values(x, dt, A, B, C, z, seq_idx,
                           cu_seqlens if return_varlen_states else None, plan.dims["l"])
    if _autograd.requires_grad(x, dt, A, B, C, D, z, dt_bias, initial_states):
        if config is None and x.is_cuda:  # the default that stores every chunk's entering state
            # (fitted to the problem by forward_stages, as a caller's config is)
            config = problem_default(chunk_size, x, B, stores_states=True)
        return _autograd.chunk_scan_combined(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=dt_softplus, dt_limit=dt_limit,
            return_final_states=return_final_states, return_varlen_states=return_varlen_states,
            stages=forward_stages, config=config, backwards=backwards)
    varlen = cu_seqlens if return_varlen_states else None
    if key is None:  # arguments a key cannot hold exactly: the whole forward at every call
        return _returned(forward_stages(
            x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
            seq_idx=seq_idx, dt_softplus=dt_softplus, dt_limit=dt_limit, config=config,
            cu_seqlens=varlen), return_final_states, return_varlen_states)
    inputs = prepare(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                     initial_states=initial_states, seq_idx=seq_idx, cu_seqlens=varlen)
    if plan is None:  # a first call: remember its checks and configuration, trace nothing yet
        plan = Plan(resolve_config(config, chunk_size, x, B), dims, held=config)
        _remember(key, plan)
    elif not plan.traced:  # a second call: the signature recurs, worth a trace (make_plan)
        traced = make_plan(inputs, chunk_size, dt_softplus, dt_limit, plan.config, plan.dims,
                           held=config)
        if traced is not None:
            plan = traced
            _remember(key, plan)
    r = (plan.replay(inputs, x.device) if plan.steps is not None
         else run_stages(inputs, chunk_size, dt_softplus, dt_limit, plan.config))
    return _returned(r, return_final_states, return_varlen_states)


def _returned(r: dict, return_final_states, return_varlen_states):
    """mamba_ssm's return convention over a result dict."""
    if return_varlen_states:
        return ((r["y"], r["final_states"], r["varlen_states"]) if return_final_states
                else (r["y"], r["varlen_states"]))
    return (r["y"], r["final_states"]) if return_final_states else r["y"]


__all__ = ["mamba_chunk_scan_combined", "forward_stages", "validate", "chunk_seq_last",
           "takes_fused_scan", "STAGES", "Plan", "plan_key", "make_plan", "prepare", "run_stages"]
