"""GPU tests of generation in the Mamba-2 layer (``pytest -m gpu``; skipped without a GPU).

A prefill of prompts (a batch, or prompts of different lengths packed with cu_seqlens) then a
few decode steps from each prompt's handed-over state, with the cuTile SSD (its varlen states and
``ssd.selective_state_update``) and the cuTile conv and norm, in bf16 and fp32, compared
sequence by sequence with:

1. the float64 layer (the same weights, upcast; torch backend and kernels) running each whole
   sequence through the forward: the end-to-end truth. Allowed: twice the error of the same
   generation with the torch backend and kernels in the same dtype (the dtype's own roundings
   at in_proj, conv, y, norm and out_proj, which both paths make), plus the SSD kernels'
   tolerance (ssd.validate.TOL) and one unit roundoff u for the conv and norm kernels' roundings
   (as tests/test_mamba2.py and tests/test_gpu_layer_kernels.py hold the forward).
2. the same generation with the torch backend and kernels in the same dtype: the wiring of the
   kernels into prefill and step. Allowed: the layer's backend tolerance (tests/test_mamba2.py's
   GPU_TOL, bf16 3e-2, fp32 1e-4: the SSD kernels' error through the norm and out_proj) plus
   the cuTile conv and norm against PyTorch's (tests/test_gpu_layer_kernels.py's MIXER_TOL,
   4u in bf16, 1e-5 in fp32).
3. the caches: the conv state is in_proj's output, the same on both paths (equal bits); the
   SSM state after the prefill and after the steps against the torch path's, within (2).

The outputs and states are made by the layer, so no buffer can be poisoned here: the kernels'
own tests (tests/test_gpu_varlen.py, tests/test_gpu_decode.py, tests/test_gpu_layer_kernels.py)
poison theirs; a state the layer failed to hand over shows as an error of order 1 in (1).
Fresh weights and tokens each run (SSD_TEST_SEED replays one). Rows go to
results/<gpu>/gpu_mixer_tests.json (record="mixer").
"""
import math
import os
import zlib
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd.layer import (PRESETS, BackendUnavailable, Mamba2Config, Mamba2Mixer,  # noqa: E402
                       Mamba2Stack)
from ssd.validate import TOL, UNIT_ROUNDOFF  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = ("bfloat16", "float32")
#: (2): the layer's backend tolerance plus the cuTile conv and norm's against PyTorch's.
VS_TORCH = {"bfloat16": 3e-2 + 4 * 2.0**-8, "float32": 1e-4 + 1e-5}
#: mamba_ssm's SSD in fp32 runs its dots in TF32 (tests/test_mamba2.py's PEER_TOL).
PEER_VS_TORCH = {**VS_TORCH, "float32": 5e-3}
RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))

# name: (config, prompts, steps). prompts: a list of lengths, packed with cu_seqlens; or
# (b, l), a batch. Lengths below d_conv - 1, of one chunk, crossing chunk borders, longer than
# the 130m's chunk of 256 and not a multiple of it.
CASES = {
    "packed-g2-q64": (Mamba2Config(d_model=256, d_state=64, ngroups=2, chunk_size=64),
                      [1, 2, 64, 100, 257], 6),
    "packed-130m": (PRESETS["130m"], [5, 256, 700], 4),
    "batch-130m": (PRESETS["130m"], (2, 300), 4),
}


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


def rel_err(out, want) -> float:
    out, want = (t.detach().double() for t in (out, want))
    if not torch.isfinite(out).all():
        return math.inf
    return float(torch.linalg.norm(out - want) / torch.linalg.norm(want))


def sequences(config, prompts, steps, seed):
    """(each whole sequence (L_i + steps, d_model) in config.dtype on the GPU, the lengths)."""
    lengths = list(prompts) if isinstance(prompts, list) else [prompts[1]] * prompts[0]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seqs = [torch.randn(n + steps, config.d_model, generator=gen, device="cuda")
            .to(config.torch_dtype) for n in lengths]
    return seqs, lengths


