"""Training, the complete job: a small Mamba-2 language model learns multi-query associative
recall with each SSD backend, and a training step of the stack is timed at the model sizes.

``python -m ssd.tools.train [mqar|step]`` (library + command line).

The task: multi-query associative recall (MQAR)
-----------------------------------------------
Arora, Eyuboglu et al. 2023, "Zoology: Measuring and Improving Recall in Efficient Language
Models", define MQAR as the recall a language model does in context: a sequence first lists
``num_pairs`` key-value pairs, then asks for keys again; at each query the model must output the
value that followed that key. Zoology found that the gap between attention and gated
convolutions or state-space models on language modelling is mostly this ability, and that
MQAR, unlike the single-query recall of earlier synthetic tasks, separates the architectures
at small sizes. :func:`mqar` generates it (this module's own generator, seeded; no download):

* vocabulary ``0 .. vocab_size - 1``; keys are drawn from ``1 .. vocab_size // 2 - 1``, values
  from ``vocab_size // 2 .. vocab_size - 1``; in each sequence the ``P = num_pairs`` keys are
  distinct, and so are the values, each drawn uniformly without replacement;
* positions ``0 .. 2P - 1`` hold ``k_1 v_1 k_2 v_2 ... k_P v_P`` in a random order of pairs;
* every key is queried exactly once, later: the rest of the sequence has
  ``(seq_len - 2P) // 2`` query slots at even offsets ``2P + 2 s``, and the P queried slots are
  drawn without replacement with probability proportional to ``s^(power_a - 1)`` (Zoology's
  power law, ``power_a = 0.01``: queries cluster near the context, as a repeated bigram in text
  tends to recur soon; ``power_a = 1`` spreads them uniformly);
* every other position holds a token drawn uniformly from the whole vocabulary (Zoology's
  ``random_non_queries``), so the model cannot find the queries by their neighbours;
* the target at a query's position is the queried key's value (next-token prediction: having
  read ``k_j``, say ``v_j``); every other position's target is :data:`IGNORE`. The loss and the
  accuracy are taken at the queries only.

An example with ``vocab_size=16, num_pairs=2, seq_len=12`` (``.`` a random token, ``-``
ignored)::

    inputs   3 12  5  9  .  .  5  .  3  .  .  .
    targets  -  -  -  -  -  -  9  -  12 -  -  -

Chance accuracy is ``1 / (vocab_size // 2)`` for a model that only learned which tokens are
values, ``1 / P`` for one that copies some value of the context; only recall gets near 1.

The model and its training
--------------------------
``ssd.layer.Mamba2LM``: token embedding -> ``ssd.layer.Mamba2Stack`` (pre-norm Mamba-2 mixers
with residuals, then the final RMSNorm) -> LM head (tied to the embedding by default), the logits
computed at the query positions only. :func:`train` runs AdamW (weight decay on matrices only,
linear warm-up then cosine decay) for a given number of steps, evaluating the loss and the
accuracy on a held-out set every ``eval_every`` steps, and records the loss curve, the accuracy
curve, the time of every step and the peak memory. :func:`run` trains once per backend and
seed from the same initial weights and batches (only the SSD differs), compares the curves
(:func:`curve_gaps`: the loss difference between backends against that between seeds) and
writes ``results/<gpu>/training.json``.

Precision (``TrainConfig.precision``): ``"bf16"`` keeps the weights, the gradients and AdamW's
state in fp32 and runs the forward under ``torch.autocast(dtype=torch.bfloat16)``, the mixed
precision mamba_ssm's users train with: the projections and the conv compute in bf16, so the
SSD gets x, dt, B and C in bf16 (A, D and dt_bias stay fp32) and computes as its backend does
(``ssd.layer.SSDStep`` turns autocast off inside), and the norms and the residual stream
compute in fp32. ``"fp32"`` runs without autocast (the CPU tests).

The training-step timer
-----------------------
:func:`step_time`: one training step (forward, backward of a fixed upstream gradient, AdamW
step) of a ``Mamba2Stack`` of a few layers whose SSD has a ``models`` shape's heads, state and
groups (``ssd.tools.bench.SUITES``, at its batch and sequence length), in the precision above,
timed eagerly with CUDA events (a training loop is not captured in a graph; L2 is not flushed:
the step is many kernels long). The SSD's share of the step comes from timing layer 0's SSD
forward + backward alone on the tensors and upstream gradient it got in a step (captured with
hooks); ``n_layers`` times that over the step time is the share, and Amdahl's law
(``ssd.tools.endtoend.amdahl``) turns the share and the SSD's speedup into a predicted step
speedup, shown beside the measured one (:func:`step_sweep`, ``results/<gpu>/training_step.json``).

On the CPU (tests) the same code runs with the ``torch`` backend on tiny sizes, timed with
``time.perf_counter``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .bench import SUITES, Shape, _progress
from .endtoend import amdahl_rows, timer, usable_backends
from .env import RESULTS, environment, gpu_slug, write_json

#: The target of a position that is not a query (``torch.nn.functional.cross_entropy``'s
#: default ignore_index, as Zoology's labels).
IGNORE = -100
#: Backends compared: ours and mamba_ssm's Triton SSD (forward and backward).
BACKENDS = ("cutile", "mamba_ssm")
#: ``TrainConfig.precision``: fp32 weights with a bf16-autocast forward, or fp32 throughout.
PRECISIONS = ("bf16", "fp32")
#: The baseline and the new backend of a speedup (as ``ssd.tools.endtoend``).
BASE, NEW = "mamba_ssm", "cutile"


# ----------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class MQARConfig:
    """The MQAR task's sizes (see the module docstring for the definition).

    Args:
        vocab_size: V; keys come from 1 .. V//2 - 1, values from V//2 .. V - 1.
        num_pairs: P, the key-value pairs of a sequence, each queried once.
        seq_len: L, tokens a sequence; at least 4 P (the pairs, then P query slots).
        power_a: the power law of the query slots, in (0, 1]; 1 is uniform.
    """

    vocab_size: int = 8192
    num_pairs: int = 16
    seq_len: int = 256
    power_a: float = 0.01

    def __post_init__(self):
        for name in ("vocab_size", "num_pairs", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.vocab_size // 2 - 1 < self.num_pairs:
            raise ValueError(f"num_pairs: {self.num_pairs} distinct keys need vocab_size >= "
                             f"{2 * self.num_pairs + 2}, got {self.vocab_size}")
        if self.seq_len < 4 * self.num_pairs:
            raise ValueError(f"seq_len: {self.num_pairs} pairs and their queries need seq_len "
                             f">= 4 * num_pairs = {4 * self.num_pairs}, got {self.seq_len}")
        if not 0.0 < self.power_a <= 1.0:
            raise ValueError(f"power_a: expected 0 < power_a <= 1, got {self.power_a!r}")

    @property
    def query_slots(self) -> int:
        """The even offsets after the pairs where a query may stand."""
        return (self.seq_len - 2 * self.num_pairs) // 2


@dataclass(frozen=True)
class MQARData:
    """N MQAR sequences (torch int64 tensors on one device).

    Attributes:
        inputs: (N, L) tokens.
        targets: (N, L): the queried key's value at each query position, :data:`IGNORE`
            elsewhere.
        queries: (N, P) the positions of the queries (query j asks pair j's key).
        answers: (N, P) the value each query asks for: ``targets`` gathered at ``queries``.
    """

    inputs: object
    targets: object
    queries: object
    answers: object

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def to(self, device) -> "MQARData":
        return MQARData(*(t.to(device) for t in (self.inputs, self.targets, self.queries,
                                                  self.answers)))

    def batch(self, index) -> "MQARData":
        """The examples at ``index`` (an index tensor or a slice)."""
        return MQARData(self.inputs[index], self.targets[index], self.queries[index],
                        self.answers[index])


def _top_k(scores, k: int):
    """Indices of the k largest scores of each row, largest first: (n, m) -> (n, k)."""
    idx = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, idx, axis=1), axis=1, kind="stable")
    return np.take_along_axis(idx, order, axis=1)


def _draw_distinct(rng, n: int, choices: int, k: int, log_weights=None, block=2**22):
    """k distinct integers from 0 .. choices - 1 for each of n rows, (n, k), in the order drawn.

    Uniformly, from a large range (k (k - 1) <= 2 choices): k iid integers a row, the rows that
    hold a repeat drawn again (a uniform ordered k-tuple of distinct values; a row is kept with
    probability about exp(-k^2 / (2 choices)) >= 1/e). Otherwise the k largest of ``choices``
    iid uniforms a row, or with ``log_weights`` (choices,) the Gumbel-top-k trick, the k largest
    of ``log_weights + Gumbel noise``: sequential sampling without replacement with probability
    proportional to the weights. Those rows are drawn in blocks of at most ``block`` scores.
    """
    if log_weights is None and k * (k - 1) <= 2 * choices:
        out = rng.integers(0, choices, size=(n, k))
        while True:
            ordered = np.sort(out, axis=1)
            repeat = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            if not repeat.any():
                return out
            out[repeat] = rng.integers(0, choices, size=(int(repeat.sum()), k))
    out = np.empty((n, k), dtype=np.int64)
    rows = max(1, block // choices)
    for start in range(0, n, rows):
        m = min(rows, n - start)
        u = rng.random((m, choices))
        scores = u if log_weights is None else log_weights - np.log(-np.log1p(-u))
        out[start:start + m] = _top_k(scores, k)
    return out


def mqar(config: MQARConfig, num_examples: int, seed) -> MQARData:
    """``num_examples`` MQAR sequences, the same for the same ``config`` and ``seed`` (an int or
    a ``numpy.random.SeedSequence``), on the CPU.

    Returns:
        :class:`MQARData`: inputs and targets (N, L), queries and answers (N, P), int64.
    """
    import torch

    if isinstance(num_examples, bool) or not isinstance(num_examples, int) or num_examples < 1:
        raise ValueError(f"num_examples: expected a positive int, got {num_examples!r}")
    rng = np.random.default_rng(seed)
    V, P, L, n = config.vocab_size, config.num_pairs, config.seq_len, num_examples
    half = V // 2
    keys = 1 + _draw_distinct(rng, n, half - 1, P)  # (n, P) in 1 .. V//2 - 1
    values = half + _draw_distinct(rng, n, V - half, P)  # (n, P) in V//2 .. V - 1
    slot = np.arange(1, config.query_slots + 1, dtype=np.float64)
    gaps = _draw_distinct(rng, n, config.query_slots, P,
                          log_weights=(config.power_a - 1.0) * np.log(slot))  # (n, P)
    queries = 2 * P + 2 * gaps  # (n, P) positions, even offsets after the pairs
    inputs = rng.integers(0, V, size=(n, L), dtype=np.int64)  # the random filler
    inputs[:, 0:2 * P:2], inputs[:, 1:2 * P:2] = keys, values
    rows = np.arange(n)[:, None]
    inputs[rows, queries] = keys  # query j asks pair j's key
    targets = np.full((n, L), IGNORE, dtype=np.int64)
    targets[rows, queries] = values
    as_tensor = torch.from_numpy
    return MQARData(as_tensor(inputs), as_tensor(targets), as_tensor(queries),
                    as_tensor(values.copy()))


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class TrainConfig:
    """One training run's task, model, optimiser and measurement settings.

    Task (:class:`MQARConfig`): vocab_size, num_pairs, seq_len, power_a; train_examples
    sequences to train on (drawn from ``data_seed``, reshuffled every epoch by the run's seed)
    and eval_examples held-out ones (another stream of ``data_seed``: the same for every run).

    Model (``ssd.layer.Mamba2LM``): d_model, n_layers, d_state, headdim, expand, d_conv, ngroups,
    chunk_size (the SSD's), tie (the LM head is the embedding).

    Optimiser: AdamW (lr, weight_decay on matrices only, betas) on batches of ``batch``; the
    learning rate rises linearly over ``warmup`` steps, then decays by a cosine to
    ``min_lr_ratio * lr`` at ``steps``. precision: one of :data:`PRECISIONS`.

    Measurement: eval_every (steps between evaluations; also before the first step and after
    the last), target_accuracy (the accuracy whose first reaching is timed), timing_warmup (the
    first steps, which compile, reported apart from the steady state).
    """

    vocab_size: int = 8192
    num_pairs: int = 16
    seq_len: int = 256
    power_a: float = 0.01
    train_examples: int = 65_536
    eval_examples: int = 1_024
    data_seed: int = 0
    d_model: int = 128
    n_layers: int = 2
    d_state: int = 64
    headdim: int = 64
    expand: int = 2
    d_conv: int = 4
    ngroups: int = 1
    chunk_size: int = 64
    tie: bool = True
    steps: int = 2_000
    batch: int = 64
    lr: float = 1e-2
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    warmup: int = 100
    min_lr_ratio: float = 0.1
    precision: str = "bf16"
    eval_every: int = 100
    target_accuracy: float = 0.9
    timing_warmup: int = 5

    def __post_init__(self):
        self.task  # checks the task's sizes
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        for name in ("train_examples", "eval_examples", "steps", "batch", "eval_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.eval_examples % self.batch:
            raise ValueError(f"eval_examples: expected a multiple of batch {self.batch} (one "
                             f"batch shape for training and evaluation), got {self.eval_examples}")
        if self.train_examples < self.batch:
            raise ValueError(f"train_examples: expected at least batch = {self.batch}, got "
                             f"{self.train_examples}")
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ValueError(f"target_accuracy: expected in (0, 1], got {self.target_accuracy!r}")
        if self.warmup < 0 or self.timing_warmup < 0:
            raise ValueError("warmup, timing_warmup: expected >= 0")
        self.mixer  # checks the model's sizes

    @property
    def task(self) -> MQARConfig:
        return MQARConfig(self.vocab_size, self.num_pairs, self.seq_len, self.power_a)

    @property
    def mixer(self):
        """The mixers' ``ssd.layer.Mamba2Config``, fp32 weights (see the module docstring)."""
        from ..layer import Mamba2Config

        return Mamba2Config(d_model=self.d_model, d_state=self.d_state, d_conv=self.d_conv,
                            expand=self.expand, headdim=self.headdim, ngroups=self.ngroups,
                            chunk_size=self.chunk_size, dtype="float32")

    def eval_points(self) -> list[int]:
        """The steps after which the model is evaluated: 0 (before training), every
        eval_every, and the last."""
        return sorted({0, *range(self.eval_every, self.steps + 1, self.eval_every), self.steps})


#: Named configurations. ``small``: the run a reader repeats on one GPU in minutes (Zoology's
#: vocabulary, sequence length and 16 pairs; a 2-layer model of width 128, 4 heads). Its lr is
#: in the range Zoology sweeps (1e-3 to 3e-2) at the high end: MQAR models sit on a plateau
#: where they copy some value of the context before recall appears, and on the CPU a smaller lr
#: (3e-3) kept them there thousands of steps longer. ``tiny``: the same pipeline in seconds on
#: a CPU (tests, a smoke run).
TRAIN_PRESETS = {
    "small": TrainConfig(),
    "tiny": TrainConfig(vocab_size=32, num_pairs=4, seq_len=32, train_examples=2048,
                        eval_examples=256, d_model=32, n_layers=2, d_state=16, headdim=16,
                        chunk_size=16, steps=30, batch=32, lr=1e-2, warmup=3, eval_every=10,
                        precision="fp32", timing_warmup=2),
}


# ----------------------------------------------------------------------------- training


def _device(device=None):
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def autocast(precision: str, device):
    """The forward's context: bf16 autocast on ``device``'s type for "bf16", none for "fp32"."""
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=_device(device).type, dtype=torch.bfloat16)


def make_data(config: TrainConfig, device=None) -> tuple[MQARData, MQARData]:
    """(train, held-out) sets of the config's task, on ``device``: two independent streams of
    ``config.data_seed``, so the held-out sequences are none of the training ones (up to a
    collision of probability ~0 for any useful vocabulary)."""
    train_seed, eval_seed = np.random.SeedSequence(config.data_seed).spawn(2)
    task, device = config.task, _device(device)
    return (mqar(task, config.train_examples, train_seed).to(device),
            mqar(task, config.eval_examples, eval_seed).to(device))


def optimizer(model, config: TrainConfig):
    """AdamW with weight decay on the matrices (embedding, projections, conv filters) and none
    on the vectors (A_log, dt_bias, D, norm weights, conv bias), as mamba_ssm exempts A_log, D
    and dt_bias; and its schedule: linear warm-up over ``warmup`` steps, then a cosine from lr
    down to ``min_lr_ratio * lr`` at ``steps``."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=config.weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=config.lr, betas=tuple(config.betas))

    def factor(step):  # the multiplier of lr at ``step`` (0-based)
        if step < config.warmup:
            return (step + 1) / config.warmup
        span = max(1, config.steps - config.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (step - config.warmup) / span)))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def query_loss(model, data: MQARData):
    """(mean cross-entropy over the queries (a 0-d fp32 tensor), number of correct answers
    (a 0-d int tensor)): the logits at the query positions only."""
    import torch

    logits = model(data.inputs, data.queries).float()  # (b, P, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.answers.flatten())
    return loss, (logits.argmax(-1) == data.answers).sum()


def evaluate(model, data: MQARData, batch: int, precision: str) -> tuple[float, float]:
    """(mean query loss, accuracy) on ``data`` in batches of ``batch``, without gradients."""
    import torch

    device = data.inputs.device
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    with torch.no_grad(), autocast(precision, device):
        for start in range(0, len(data), batch):
            loss, right = query_loss(model, data.batch(slice(start, start + batch)))
            total_loss += loss * min(batch, len(data) - start)
            correct += right
    queries = data.answers.numel()
    return float(total_loss) / len(data), int(correct) / queries


class StepClock:
    """Per-step wall time: CUDA events around each step on a GPU (read once at the end, so
    timing adds no synchronisation), ``time.perf_counter`` on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def start(self):
        self.marks.append([self._mark(), None])

    def stop(self):
        self.marks[-1][1] = self._mark()

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self) -> list[float]:
        if not self.cuda:
            return [(b - a) * 1e3 for a, b in self.marks]
        import torch

        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in self.marks]


