"""A serving scenario: packed prefill of many prompts, then a decode loop, per SSD backend.

``python -m ssd.tools.serving`` (library + command line).

A serving engine takes N requests (default 32) whose prompts have different lengths (drawn
with a fixed seed from 128 to 4,096 tokens), runs one packed prefill over all of them (the
prompts laid along one row, ``cu_seqlens`` marking where each starts), hands every prompt's
conv and SSM state to the decode loop, and then generates G tokens for all N at once, one step
at a time (default 128). This module runs that on ``ssd.layer.Mamba2Stack`` (a few layers of a
preset's size, random weights from the stack's seeded initialisation) with one SSD backend at a
time and measures:

1. **Time to first token**: the packed prefill's latency (``Mamba2Stack.prefill``). By default
   it is launched eagerly, as an engine runs a prefill whose packed length it has not seen
   before (``--prefill-mode graph`` replays a CUDA graph instead).
2. **Decode tokens/s**: the N x G generated tokens over the summed time of the G steps
   (``Mamba2Stack.step``), each step captured once in a CUDA graph and replayed, as engines run
   their decode step (eager where capture fails or on the CPU; the record says which and why).
   Each step is timed between two CUDA events; the steps run back to back, as in an engine,
   without flushing L2.
3. **The SSD's share** of each: the SSD call of layer 0 timed alone on the very tensors the
   prefill passed it (captured with a forward hook, as :mod:`ssd.tools.endtoend` does for the
   forward) and the decode step's SSD (its ``selective_state_update``) likewise, on a copy of the
   state, with L2 flushed before each call (in the loop, the other layers' weights and states
   pass through L2 between two steps of one layer); share = layers x SSD time / total.
4. **Amdahl beside the measurement**: between two backends (mamba_ssm as the base, cutile as
   the new), the speedup Amdahl's law predicts from the base's share and the SSD speedup, next to
   the measured speedup of the prefill and of a decode step (:func:`ssd.tools.endtoend.amdahl_rows`).

Token i + 1's input is token i's output (the stack's hidden state; there is no language-model
head): the generated outputs are then exactly what running each request alone through the
stack's forward gives at those positions, which the CPU tests check token for token. On a GPU a
backend other than torch is first compared with the torch backend on the first few requests (the
first token and the first step), as :func:`ssd.tools.endtoend.gate` compares the forward.

Timing conventions are :mod:`ssd.tools.endtoend`'s (:func:`ssd.tools.endtoend.timer`: CUDA
events, median and 20/80 % quantiles; perf_counter on the CPU, with the same keys). The record
goes to ``results/<gpu>/serving_scenario.json`` with the environment (:mod:`ssd.tools.env`);
``results/<gpu>/serving.json`` is the benchmark's serving suite, the SSD forward alone.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from .endtoend import (GATE_TOL, SHARE_BACKENDS, GateFailed, _device, _failure, _quantiles,
                       _rel_err, _sync, amdahl_rows, parse_chunk_sizes, timer)
from .env import RESULTS, environment, gpu_slug, write_json

#: Requests whose first token and first step are compared with the torch backend's.
GATE_REQUESTS = 4
#: Stack depth of the scenario: a few layers of the preset's size (every layer costs the same,
#: so the shares and speedups hold for the published depth).
DEFAULT_LAYERS = 8
DEFAULT_PRESET = "2.7b"


@dataclass(frozen=True)
class Scenario:
    """The requests of one serving run.

    Args:
        requests: N, the number of requests (prompts), all generated together.
        prompt_min, prompt_max: the prompts' lengths are drawn uniformly from this range
            (inclusive) with ``seed``.
        generate: G, the tokens generated per request (decode steps).
        seed: seeds the prompt lengths and the prompts' embeddings.
    """

    requests: int = 32
    prompt_min: int = 128
    prompt_max: int = 4096
    generate: int = 128
    seed: int = 0

    def __post_init__(self):
        for name in ("requests", "prompt_min", "prompt_max", "generate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.prompt_max < self.prompt_min:
            raise ValueError(f"prompt_max: expected >= prompt_min = {self.prompt_min}, got "
                             f"{self.prompt_max}")

    def prompt_lengths(self) -> list:
        """The N prompt lengths, the same on every machine (numpy's Generator)."""
        rng = np.random.default_rng(self.seed)
        return [int(v) for v in rng.integers(self.prompt_min, self.prompt_max + 1,
                                             self.requests)]


def packed_prompts(config, scenario: Scenario, device):
    """The prompts packed along one row: (u (1, T, d_model) in the model dtype, cu_seqlens
    (N + 1,) int32), T the sum of the prompt lengths; u ~ N(0, 1), seeded."""
    import torch

    lengths = scenario.prompt_lengths()
    gen = torch.Generator(device=device).manual_seed(scenario.seed + 1)
    u = torch.randn(1, sum(lengths), config.d_model, generator=gen, device=device,
                    dtype=torch.float32).to(config.torch_dtype)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    return u, cu


def first_tokens(hidden, cu_seqlens):
    """The prefill's output at each prompt's last token: hidden (1, T, d) -> (N, d)."""
    return hidden[0, cu_seqlens[1:].long() - 1]


# ----------------------------------------------------------------------------- capture


def capture_prefill_ssd(stack, u, cu_seqlens):
    """Run ``stack.prefill(u, cu_seqlens)`` once; return (hidden, caches, (args, kwargs) of
    layer 0's SSD call): the tensors and the packing keywords (seq_idx, cu_seqlens, the states
    to return) it received, so that the call can be repeated alone."""
    seen = []

    def hook(module, args, kwargs, out):
        if not seen:
            seen.append((tuple(args), dict(kwargs)))

    handle = stack.mixers[0].ssd.register_forward_hook(hook, with_kwargs=True)
    try:
        hidden, caches = stack.prefill(u, cu_seqlens)
    finally:
        handle.remove()
    return hidden, caches, seen[0]


@contextlib.contextmanager
def recording_step(ssd_step):
    """Within the block, every decode step of the ``SSDStep`` ``ssd_step`` appends its
    arguments ((state, x, dt, A, B, C), keywords) to the list it yields, then runs as before."""
    calls, step_fn = [], ssd_step.step_fn

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return step_fn(*args, **kwargs)

    ssd_step.step_fn = record
    try:
        yield calls
    finally:
        ssd_step.step_fn = step_fn


def clone_caches(caches):
    from ..layer import InferenceCache

    return [InferenceCache(c.conv_state.clone(), c.ssm_state.clone()) for c in caches]


def _restore(work, caches, buf, first):
    for w, c in zip(work, caches):
        w.conv_state.copy_(c.conv_state)
        w.ssm_state.copy_(c.ssm_state)
    buf.copy_(first[:, None])


# ----------------------------------------------------------------------------- timing


def timed(fn, device, mode, **settings):
    """:func:`ssd.tools.endtoend.timer` in ``mode``, falling back to eager where a CUDA graph
    cannot be captured. Returns (stats, the mode used, why it fell back or None)."""
    if _device(device).type != "cuda":
        return timer(fn, device, mode="eager", **settings), "eager", None
    try:
        return timer(fn, device, mode=mode, **settings), mode, None
    except Exception as exc:  # capture failed: a result to record, then time it eagerly
        if mode != "graph":
            raise
        return (timer(fn, device, mode="eager", **settings), "eager",
                f"CUDA graph capture failed: {_failure(exc)}")


def decode_loop(stack, caches, first, steps: int, device, mode="graph"):
    """Generate ``steps`` tokens for every sequence from the prefill's state: each step's input
    is the previous step's output, the first step's the prefill's first token.

    Args:
        stack: a ``Mamba2Stack``.
        caches: one ``InferenceCache`` a layer (from the prefill); left unchanged (the loop
            runs on copies).
        first: (N, d_model) the prefill's output at each prompt's last token.
        steps: G.
        mode: "graph" (one step captured in a CUDA graph, replayed G times) or "eager".
    Returns:
        (outputs (N, G, d_model), per-step ms (G floats), the mode used, why it fell back or
        None). On a CUDA device each step is timed between two CUDA events, elsewhere with
        perf_counter.
    """
    import torch

    device = _device(device)
    cuda = device.type == "cuda"
    work, buf = clone_caches(caches), first[:, None].clone()  # (N, 1, d): the step's input

    def step():
        buf.copy_(stack.step(buf, work))

    call, why = step, None
    if mode == "graph" and not cuda:
        mode, why = "eager", "no CUDA device"
    if mode == "graph":
        from .. import launch
        from .bench import graph_replay

        launch.wait_tuned()
        try:
            call = graph_replay(step)
        except Exception as exc:
            mode, why = "eager", f"CUDA graph capture failed: {_failure(exc)}"
        _restore(work, caches, buf, first)  # the warm-up advanced the state
    outputs = torch.empty(first.shape[0], steps, first.shape[1], device=device, dtype=first.dtype)
    if cuda:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
        for k in range(steps):
            starts[k].record()
            call()
            ends[k].record()
            outputs[:, k] = buf[:, 0]
        torch.cuda.synchronize(device)
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        ms = []
        for k in range(steps):
            start = time.perf_counter()
            call()
            ms.append((time.perf_counter() - start) * 1e3)
            outputs[:, k] = buf[:, 0]
    return outputs, ms, mode, why


def _step_stats(ms) -> dict:
    return dict(median_ms=float(np.median(ms)), q20_ms=float(np.quantile(ms, 0.2)),
                q80_ms=float(np.quantile(ms, 0.8)), min_ms=float(np.min(ms)))


# ----------------------------------------------------------------------------- one backend


def gate(stack, u, cu_seqlens, first, step0, backend, chunk_size, requests=GATE_REQUESTS):
    """Relative error of the first token and the first step's output of the first ``requests``
    requests against the torch backend on the same stack (their prompts alone, packed);
    raises :class:`ssd.tools.endtoend.GateFailed` above ``GATE_TOL[dtype]``."""
    k = min(requests, cu_seqlens.numel() - 1)
    sub_cu = cu_seqlens[:k + 1]
    stack.set_backend("torch")
    try:
        hidden, caches = stack.prefill(u[:, :int(sub_cu[-1])], sub_cu)
        ref_first = first_tokens(hidden, sub_cu)
        ref_step = stack.step(ref_first[:, None], caches)[:, 0]
    finally:
        stack.set_backend(backend, chunk_size)
    err = max(_rel_err(first[:k], ref_first), _rel_err(step0[:k], ref_step))
    tol = GATE_TOL[stack.config.dtype]
    if not err <= tol:
        raise GateFailed(f"{backend}: the first token and step differ from the torch backend's "
                         f"by rel err {err:.3e} > {tol:.0e}")
    return err


def serve(stack, scenario: Scenario, backend: str, *, device=None, chunk_size=None,
          prefill_mode="eager", decode_mode="graph", l2="flushed", reps=10, warmup=3,
          check=True):
    """Run the scenario on ``stack`` with SSD backend ``backend`` and time it.

    Args:
        stack: a ``Mamba2Stack`` on ``device`` (its backend is set to ``backend``).
        scenario: the requests (:class:`Scenario`).
        chunk_size: the SSD's chunk size (default the stack config's).
        prefill_mode: "eager" or "graph", for the prefill and its SSD call alone.
        decode_mode: "graph" or "eager", for the decode step and its SSD call alone.
        l2: "flushed" or "warm": before each prefill and each SSD call timed alone (the decode
            loop runs back to back).
        reps, warmup: of the prefill and of the SSD calls timed alone.
        check: on a GPU, compare a backend other than torch with the torch backend first
            (:func:`gate`).
    Returns:
        (row, outputs): row, the measurements (module docstring); outputs, a dict with the
        generated tokens: first (N, d_model) and steps (N, G, d_model).
    """
    import torch

    device = _device(device)
    cuda = device.type == "cuda"
    chunk_size = chunk_size or stack.config.chunk_size
    stack.set_backend(backend, chunk_size)
    n_layers = len(stack.mixers)
    u, cu = packed_prompts(stack.config, scenario, device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    if backend == "mamba_ssm":  # autotune on this scenario, not on the one before
        from .peers import retune_mamba_ssm

        retune_mamba_ssm()
    with torch.no_grad():
        hidden, caches, (ssd_args, ssd_kwargs) = capture_prefill_ssd(stack, u, cu)
        first = first_tokens(hidden, cu)
        del hidden
        with recording_step(stack.mixers[0].ssd) as calls:  # one eager step: layer 0's call
            stack.step(first[:, None], clone_caches(caches))
        (state, *step_args), step_kwargs = calls[0]
        steps, ms, decode_used, decode_why = decode_loop(stack, caches, first, scenario.generate,
                                                         device, decode_mode)
        if not (torch.isfinite(first).all() and torch.isfinite(steps).all()):
            raise GateFailed(f"{backend}: the generated outputs are not finite")
        graph_diff = None
        if decode_used == "graph":  # the replayed graph generates what eager steps do
            eager, *_ = decode_loop(stack, caches, first, scenario.generate, device, "eager")
            graph_diff = float((eager.double() - steps.double()).abs().max())
        err = None
        if check and cuda and backend != "torch":
            err = gate(stack, u, cu, first, steps[:, 0], backend, chunk_size)
        t = dict(l2=l2, reps=reps, warmup=warmup)
        ttft, prefill_used, prefill_why = timed(lambda: stack.prefill(u, cu), device,
                                                prefill_mode, **t)
        ssd0 = stack.mixers[0].ssd
        ssd_prefill, _, ssd_prefill_why = timed(lambda: ssd0(*ssd_args, **ssd_kwargs), device,
                                                prefill_used, **t)
        state = state.clone()  # timed alone, the step advances a copy
        ssd_step, _, ssd_step_why = timed(lambda: ssd0.step_fn(state, *step_args, **step_kwargs),
                                          device, decode_used, **t)
    step = _step_stats(ms)
    decode_s = sum(ms) * 1e-3
    tokens = scenario.requests * scenario.generate
    row = dict(backend=backend, chunk_size=chunk_size, n_layers=n_layers,
               prompt_tokens=int(cu[-1]), ttft_ms=ttft["median_ms"], ttft=_quantiles(ttft),
               prefill_mode=prefill_used,
               ssd_prefill_ms_per_layer=ssd_prefill["median_ms"],
               ssd_prefill_ms_total=n_layers * ssd_prefill["median_ms"],
               ssd_prefill_share=n_layers * ssd_prefill["median_ms"] / ttft["median_ms"],
               step_ms=step["median_ms"], step=step, decode_ms_total=sum(ms),
               decode_tokens_per_s=tokens / decode_s, decode_mode=decode_used,
               ssd_step_ms_per_layer=ssd_step["median_ms"],
               ssd_step_ms_total=n_layers * ssd_step["median_ms"],
               ssd_step_share=n_layers * ssd_step["median_ms"] / step["median_ms"],
               gate_rel_err=err, timer=ttft["timer"])
    if graph_diff is not None:
        row["graph_vs_eager_max_abs"] = graph_diff
    # an SSD call alone that fell back to eager makes its share mix two modes: say so
    fallbacks = {k: v for k, v in (("prefill", prefill_why), ("decode", decode_why),
                                   ("ssd_prefill", ssd_prefill_why), ("ssd_step", ssd_step_why))
                 if v}
    if fallbacks:
        row["eager_because"] = fallbacks
    if cuda:
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    _sync(device)
    return row, dict(first=first, steps=steps)


# ----------------------------------------------------------------------------- the scenario


def run(config, n_layers: int = DEFAULT_LAYERS, scenario: Scenario = Scenario(),
        backends=SHARE_BACKENDS, *, label=None, device=None, chunk_sizes=None, seed=0,
        prefill_mode="eager", decode_mode="graph", l2="flushed", reps=10, warmup=3, out=None,
        outputs=None) -> dict:
    """The serving scenario for every backend on one stack; the record.

    Args:
        config: a ``Mamba2Config`` (e.g. ``ssd.layer.preset("2.7b")``).
        n_layers: the stack's depth.
        scenario: the requests.
        backends: SSD backends; one that cannot run here is recorded under ``skipped``, one that
            fails under ``failures``.
        label: the config's name in the record (default: d<d_model>-n<d_state>).
        device: default "cuda" when available, else "cpu".
        chunk_sizes: {backend: chunk size} for backends called at another chunk size than the
            config's.
        seed: the stack's weights (one set for every backend).
        prefill_mode, decode_mode, l2, reps, warmup: as :func:`serve`.
        out: path of the JSON to write (None writes nothing).
        outputs: a dict to receive, per backend, the generated tokens (:func:`serve`), and the
            packed prompts under "prompts" and "cu_seqlens" (left out of the record).
    Returns:
        dict with scenario (and the prompt lengths), model, rows (one per backend), failures,
        skipped, amdahl (prefill and decode: predicted vs measured speedup of NEW over BASE),
        settings and environment.
    """
    import torch

    from ..layer import BackendUnavailable, Mamba2Stack, step_function

    device = _device(device)
    chunks = dict(chunk_sizes or {})
    if unknown := set(chunks) - set(backends):
        raise ValueError(f"chunk_sizes names backends that are not run: {sorted(unknown)}")
    usable, skipped = [], {}
    for b in backends:
        try:
            step_function(b)  # the forward's and the step's availability
            usable.append(b)
        except BackendUnavailable as exc:
            skipped[b] = str(exc)
    label = label or f"d{config.d_model}-n{config.d_state}"
    rows, failures = [], []
    if usable:  # one set of weights for every backend
        stack = Mamba2Stack(config, n_layers, usable[0], device=device, seed=seed)
    for backend in usable:
        try:
            row, generated = serve(stack, scenario, backend, device=device,
                                   chunk_size=chunks.get(backend), prefill_mode=prefill_mode,
                                   decode_mode=decode_mode, l2=l2, reps=reps, warmup=warmup)
            rows.append(dict(config=label, **row))
            if outputs is not None:
                outputs[backend] = generated
        except Exception as exc:  # a backend that fails is a result, not a crash
            failures.append(dict(config=label, backend=backend, error=_failure(exc)))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if outputs is not None:
        outputs["prompts"], outputs["cu_seqlens"] = packed_prompts(config, scenario, device)
    lengths = scenario.prompt_lengths()
    cuda = device.type == "cuda"
    payload = dict(
        scenario=dict(asdict(scenario), prompt_lengths=lengths, prompt_tokens=sum(lengths)),
        model=dict(config=label, n_layers=n_layers, d_model=config.d_model,
                   dims=list(config.ssd_dims(1, sum(lengths))), dtype=config.dtype,
                   weights_seed=seed),
        rows=rows, failures=failures, skipped=skipped,
        amdahl=amdahl_of(rows),
        settings=dict(prefill_mode=prefill_mode if cuda else "eager",
                      decode_mode=decode_mode if cuda else "eager",
                      l2=l2 if cuda else "n/a", reps=reps, warmup=warmup, statistic="median",
                      **(dict(chunk_sizes=chunks) if chunks else {}),
                      timer="CUDA events" if cuda else "perf_counter (CPU)",
                      decode_timing="each of the G steps between two events, back to back",
                      gate_requests=GATE_REQUESTS),
        environment=environment())
    if out is not None:
        write_json(out, payload)
    return payload


def amdahl_of(rows) -> dict:
    """{"prefill": [...], "decode": [...]}: for each pair of rows of one config with backends
    BASE and NEW (:data:`ssd.tools.endtoend.BASE`, ``NEW``), the speedup Amdahl's law predicts
    from the base's SSD share and the SSD speedup beside the measured one, of the time to first
    token and of a decode step (:func:`ssd.tools.endtoend.amdahl_rows`)."""
    return dict(prefill=amdahl_rows(rows, key=("config",), total="ttft_ms",
                                    part="ssd_prefill_ms_total"),
                decode=amdahl_rows(rows, key=("config",), total="step_ms",
                                   part="ssd_step_ms_total"))


def report(payload, file=None):
    """Print the table of one record and Amdahl's prediction beside the measured speedups."""
    p = lambda *a: print(*a, file=file or sys.stdout)  # noqa: E731
    sc, model = payload["scenario"], payload["model"]
    p(f"\n{model['config']}, {model['n_layers']} layers, {model['dtype']}: {sc['requests']} "
      f"requests, prompts {min(sc['prompt_lengths'])}..{max(sc['prompt_lengths'])} tokens "
      f"({sc['prompt_tokens']} in all), {sc['generate']} generated each")
    p("backend     TTFT ms  (mode)  SSD share   step ms  (mode)  tokens/s   SSD share")
    for r in payload["rows"]:
        p(f"{r['backend']:10s} {r['ttft_ms']:8.2f} ({r['prefill_mode']:5s})  "
          f"{r['ssd_prefill_share']:6.1%}   {r['step_ms']:8.3f} ({r['decode_mode']:5s}) "
          f"{r['decode_tokens_per_s']:9.0f}   {r['ssd_step_share']:6.1%}")
        for part, why in r.get("eager_because", {}).items():
            p(f"  {part} eager: {why}")
    for part, rows in payload["amdahl"].items():
        for a in rows:
            p(f"{part}: {a['new']} SSD {a['kernel_speedup']:.2f}x {a['base']}'s at share "
              f"{a['share']:.1%}: Amdahl predicts {a['predicted']:.3f}x, measured "
              f"{a['measured']:.3f}x (bound {a['max_possible']:.2f}x)")
    for f in payload["failures"]:
        p("FAILED", f)
    for name, why in payload["skipped"].items():
        p("SKIPPED", name, why)


def main(argv=None) -> int:
    from ..layer import PRESETS, preset

    parser = argparse.ArgumentParser(prog="python -m ssd.tools.serving",
                                     description=__doc__.splitlines()[0])
    defaults = Scenario()
    parser.add_argument("--preset", choices=list(PRESETS), default=DEFAULT_PRESET,
                        help="the layer's sizes (ssd.layer.PRESETS)")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS)
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--prompt-min", type=int, default=defaults.prompt_min)
    parser.add_argument("--prompt-max", type=int, default=defaults.prompt_max)
    parser.add_argument("--generate", type=int, default=defaults.generate)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="prompt lengths and inputs")
    parser.add_argument("--backend", action="append",
                        help="cutile, mamba_ssm, torch (repeatable; default cutile and mamba_ssm)")
    parser.add_argument("--prefill-mode", choices=["eager", "graph"], default="eager")
    parser.add_argument("--decode-mode", choices=["graph", "eager"], default="graph")
    parser.add_argument("--l2", choices=["flushed", "warm"], default="flushed")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chunk-size", action="append", metavar="BACKEND=Q", default=[],
                        help="call BACKEND's SSD at chunk size Q instead of the layer's 256")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="default bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--device", help="default: cuda when available, else cpu")
    parser.add_argument("--out", help="output JSON (default results/<gpu>/serving_scenario.json)")
    args = parser.parse_args(argv)
    chunk_sizes = parse_chunk_sizes(parser, args.chunk_size)
    try:
        scenario = Scenario(args.requests, args.prompt_min, args.prompt_max, args.generate,
                            args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    device = _device(args.device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    out = args.out or RESULTS / gpu_slug(environment()) / "serving_scenario.json"
    payload = run(preset(args.preset, dtype=dtype), args.layers, scenario,
                  tuple(args.backend or SHARE_BACKENDS), label=args.preset, device=device,
                  chunk_sizes=chunk_sizes, prefill_mode=args.prefill_mode,
                  decode_mode=args.decode_mode, l2=args.l2, reps=args.reps, out=out)
    report(payload)
    print(f"[serving] wrote {out}")
    return 0 if payload["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