def generate(model, seqs, lengths, packed, ssm_dtype=None):
    """Prefill each prompt (packed along one row, or as a batch) then step every sequence to its
    end. Returns (the outputs, all sequences' rows concatenated, (sum L_i + steps, d_model);
    the SSM state after the prefill (a copy); the cache after the steps)."""
    steps = seqs[0].shape[0] - lengths[0]
    prompts = [s[:n] for s, n in zip(seqs, lengths)]
    if packed:
        cu = torch.tensor([0, *np.cumsum(lengths)], device="cuda", dtype=torch.int32)
        out, cache = model.prefill(torch.cat(prompts)[None], cu, ssm_dtype=ssm_dtype)
        heads = list(out[0].split(lengths))
    else:
        out, cache = model.prefill(torch.stack(prompts), ssm_dtype=ssm_dtype)
        heads = list(out)
    first = [c.ssm_state.clone() for c in (cache if isinstance(cache, list) else [cache])]
    rest = torch.stack([s[n:] for s, n in zip(seqs, lengths)])  # (S, steps, d_model)
    tail = torch.cat([model.step(rest[:, t:t + 1], cache) for t in range(steps)], dim=1)
    return torch.cat([torch.cat([h, t]) for h, t in zip(heads, tail)]), first, cache


def float64_of(model, config, seed, cls=Mamba2Mixer, **kw):
    m64 = cls(replace(config, dtype="float64"), backend="torch", device="cuda", seed=seed, **kw)
    m64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    return m64


def whole(m64, seqs):
    """Each whole sequence through the float64 forward, concatenated."""
    return torch.cat([m64(s.double()[None])[0] for s in seqs])


def record(gpu_record, test, case, config, dtype, seed, **fields):
    gpu_record.append(dict(record="mixer", test=test, shape=case, dtype=dtype, seed=seed,
                           chunk_size=config.chunk_size,
                           dims=[config.nheads, config.headdim, config.d_state, config.ngroups],
                           **fields))


def assert_all(failures, case, dtype, seed):
    assert not failures, (f"{case} {dtype} [seed {seed}; SSD_TEST_SEED={RUN_SEED} replays the "
                          "run]: " + "; ".join(failures))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_cutile_generation_matches_float64_and_torch(case, dtype, gpu_record):
    config, prompts, steps = CASES[case]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"generation/{case}/{dtype}")
    packed = isinstance(prompts, list)
    try:
        mixer = Mamba2Mixer(config, "cutile", kernels="cutile", device="cuda", seed=seed)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    seqs, lengths = sequences(config, prompts, steps, seed)
    got, got_first, got_cache = generate(mixer, seqs, lengths, packed)
    mixer.set_backend("torch").set_kernels("torch")
    base, base_first, base_cache = generate(mixer, seqs, lengths, packed)
    want = whole(float64_of(mixer, config, seed), seqs)

    err64, base64 = rel_err(got, want), rel_err(base, want)
    allowed64 = 2 * base64 + TOL[dtype] + UNIT_ROUNDOFF[dtype]
    checks = {  # name: (rel err, tolerance)
        "outputs-vs-float64": (err64, allowed64),
        "outputs-vs-torch": (rel_err(got, base), VS_TORCH[dtype]),
        "ssm_state-prefill-vs-torch": (rel_err(got_first[0], base_first[0]), VS_TORCH[dtype]),
        "ssm_state-steps-vs-torch": (rel_err(got_cache.ssm_state, base_cache.ssm_state),
                                     VS_TORCH[dtype]),
    }
    failures = []
    for name, (err, tol) in checks.items():
        record(gpu_record, f"generation-cutile-{name}", case, config, dtype, seed, rel_err=err,
               tol=tol, stage="generation", torch_rel_err=base64, packed=packed)
        print(f"{case} {dtype} {name}: rel err {err:.2e} (tol {tol:.1e})")
        if not err <= tol:
            failures.append(f"{name}: rel err {err:.3e} > {tol:.1e}")
    if not torch.equal(got_cache.conv_state, base_cache.conv_state):
        failures.append("conv_state: differs from the torch path's (both are in_proj's output)")
    assert_all(failures, case, dtype, seed)


