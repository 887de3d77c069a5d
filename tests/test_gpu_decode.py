"""GPU tests of the decode step, ``ssd.selective_state_update`` (``pytest -m gpu``; skipped
without a GPU).

Every check compares with the float64 reference step (``ssd.reference.selective_state_update``,
one step of the ladder's recurrence) computed from the *rounded* device inputs and the state as
it was before the call, on fresh random inputs (a new seed per run, printed on failure; replay
one with SSD_TEST_SEED), with y poisoned with NaN before the launch. The state is updated in
place, so it cannot be poisoned: instead every state row the batch names must change to its
reference value and every other row of the cache must keep its bits.

Tolerances (``ssd.validate.STEP_TOL`` and ``step_bounds``, derived there): each output element
is one fp32 computation rounded once to its dtype, so
* the norm: twice the unit roundoff of the stored dtype for bf16 (8e-3) and fp16 (1e-3), the
  rounding itself; 1e-5 for fp32, 168 fp32 units for exp2, softplus and the sum over n;
* every element: u_store·|ref| plus the fp32 arithmetic's worst case, computed per element from
  the magnitudes of its terms (the decay's exponent, the write dt' x B, the sum over n, the gate).
Batches of more than 16 entries check 16 of them against the reference (the first, the last,
and 14 drawn) and every entry's y for a NaN left.

The rows go to results/<gpu>/gpu_decode_tests.json (tests/conftest.py, ``record="decode"``).
"""
import math
import os
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd import reference as R  # noqa: E402
from ssd.tools.decode_bench import BATCHES, HEADS, STATE_DTYPES  # noqa: E402  (what it times)
from ssd.validate import STEP_TOL, check_step, host_inputs, rel_err, step_bounds  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "bfloat16", "float16")
SAMPLE = 16  # batch entries checked against the reference
DEVICE = "cuda"
RUN_SEED = int(os.environ.get("SSD_TEST_SEED", np.random.SeedSequence().entropy % 2**31))


def seed_for(name: str) -> int:
    return (RUN_SEED + zlib.crc32(name.encode())) % 2**31


@dataclass(frozen=True)
class Case:
    """One decode step's inputs: ``form`` "layer" (dt, A, dt_bias, D per head, expanded over the
    head dim and the state as mamba_ssm's Mamba-2 layer passes them), "head" (their per-head
    forms) or "channel" (every one per channel); ``D`` None, "h" or "hp"; z, dt_bias, softplus;
    ``paged``: a cache of 2b + 3 rows, the entries' rows shuffled, one entry padding (b > 1)."""

    dims: tuple  # (b, h, p, n, g)
    dtype: str = "bfloat16"
    state_dtype: str = "float32"
    form: str = "layer"
    D: str | None = "h"
    z: bool = False
    bias: bool = True
    softplus: bool = True
    paged: bool = False