def _stats(ms: list[float]) -> dict:
    if not ms:
        return dict(median_ms=None, q20_ms=None, q80_ms=None)
    q = statistics.quantiles(ms, n=5, method="inclusive") if len(ms) > 1 else [ms[0]] * 4
    return dict(median_ms=float(statistics.median(ms)), q20_ms=float(q[0]), q80_ms=float(q[3]))


def _rounded(values, digits=5) -> list:
    return [float(f"{v:.{digits}g}") for v in values]


def train(config: TrainConfig, backend: str, *, seed: int = 0, device=None, data=None,
          progress: bool = True) -> dict:
    """Train an ``ssd.layer.Mamba2LM`` on MQAR with SSD backend ``backend``.

    Args:
        config: a :class:`TrainConfig`.
        backend: the SSD backend (``ssd.layer.BACKENDS``; one that trains).
        seed: the initial weights and the order of the batches; the data come from
            ``config.data_seed``. The same seed on the same device gives every backend the same
            initial weights and batches.
        device: default "cuda" when available, else "cpu".
        data: (train, held-out) :class:`MQARData` on ``device`` (default :func:`make_data`).
        progress: show a progress bar (tqdm, when installed).
    Returns:
        a record: backend, seed, ``train_loss`` (every step's batch loss), ``eval_step``,
        ``eval_loss`` and ``eval_accuracy`` (the held-out curve), ``step_ms`` (every step's
        time; after the first, the tuned kernel builds are awaited outside the clock),
        ``first_steps_ms`` (the first ``timing_warmup`` steps) and ``steady`` (median, 20/80 %
        quantiles of the rest), ``final_accuracy``, ``steps_to_target`` and
        ``time_to_target_s`` (the first evaluation at ``target_accuracy`` or above, and the
        training steps' time up to it; None if never reached), ``wall_s`` (evaluations
        included), ``peak_mem_mib`` (GPU: the peak allocated above the data sets, i.e. the
        model, its gradients, AdamW's state and the activations), ``timer``.
    """
    import torch

    from ..launch import wait_tuned
    from ..layer import Mamba2LM

    device = _device(device)
    train_set, eval_set = data or make_data(config, device)
    if device.type == "cuda":  # the peak is counted above what is allocated now (the data)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    model = Mamba2LM(config.vocab_size, config.mixer, config.n_layers, backend,
                     tie=config.tie, device=device, seed=seed)
    opt, schedule = optimizer(model, config)
    # The batches: a seeded permutation of the training set per epoch (the remainder of an
    # epoch dropped), drawn on the CPU and moved once: (steps, batch) example indices.
    order_gen = torch.Generator().manual_seed(seed)
    usable = len(train_set) // config.batch * config.batch
    epochs = -(-config.steps * config.batch // usable)
    batches = torch.cat([torch.randperm(len(train_set), generator=order_gen)[:usable]
                         for _ in range(epochs)])
    batches = batches[:config.steps * config.batch].view(config.steps, config.batch).to(device)

    points = set(config.eval_points())
    losses = torch.empty(config.steps, device=device)  # read once at the end: no sync a step
    evals, clock = [], StepClock(device)
    start = time.perf_counter()
    steps = _progress(range(config.steps), f"train {backend}") if progress else \
        range(config.steps)
    evals.append((0, *evaluate(model, eval_set, config.batch, config.precision)))
    for step in steps:
        batch = train_set.batch(batches[step])
        clock.start()
        with autocast(config.precision, device):
            loss, _ = query_loss(model, batch)
        loss.backward()
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        clock.stop()
        if step == 0:  # later steps run the tuned builds; the wait is in wall_s, not in a step
            wait_tuned()
        losses[step] = loss.detach()
        if step + 1 in points:
            evals.append((step + 1, *evaluate(model, eval_set, config.batch, config.precision)))
            if hasattr(steps, "set_postfix"):
                steps.set_postfix(loss=f"{evals[-1][1]:.3f}", acc=f"{evals[-1][2]:.3f}")
    step_ms = clock.ms()
    wall_s = time.perf_counter() - start
    train_loss = losses.tolist()
    bad = [i for i, v in enumerate(train_loss) if not math.isfinite(v)]
    if bad:
        raise FloatingPointError(f"{backend}: the training loss is not finite from step {bad[0]}")
    reached = next(((s, acc) for s, _, acc in evals if acc >= config.target_accuracy), None)
    record = dict(
        backend=backend, seed=seed, steps=config.steps, train_loss=_rounded(train_loss),
        eval_step=[s for s, _, _ in evals], eval_loss=_rounded([v for _, v, _ in evals]),
        eval_accuracy=[a for _, _, a in evals], step_ms=_rounded(step_ms, 4),
        first_steps_ms=_rounded(step_ms[:config.timing_warmup], 4),
        steady=_stats(step_ms[config.timing_warmup:]),
        final_accuracy=evals[-1][2], final_eval_loss=_rounded([evals[-1][1]])[0],
        steps_to_target=None if reached is None else reached[0],
        time_to_target_s=None if reached is None else sum(step_ms[:reached[0]]) / 1e3,
        wall_s=wall_s, peak_mem_mib=((torch.cuda.max_memory_allocated(device) - before) / 2**20
                                     if device.type == "cuda" else None),
        timer="CUDA events" if device.type == "cuda" else "perf_counter (CPU)")
    return record


def curve_gaps(runs: list[dict]) -> dict:
    """How far apart the held-out loss curves are: between backends at the same seed, and
    between seeds for the same backend (run-to-run noise: another initialisation and batch
    order). Each pair gets the mean and the max over the evaluation points of |loss_a -
    loss_b|; ``within_noise`` says whether the largest mean gap between backends is at most the
    smallest mean gap between seeds (None without two seeds of some backend)."""
    def gap(a, b):
        d = [abs(x - y) for x, y in zip(a["eval_loss"], b["eval_loss"])]
        return dict(mean_abs=sum(d) / len(d), max_abs=max(d))

    between, within = [], []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if a["eval_step"] != b["eval_step"]:
                continue
            if a["seed"] == b["seed"] and a["backend"] != b["backend"]:
                between.append(dict(seed=a["seed"], backends=[a["backend"], b["backend"]],
                                    **gap(a, b)))
            elif a["backend"] == b["backend"] and a["seed"] != b["seed"]:
                within.append(dict(backend=a["backend"], seeds=[a["seed"], b["seed"]],
                                   **gap(a, b)))
    verdict = None
    if between and within:
        verdict = max(g["mean_abs"] for g in between) <= min(g["mean_abs"] for g in within)
    return dict(between_backends=between, between_seeds=within, within_noise=verdict)


def _failure(exc) -> str:
    return f"{type(exc).__name__}: {exc}"[:400]


def run(config: TrainConfig, backends=BACKENDS, seeds=(0,), *, device=None, out=None,
        progress: bool = True, name: str | None = None) -> dict:
    """Train once per backend and seed on one data set; return (and write to ``out``, merged
    into a recording of the same revision and config: :func:`merge`) the record: the config,
    its task and precision, every run's record (:func:`train`), failures, skipped backends, the
    summary rows (:func:`summary`), the curve comparison (:func:`curve_gaps`) and the
    environment (``ssd.tools.env``)."""
    device = _device(device)
    usable, skipped = usable_backends(backends)
    data = make_data(config, device) if usable else None
    runs, failures = [], []
    for seed in seeds:
        for backend in usable:
            try:
                runs.append(train(config, backend, seed=seed, device=device, data=data,
                                  progress=progress))
            except Exception as exc:  # a backend that cannot train is a result, not a crash
                failures.append(dict(backend=backend, seed=seed, error=_failure(exc)))
            _free(device)
    payload = dict(name=name, config=asdict(config), task=asdict(config.task),
                   precision=_precision_note(config.precision, device), device=device.type,
                   runs=runs, failures=failures, skipped=skipped, summary=summary(runs),
                   comparison=curve_gaps(runs), environment=environment())
    return _written(payload, out)


def _written(payload: dict, out) -> dict:
    """Write ``payload`` to ``out`` (if given), merged (:func:`merge`) into a recording there of
    the same revision and configuration; return what was written."""
    if out is None:
        return payload
    out = Path(out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    payload = merge(old, payload)
    write_json(out, payload)
    return payload


def merge(old: dict, new: dict) -> dict:
    """A new training record or step sweep merged into an old one, so that one recording can be
    made by several commands (each within a time limit): where both name the same git revision
    and the same settings (the training config, or the step sweep's settings), the new rows
    replace the old rows of the same key ((backend, seed) or (shape, backend)), the old others
    are kept, and the derived parts (summary and curve comparison, or Amdahl's rows) are
    recomputed; otherwise the new record alone."""
    training = "runs" in new
    same = "config" if training else "settings"
    as_json = lambda v: json.loads(json.dumps(v))  # noqa: E731  (tuples read back as lists)
    if (old.get("environment", {}).get("git_revision") != new["environment"].get("git_revision")
            or as_json(old.get(same)) != as_json(new[same]) or ("runs" in old) != training):
        return new
    key = (lambda r: (r["backend"], r["seed"])) if training else \
        (lambda r: (r["shape"], r["backend"]))
    rows = "runs" if training else "rows"
    fresh = {key(r) for r in new[rows] + new["failures"]}
    merged = dict(new)
    merged[rows] = [r for r in old[rows] if key(r) not in fresh] + new[rows]
    merged["failures"] = [f for f in old["failures"] if key(f) not in fresh] + new["failures"]
    if training:
        merged.update(summary=summary(merged["runs"]), comparison=curve_gaps(merged["runs"]))
    else:
        merged["amdahl"] = _amdahl(merged["rows"])
    return merged


def _precision_note(precision: str, device) -> str:
    if precision == "fp32":
        return "fp32 weights, gradients, optimizer state and compute (no autocast)"
    return (f"fp32 weights, gradients and AdamW state; forward under torch.autocast("
            f"{_device(device).type}, bfloat16)")


def summary(runs: list[dict]) -> list[dict]:
    """One row a run: backend, seed, final accuracy and held-out loss, steps and seconds to
    the target accuracy, steady-state ms a step, the first steps' ms, peak memory."""
    return [dict(backend=r["backend"], seed=r["seed"], final_accuracy=r["final_accuracy"],
                 final_eval_loss=r["final_eval_loss"], steps_to_target=r["steps_to_target"],
                 time_to_target_s=r["time_to_target_s"], ms_per_step=r["steady"]["median_ms"],
                 first_steps_ms=sum(r["first_steps_ms"]), peak_mem_mib=r["peak_mem_mib"])
            for r in runs]


def _free(device):
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the step timer


#: Layers of the timed stack: a few, since every layer is the same and the step's time grows
#: with the depth while the SSD's share does not.
STEP_LAYERS = 2
#: The chunk size the stack's SSD is called with (mamba_ssm's Mamba2 module's default).
STEP_CHUNK = 256
#: A CPU-sized stack (tests, ``--suite smoke``): 4 heads in 2 groups, two chunks and a tail.
SMOKE_STEP_SHAPES = (Shape("smoke", 2, 80, 4, 16, 8, 2),)
SMOKE_STEP_CHUNK = 32


def capture_ssd_step(stack, step):
    """Run ``step()`` once and return (args, dy): the arguments layer 0 handed its SSD,
    ``(x, dt, A, B, C, D, dt_bias)``, and the gradient that reached the SSD's output y in the
    backward, so that the SSD's forward + backward can be repeated alone on them."""
    seen = {}

    def keep_grad(grad):
        seen["dy"] = grad

    def hook(module, args, out):
        if "args" not in seen:
            seen["args"] = tuple(args)
            out.register_hook(keep_grad)

    handle = stack.mixers[0].ssd.register_forward_hook(hook)
    try:
        step()
    finally:
        handle.remove()
    if "dy" not in seen:
        raise RuntimeError("the stack's SSD output got no gradient: is the stack trainable "
                           "(requires_grad_())?")
    return seen["args"], seen["dy"]


def ssd_calls(ssd, args, dy, precision: str, device):
    """(forward, forward + backward) of ``ssd`` (an ``ssd.layer.SSDStep``) on leaves sharing
    ``args``' storage and strides (detached views: the layout the layer passes), in the step's
    precision context: zero-argument callables."""
    import torch

    leaves = [a.detach().requires_grad_(a.requires_grad) for a in args]
    wanted = [t for t in leaves if t.requires_grad]

    def forward():
        with torch.no_grad(), autocast(precision, device):
            return ssd(*leaves)

    def forward_backward():
        with autocast(precision, device):
            y = ssd(*leaves)
        return torch.autograd.grad(y, wanted, dy)

    return forward, forward_backward


def step_time(shape: Shape, backend: str, *, n_layers: int = STEP_LAYERS,
              chunk_size: int = STEP_CHUNK, precision: str = "bf16", reps: int = 10,
              warmup: int = 3, seed: int = 0, device=None, lr: float = 1e-4) -> dict:
    """Time one training step of a stack whose SSD has ``shape``'s heads, state and groups.

    The stack: ``ssd.layer.config_for_shape(shape)`` (d_model = h p / 2) with fp32 weights,
    ``n_layers`` deep, trainable; the input u (b, l, d_model) and the upstream gradient of
    the output ~ N(0, 1), fixed. A step: the forward (in ``precision``'s context), the
    backward of the upstream gradient, ``AdamW.step``, ``zero_grad``.

    Returns:
        a row: shape, backend, dims, d_model, n_layers, chunk_size, precision; step_ms (the
        median of ``reps`` steps after ``warmup``), first_step_s (the first step, compiles and
        autotuning included); ssd_fwd_ms and ssd_fb_ms (layer 0's SSD forward, and forward +
        backward, alone on the tensors of a step), ssd_ms_total = n_layers * ssd_fb_ms and
        ssd_share = ssd_ms_total / step_ms; quantiles of each; peak_mem_mib (GPU: the peak
        allocated during one step, the weights, gradients and AdamW state included); timer.
    """
    import torch

    from ..layer import Mamba2Stack, config_for_shape

    device = _device(device)
    config = config_for_shape(shape, chunk_size=chunk_size, dtype="float32")
    stack = Mamba2Stack(config, n_layers, backend, device=device, seed=seed).requires_grad_(True)
    opt = torch.optim.AdamW(stack.parameters(), lr=lr)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    u = torch.randn(shape.b, shape.l, config.d_model, device=device, generator=gen)
    grad_out = torch.randn(shape.b, shape.l, config.d_model, device=device, generator=gen)

    def step():
        with autocast(precision, device):
            out = stack(u)
        out.backward(grad_out)
        opt.step()
        opt.zero_grad(set_to_none=True)

    if backend == "mamba_ssm":  # autotune on this shape, not on an earlier one
        from .peers import retune_mamba_ssm

        retune_mamba_ssm()
    _sync(device)
    start = time.perf_counter()
    args, dy = capture_ssd_step(stack, step)  # the first step: compiles, autotunes
    _sync(device)
    first_s = time.perf_counter() - start
    ssd_fwd, ssd_fb = ssd_calls(stack.mixers[0].ssd, args, dy, precision, device)
    settings = dict(mode="eager", l2="warm", reps=reps, warmup=warmup)
    step_t = timer(step, device, **settings)
    fwd_t = timer(ssd_fwd, device, **settings)
    fb_t = timer(ssd_fb, device, **settings)
    del args, dy, ssd_fwd, ssd_fb  # they hold layer 0's activations: not part of a step's peak
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    total = n_layers * fb_t["median_ms"]
    q = lambda t: {k: t[k] for k in ("median_ms", "q20_ms", "q80_ms", "min_ms")}  # noqa: E731
    return dict(shape=shape.name, backend=backend, dims=list(shape.dims), d_model=config.d_model,
                n_layers=n_layers, chunk_size=chunk_size, precision=precision,
                step_ms=step_t["median_ms"], first_step_s=first_s,
                ssd_fwd_ms=fwd_t["median_ms"], ssd_fb_ms=fb_t["median_ms"],
                ssd_ms_total=total, ssd_share=total / step_t["median_ms"], peak_mem_mib=peak,
                step=q(step_t), ssd_fwd=q(fwd_t), ssd_fb=q(fb_t), timer=step_t["timer"],
                reps=reps)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_sweep(shapes=SUITES["models"], backends=BACKENDS, *, n_layers: int = STEP_LAYERS,
               chunk_size: int = STEP_CHUNK, chunk_sizes=None, precision: str = "bf16",
               reps: int = 10, warmup: int = 3, device=None, out=None,
               progress: bool = True) -> dict:
    """:func:`step_time` for every shape and backend (one stack at a time, built from the same
    seed: the same weights for every backend); ``chunk_sizes`` {backend: q} calls a backend's
    SSD at another chunk size. Returns (and writes to ``out``, merged into a recording of the
    same revision and settings: :func:`merge`) rows, failures, skipped,
    ``amdahl`` (``ssd.tools.endtoend.amdahl_rows``: the SSD's share of mamba_ssm's step and
    the SSD's forward + backward speedup give the predicted step speedup of cutile, beside the
    measured one), settings and the environment."""
    device = _device(device)
    chunks = dict(chunk_sizes or {})
    usable, skipped = usable_backends(backends)
    rows, failures = [], []
    tasks = [(s, b) for s in shapes for b in usable]
    for shape, backend in (_progress(tasks, "training step") if progress else tasks):
        try:
            rows.append(step_time(shape, backend, n_layers=n_layers,
                                  chunk_size=chunks.get(backend, chunk_size),
                                  precision=precision, reps=reps, warmup=warmup, device=device))
        except Exception as exc:
            failures.append(dict(shape=shape.name, backend=backend, error=_failure(exc)))
        _free(device)
    cuda = device.type == "cuda"
    settings = dict(n_layers=n_layers, chunk_size=chunk_size, chunk_sizes=chunks,
                    precision=_precision_note(precision, device), reps=reps, warmup=warmup,
                    statistic="median", mode="eager", l2="warm" if cuda else "n/a",
                    timer="CUDA events (ssd.tools.bench.time_fn)" if cuda
                    else "perf_counter (CPU)")
    payload = dict(rows=rows, failures=failures, skipped=skipped, amdahl=_amdahl(rows),
                   settings=settings, environment=environment())
    return _written(payload, out)


def _amdahl(rows) -> list[dict]:
    """Per shape: the SSD's share of mamba_ssm's step and the SSD's forward + backward speedup
    of cutile, Amdahl's predicted step speedup, and the measured one."""
    return amdahl_rows(rows, key=("shape",), total="step_ms", part="ssd_ms_total", base=BASE,
                       new=NEW)


# ----------------------------------------------------------------------------- CLI


def _fmt(v, spec):
    """``format(v, spec)``, or a dash as wide for a missing value."""
    if v is not None:
        return format(v, spec)
    width = spec.split(".")[0].rstrip("dfge%")
    return "-".rjust(int(width) if width.isdigit() else 1)


def report(payload, file=None):
    """Print a training record's summary table and curve comparison, or a step sweep's table
    with Amdahl's prediction beside the measured step speedup."""
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    if "runs" in payload:
        target = payload["config"]["target_accuracy"]
        p(f"\nbackend     seed  final acc  eval loss  steps to {target:.0%}  s to {target:.0%}"
          "  ms/step  first steps ms  peak MiB")
        for r in payload["summary"]:
            p(f"{r['backend']:10s} {r['seed']:5d}  {r['final_accuracy']:9.3f}  "
              f"{r['final_eval_loss']:9.4f}  {_fmt(r['steps_to_target'], '12d')}  "
              f"{_fmt(r['time_to_target_s'], '8.2f')}  {_fmt(r['ms_per_step'], '7.2f')}  "
              f"{r['first_steps_ms']:14.1f}  {_fmt(r['peak_mem_mib'], '8.0f')}")
        cmp = payload["comparison"]
        for g in cmp["between_backends"]:
            p(f"seed {g['seed']}: {' vs '.join(g['backends'])}: held-out loss differs by "
              f"{g['mean_abs']:.2e} on average (max {g['max_abs']:.2e})")
        for g in cmp["between_seeds"]:
            p(f"{g['backend']}: seeds {g['seeds'][0]} vs {g['seeds'][1]}: {g['mean_abs']:.2e} "
              f"on average (max {g['max_abs']:.2e})")
        if cmp["within_noise"] is not None:
            p(f"backends within run-to-run noise: {cmp['within_noise']}")
    else:
        p("\nshape          backend     step ms  ssd fwd ms  ssd fwd+bwd ms  ssd share  peak MiB")
        for r in payload["rows"]:
            p(f"{r['shape']:14s} {r['backend']:10s} {r['step_ms']:8.2f} {r['ssd_fwd_ms']:11.3f} "
              f"{r['ssd_fb_ms']:15.3f}  {r['ssd_share']:8.1%}  {_fmt(r['peak_mem_mib'], '8.0f')}")
        for a in payload["amdahl"]:
            p(f"{a['shape']}: {a['new']} SSD fwd+bwd {a['kernel_speedup']:.2f}x {a['base']}'s at "
              f"share {a['share']:.1%}: Amdahl predicts {a['predicted']:.3f}x, measured "
              f"{a['measured']:.3f}x")
    for f in payload["failures"]:
        p("FAILED", f)
    for name, why in payload["skipped"].items():
        p("SKIPPED", name, why)


def _override(config: TrainConfig, specs) -> TrainConfig:
    """``name=value`` settings of TrainConfig fields, parsed by the field's default's type."""
    kinds = {f.name: type(getattr(config, f.name)) for f in fields(config)}
    changes = {}
    for spec in specs:
        name, _, text = spec.partition("=")
        if name not in kinds or not text:
            raise ValueError(f"--set {spec!r}: expected NAME=VALUE with NAME one of "
                             f"{sorted(kinds)}")
        kind = kinds[name]
        if kind is bool:
            changes[name] = text.lower() in ("1", "true", "yes")
        elif kind is tuple:
            changes[name] = tuple(float(v) for v in text.split(","))
        else:
            changes[name] = kind(text)
    return replace(config, **changes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.tools.train",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=["mqar", "step"], default="mqar",
                        help="mqar: train on the recall task (default); step: time a training "
                             "step at the models sizes")
    parser.add_argument("--backend", action="append",
                        help="SSD backend, repeatable (default: cutile and mamba_ssm)")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--out", help="output JSON (default results/<gpu>/training.json, or "
                                      "training_step.json for step)")
    parser.add_argument("--no-progress", action="store_true")
    mq = parser.add_argument_group("mqar")
    mq.add_argument("--preset", choices=list(TRAIN_PRESETS), default="small")
    mq.add_argument("--seed", type=int, action="append",
                    help="repeatable: several seeds measure run-to-run noise (default 0)")
    mq.add_argument("--steps", type=int)
    mq.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="any TrainConfig field, e.g. --set num_pairs=32 --set lr=1e-3")
    st = parser.add_argument_group("step")
    st.add_argument("--suite", choices=["models", "smoke"], default="models")
    st.add_argument("--shapes", help="comma-separated shape names of the suite")
    st.add_argument("--layers", type=int, default=STEP_LAYERS)
    st.add_argument("--chunk-size", action="append", default=[], metavar="[BACKEND=]Q",
                    help=f"the SSD's chunk size (default {STEP_CHUNK}); BACKEND=Q for one "
                         "backend")
    st.add_argument("--precision", choices=PRECISIONS, default="bf16")
    st.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = _device(args.device)
    backends = tuple(args.backend or BACKENDS)
    progress = not args.no_progress
    folder = RESULTS / gpu_slug(environment())
    if args.part == "mqar":
        config = TRAIN_PRESETS[args.preset]
        try:
            config = _override(config, args.set + ([f"steps={args.steps}"] if args.steps else []))
        except ValueError as exc:
            parser.error(str(exc))
        out = Path(args.out) if args.out else folder / "training.json"
        payload = run(config, backends, tuple(args.seed or (0,)), device=device, out=out,
                      progress=progress, name=args.preset)
    else:
        chunk, chunks = STEP_CHUNK, {}
        for spec in args.chunk_size:
            backend, _, q = spec.rpartition("=")
            if not q.isdigit():
                parser.error(f"--chunk-size {spec!r}: expected Q or BACKEND=Q, e.g. cutile=128")
            if backend:
                chunks[backend] = int(q)
            else:
                chunk = int(q)
        shapes = list(SMOKE_STEP_SHAPES) if args.suite == "smoke" else SUITES["models"]
        if args.suite == "smoke" and not args.chunk_size:
            chunk = SMOKE_STEP_CHUNK
        if args.shapes:
            names = args.shapes.split(",")
            if unknown := set(names) - {s.name for s in shapes}:
                parser.error(f"--shapes: unknown {sorted(unknown)}")
            shapes = [s for s in shapes if s.name in names]
        out = Path(args.out) if args.out else folder / "training_step.json"
        payload = step_sweep(shapes, backends, n_layers=args.layers, chunk_size=chunk,
                             chunk_sizes=chunks, precision=args.precision, reps=args.reps,
                             device=device, out=out, progress=progress)
    report(payload)
    print(f"[train] wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