def test_gpu_cutile_generation_with_a_bf16_state(gpu_record):
    """The SSM state cached in bf16 (as mamba_ssm caches it in a bf16 model): the cuTile step
    rounds the state each token as the torch step does; against the torch path with the same
    state dtype, within (2)."""
    config, prompts, steps = CASES["packed-g2-q64"]
    config = replace(config, dtype="bfloat16")
    seed = seed_for("generation/bf16-state")
    try:
        mixer = Mamba2Mixer(config, "cutile", kernels="cutile", device="cuda", seed=seed)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    seqs, lengths = sequences(config, prompts, steps, seed)
    got, _, cache = generate(mixer, seqs, lengths, True, ssm_dtype=torch.bfloat16)
    assert cache.ssm_state.dtype == torch.bfloat16
    mixer.set_backend("torch").set_kernels("torch")
    base, _, _ = generate(mixer, seqs, lengths, True, ssm_dtype=torch.bfloat16)
    err, tol = rel_err(got, base), VS_TORCH["bfloat16"]
    record(gpu_record, "generation-cutile-bf16-state-vs-torch", "packed-g2-q64", config,
           "bfloat16", seed, rel_err=err, tol=tol, stage="generation")
    print(f"bf16 state: rel err vs torch {err:.2e} (tol {tol:.1e})")
    assert_all([] if err <= tol else [f"rel err {err:.3e} > {tol:.1e}"], "bf16-state",
               "bfloat16", seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_cutile_stack_generation_matches_float64(dtype, gpu_record):
    """Two layers (pre-norm, residual in fp32), packed prompts: the stack's prefill and step with
    the cuTile SSD and kernels against the float64 stack, as (1)."""
    config, prompts, steps = CASES["packed-g2-q64"]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"generation/stack/{dtype}")
    try:
        stack = Mamba2Stack(config, 2, "cutile", kernels="cutile", device="cuda", seed=seed)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    seqs, lengths = sequences(config, prompts, steps, seed)
    got, _, caches = generate(stack, seqs, lengths, True)
    assert len(caches) == 2
    stack.set_backend("torch").set_kernels("torch")
    base, _, _ = generate(stack, seqs, lengths, True)
    want = whole(float64_of(stack, config, seed, Mamba2Stack, n_layers=2), seqs)
    err, base64 = rel_err(got, want), rel_err(base, want)
    tol = 2 * base64 + TOL[dtype] + UNIT_ROUNDOFF[dtype]
    record(gpu_record, "generation-cutile-stack-vs-float64", "packed-g2-q64-2-layers", config,
           dtype, seed, rel_err=err, tol=tol, torch_rel_err=base64, stage="generation")
    print(f"stack {dtype}: rel err vs float64 {err:.2e} (torch path {base64:.2e}, tol {tol:.1e})")
    assert_all([] if err <= tol else [f"rel err {err:.3e} > {tol:.1e}"], "stack", dtype, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_mamba_ssm_generation_matches_torch(dtype, gpu_record):
    """mamba_ssm as the backend: its varlen states and its selective_state_update (through the
    layer's adapter) against the torch backend, the kernels PyTorch's on both sides."""
    config, prompts, steps = CASES["packed-g2-q64"]
    config = replace(config, dtype=dtype)
    seed = seed_for(f"generation/mamba_ssm/{dtype}")
    try:
        mixer = Mamba2Mixer(config, "mamba_ssm", device="cuda", seed=seed)
    except BackendUnavailable as exc:
        pytest.skip(str(exc))
    seqs, lengths = sequences(config, prompts, steps, seed)
    got, _, _ = generate(mixer, seqs, lengths, True)
    base, _, _ = generate(mixer.set_backend("torch"), seqs, lengths, True)
    err, tol = rel_err(got, base), PEER_VS_TORCH[dtype]
    record(gpu_record, "generation-mamba_ssm-vs-torch", "packed-g2-q64", config, dtype, seed,
           rel_err=err, tol=tol, stage="generation")
    print(f"mamba_ssm {dtype}: rel err vs torch {err:.2e} (tol {tol:.1e})")
    assert_all([] if err <= tol else [f"rel err {err:.3e} > {tol:.1e}"], "mamba_ssm", dtype,
               seed)