def draw(case: Case, seed: int) -> dict:
    """The keyword arguments of ``selective_state_update`` on the GPU, drawn as a model's:
    x, B, C, z ~ N(0, 1); A = -exp(U(0, log 16)); dt' in Mamba-2's initialisation range
    [1e-3, 1e-1] (raw dt ~ 0.5 N(0, 1) and dt_bias its inverse softplus, or with no softplus dt'
    drawn there directly, plus a small bias); D ~ N(0, 1); the state ~ N(0, 1)."""
    b, h, p, n, g = case.dims
    t, gen = getattr(torch, case.dtype), torch.Generator(device=DEVICE).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=DEVICE)  # noqa: E731
    uniform = lambda lo, hi, *s: torch.empty(*s, device=DEVICE).uniform_(  # noqa: E731
        lo, hi, generator=gen)
    channel = case.form == "channel"
    per = (p,) if channel else ()  # per-channel values, or one a head
    step = lambda *s: torch.exp(uniform(math.log(1e-3), math.log(1e-1), *s))  # noqa: E731
    if case.softplus:
        dt, bias = 0.5 * randn(b, h, *per), torch.log(torch.expm1(step(h, *per)))
    else:
        dt, bias = step(b, h, *per), 0.01 * torch.rand(h, *per, generator=gen, device=DEVICE)
    A = -torch.exp(uniform(0, math.log(16), h, *per, *((n,) if channel else ())))
    D = None if case.D is None else randn(h, *((p,) if case.D == "hp" or channel else ()))
    dt = dt.to(t)  # before any expand: a cast would make the view contiguous
    if case.form == "layer":  # views, as the layer passes them: strides 0 along p (and n)
        dt, bias, A = dt[..., None].expand(b, h, p), bias[:, None].expand(h, p), \
            A[:, None, None].expand(h, p, n)
        D = D if D is None or D.dim() == 2 else D[:, None].expand(h, p)
    rows = 2 * b + 3 if case.paged else b
    out = dict(state=randn(rows, h, p, n).to(getattr(torch, case.state_dtype)),
               x=randn(b, h, p).to(t), dt=dt, A=A, B=randn(b, g, n).to(t),
               C=randn(b, g, n).to(t), D=D, z=randn(b, h, p).to(t) if case.z else None,
               dt_bias=bias if case.bias else None)
    if case.paged:
        slots = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))[:b]
        if b > 1:
            slots[b // 2] = -1  # a padding entry
        out["state_batch_indices"] = slots.to(device=DEVICE, dtype=torch.int32)
    return out


def entries(b: int, seed: int) -> np.ndarray:
    """The batch entries checked against the reference: all, or SAMPLE of them."""
    if b <= SAMPLE:
        return np.arange(b)
    drawn = np.random.default_rng(seed).choice(np.arange(1, b - 1), SAMPLE - 2, replace=False)
    return np.sort(np.concatenate([[0, b - 1], drawn]))


def check_case(case: Case, record: list, label: str, seed: int, config=None):
    """One step into a NaN-poisoned y; y and every named state row against the reference (both
    criteria), every other row of the cache unchanged; rows recorded."""
    import ssd

    args = draw(case, seed)
    state, b = args["state"], case.dims[0]
    before = state.clone()
    y = torch.full_like(args["x"], float("nan"))
    got = ssd.selective_state_update(**args, dt_softplus=case.softplus, out=y, config=config)
    torch.cuda.synchronize()
    assert got is y
    slots = args.get("state_batch_indices")
    rows = np.arange(b) if slots is None else slots.cpu().numpy().astype(np.int64)
    on = lambda a: torch.as_tensor(a, device=state.device)  # noqa: E731
    # The reference on the checked entries, as a dense problem: their rows gathered.
    pick = entries(b, seed)
    live = rows[pick] >= 0
    host = host_inputs({k: v[on(pick)] for k, v in args.items()
                        if k in ("x", "dt", "B", "C", "z") and v is not None})
    host.update(host_inputs({k: v for k, v in args.items()
                             if k in ("A", "D", "dt_bias") and v is not None}))
    host["state"] = before[on(np.maximum(rows[pick], 0))].double().cpu().numpy()
    host["state_batch_indices"] = np.where(live, np.arange(len(pick)), -1)
    y_ref, state_ref = R.selective_state_update(**host, dt_softplus=case.softplus)
    bounds = step_bounds(host, case.softplus, None, case.dtype, case.state_dtype)
    checks = [check_step("y", y[on(pick)], y_ref, bounds.y, case.dtype),
              check_step("state", state[on(rows[pick][live])], state_ref[live],
                         bounds.state[live], case.state_dtype)]
    failures = [c.failure() for c in checks if not c.ok]
    for c in checks:
        record.append(dict(record="decode", test=label, dims=list(case.dims), dtype=case.dtype,
                           state_dtype=case.state_dtype, form=case.form, D=case.D, z=case.z,
                           bias=case.bias, softplus=case.softplus, paged=case.paged,
                           output=c.key, checked=len(pick), **c.fields(), seed=seed))
    if not torch.isfinite(y).all():
        failures.append(f"y: {int((~torch.isfinite(y)).sum())} elements NaN or inf (unwritten?)")
    untouched = torch.ones(state.shape[0], dtype=torch.bool, device=state.device)
    untouched[on(rows[rows >= 0])] = False
    if not torch.equal(state[untouched], before[untouched]):
        failures.append("state: a row no batch entry names was written")
    if not torch.isfinite(state[~untouched]).all():
        failures.append("state: a named row holds NaN or inf")
    assert not failures, f"{label} [{case}, seed {seed}]: " + "; ".join(failures)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", list(HEADS))
def test_model_heads(shape, batch, dtype, state_dtype, gpu_record):
    """The two model shapes at batch 1, 8, 64 and 256, every input dtype with an fp32 and a bf16
    state, as mamba_ssm's Mamba-2 layer calls the step (per-head A, dt, dt_bias and D as
    expanded views, softplus; 2.7b with one group, codestral-7b with eight)."""
    case = Case((batch, *HEADS[shape]), dtype, state_dtype)
    label = f"decode/model/{shape}/b{batch}"
    check_case(case, gpu_record, label, seed_for(f"{label}/{dtype}/{state_dtype}"))


FEATURES = {
    "bare": dict(form="head", D=None, bias=False, softplus=False),
    "z": dict(form="head", D=None, bias=False, softplus=False, z=True),
    "D-per-head": dict(form="head", D="h", bias=False, softplus=False),
    "D-per-channel": dict(form="head", D="hp", bias=False, softplus=False),
    "bias": dict(form="head", D=None, softplus=False),
    "softplus": dict(form="head", D=None, bias=False),
    "layer-with-z": dict(z=True),
    "per-channel": dict(form="channel", z=True),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_features(feature, dtype, gpu_record):
    """With and without z, D (per head, per channel), dt_bias and softplus, in their compact
    per-head forms; the layer's views with z; mamba_ssm's general per-channel dt, A, dt_bias and
    D. codestral-7b's heads (eight groups) at batch 8, an fp32 state, and a bf16 one for the
    layer's call."""
    for state_dtype in ("float32", "bfloat16") if feature == "layer-with-z" else ("float32",):
        case = Case((8, *HEADS["codestral-7b"]), dtype, state_dtype, **FEATURES[feature])
        label = f"decode/features/{feature}"
        check_case(case, gpu_record, label, seed_for(f"{label}/{dtype}/{state_dtype}"))


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("shape", list(HEADS))
def test_paged_cache(shape, batch, state_dtype, gpu_record):
    """state_batch_indices into a cache of 2b + 3 rows, shuffled, one padding entry: the named
    rows advance, y of the padding entry is 0 and every other row keeps its bits. bf16 inputs."""
    case = Case((batch, *HEADS[shape]), "bfloat16", state_dtype, z=True, paged=True)
    label = f"decode/paged/{shape}/b{batch}"
    check_case(case, gpu_record, label, seed_for(f"{label}/{state_dtype}"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_sizes(dtype, gpu_record):
    """A head dim and state width that are not powers of two (the tiles padded, their padding
    never stored), three groups, everything per channel, a paged cache, a bf16 state."""
    case = Case((5, 6, 24, 20, 3), dtype, "bfloat16", form="channel", z=True, paged=True)
    check_case(case, gpu_record, "decode/odd", seed_for(f"odd/{dtype}"))


@pytest.mark.parametrize("block_p", [4, 64])
def test_other_slices(block_p, gpu_record):
    """The narrowest slice the rule may take and a whole head a block (what the benchmark's
    --block-p times), on 2.7b's heads at batch 8, bf16 with a bf16 state."""
    from ssd.config import StateUpdateConfig

    case = Case((8, *HEADS["2.7b"]), "bfloat16", "bfloat16", z=True)
    check_case(case, gpu_record, f"decode/block_p/{block_p}", seed_for(f"block_p{block_p}"),
               config=StateUpdateConfig(block_p=block_p))


def test_graph_replays_are_eager_steps():
    """Captured in a CUDA graph, the step runs without the host: three replays give the state
    and y of three eager steps, bit for bit (and the same kernel reruns deterministically)."""
    import ssd

    case = Case((8, *HEADS["2.7b"]), "bfloat16", "float32", z=True, paged=True)
    args = draw(case, seed_for("graph"))
    eager = dict(args, state=args["state"].clone())
    y_eager = [ssd.selective_state_update(**eager, dt_softplus=True).clone() for _ in range(3)]
    y = torch.empty_like(args["x"])
    side = torch.cuda.Stream()  # warm up (compile) off the capture, as ssd.tools.bench does
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ssd.selective_state_update(**dict(args, state=args["state"].clone()), dt_softplus=True,
                                   out=y)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ssd.selective_state_update(**args, dt_softplus=True, out=y)
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, y_eager[i]), f"replay {i}: y differs from the eager step"
    assert torch.equal(args["state"], eager["state"])


# one worker runs the large tests one after another (--dist loadgroup): side by side they
# would not fit in an 80 GB card
@pytest.mark.xdist_group("large")
@pytest.mark.skipif(os.environ.get("SSD_SKIP_LARGE") == "1", reason="SSD_SKIP_LARGE=1")
def test_state_of_more_than_2_31_elements(gpu_record):
    """A bf16 cache of 3,400 rows of 2.7b's heads: 2.2 G elements (int64 indexing), the batch
    naming rows near its end."""
    from ssd.launch import INT32_MAX

    h, p, n, g = HEADS["2.7b"]
    rows = 3400
    assert rows * h * p * n > INT32_MAX
    case = Case((8, h, p, n, g), "bfloat16", "bfloat16", paged=True)
    args = draw(replace(case, paged=False), seed_for("large"))
    args["state"] = torch.randn(rows, h, p, n, device=DEVICE, dtype=torch.bfloat16)
    args["state_batch_indices"] = torch.arange(rows - 8, rows, device=DEVICE, dtype=torch.int64)
    import ssd

    before = args["state"][-8:].clone()
    y = ssd.selective_state_update(**args, dt_softplus=True)
    host = host_inputs({k: v for k, v in args.items()
                        if v is not None and k not in ("state", "state_batch_indices")})
    host["state"] = before.double().cpu().numpy()
    y_ref, state_ref = R.selective_state_update(**host, dt_softplus=True)
    bounds = step_bounds(host, True, None, "bfloat16", "bfloat16")
    checks = [check_step("y", y, y_ref, bounds.y, "bfloat16"),
              check_step("state", args["state"][-8:], state_ref, bounds.state, "bfloat16")]
    for c in checks:
        gpu_record.append(dict(record="decode", test="decode/large", dims=[8, h, p, n, g],
                               dtype="bfloat16", state_dtype="bfloat16", rows=rows,
                               output=c.key, **c.fields()))
    assert all(c.ok for c in checks), "; ".join(c.failure() for c in checks if not c.ok)


def test_matches_mamba_ssm_where_it_is_correct(gpu_record):
    """The same step through mamba_ssm's Triton ``selective_state_update`` (on a copy of the
    state), as its Mamba-2 layer calls it, bf16 with an fp32 state, on both model shapes at
    batch 64: where mamba_ssm meets the tolerances, ours agrees with it to twice them. Where it
    misses them or fails, the row records it: data about the peer."""
    import ssd
    from ssd.tools.peers import PeerUnavailable, mamba_ssm_state_update

    try:
        theirs = mamba_ssm_state_update()
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    for shape in HEADS:
        case = Case((64, *HEADS[shape]), "bfloat16", "float32")
        args = draw(case, seed_for(f"peer/{shape}"))
        host = host_inputs({k: v for k, v in args.items() if v is not None})
        y_ref, state_ref = R.selective_state_update(**host, dt_softplus=True)
        peer_state = args["state"].clone()
        y = ssd.selective_state_update(**args, dt_softplus=True)
        row = dict(record="decode", test="decode/peer/mamba_ssm", kind="peer", shape=shape,
                   dims=list(case.dims), dtype="bfloat16", state_dtype="float32")
        try:
            y_peer = theirs(peer_state, args["x"], args["dt"], args["A"], args["B"], args["C"],
                            D=args["D"], dt_bias=args["dt_bias"], dt_softplus=True)
        except Exception as exc:  # a peer failure is data, not our failure
            gpu_record.append(dict(row, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        for key, ours, peer, ref in (("y", y, y_peer, y_ref),
                                     ("state", args["state"], peer_state, state_ref)):
            tol = STEP_TOL["float32" if key == "state" else "bfloat16"]
            peer_err = rel_err(peer, ref)
            diff = rel_err(ours, peer.double().cpu().numpy())
            gpu_record.append(dict(row, output=key, rel_err=rel_err(ours, ref),
                                   mamba_ssm_rel_err=peer_err, ours_vs_mamba_ssm=diff, tol=tol))
            if peer_err <= tol:
                assert diff <= 2 * tol, f"{shape}/{key}: ours vs mamba_ssm {diff:.3e}"

