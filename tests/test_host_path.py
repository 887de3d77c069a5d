"""The forward's host path on the CPU: plans (ssd.api) keep a signature's checks and
configuration at its first call and replay, from its second, exactly the launches the launchers
make for that call's own tensors (ssd.api's invariant); a key that differs in any element
(dtype, shape, stride, device, each argument, the varlen ones) misses, every check still
raises, a call that needs a gradient runs in full under autograd, and
``python -m ssd.tools.host_profile`` writes a well-formed record. Launches are recorded
(``ssd.launch.capture``), under which CPU tensors stand for an sm_90 GPU."""
import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")


from ssd import api, launch  # noqa: E402
from ssd.config import FusedScanConfig, SSDConfig, StateConfig  # noqa: E402

bf16 = torch.bfloat16


@pytest.fixture(autouse=True)
def no_plans(monkeypatch):
    """Each test starts without plans and leaves none behind."""
    monkeypatch.setattr(api, "_plans", {})


@pytest.fixture
def checks(monkeypatch):
    """The calls of api.validate (the first call of a signature checks; a replay does not)."""
    calls = []
    validate = api.validate

    def spy(*args, **kw):
        calls.append(1)
        return validate(*args, **kw)

    monkeypatch.setattr(api, "validate", spy)
    return calls


def inputs(b=2, l=200, h=8, p=32, n=64, g=2, dtype=bf16, seed=0, **extra):
    """The forward's keyword arguments on CPU tensors: x, dt, A, B, C and chunk 64, plus
    ``extra`` ("layer": D per head, dt_bias, softplus; or any argument by name)."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s, dt=dtype: torch.randn(*s, generator=gen).to(dt)  # noqa: E731
    args = dict(x=rand(b, l, h, p), dt=rand(b, l, h), A=-torch.rand(h, generator=gen),
                B=rand(b, l, g, n), C=rand(b, l, g, n), chunk_size=64)
    if extra.pop("layer", False):
        args.update(D=rand(h, dt=torch.float32), dt_bias=rand(h, dt=torch.float32),
                    dt_softplus=True)
    args.update(extra)
    return args


def packed(l=200, h=8, p=32, n=64, g=2):
    """One row of three packed sequences (lengths 1, 70 and the rest) with cu_seqlens."""
    cu = torch.tensor([0, 1, 71, l], dtype=torch.int32)
    seq = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), cu.diff()).reshape(1, l)
    return inputs(1, l, h, p, n, g, layer=True, seq_idx=seq, cu_seqlens=cu,
                  return_varlen_states=True, return_final_states=True)


def strided_x(**kw):
    """x whose last dimension is strided (copied once a call) and A in bf16 (converted)."""
    args = inputs(**kw)
    args["x"] = torch.randn(*args["x"].shape, 2).to(bf16)[..., 0]
    args["A"] = args["A"].to(bf16)
    return args


CASES = {
    "layer": lambda: inputs(layer=True),
    "layer-2.7b-heads": lambda: inputs(1, 128, 80, 64, 128, 1, layer=True),
    "every-input": lambda: inputs(
        layer=True, D=torch.randn(8, 32), z=torch.randn(2, 200, 8, 32).to(bf16),
        initial_states=torch.randn(2, 8, 32, 64), dt_limit=(0.001, 0.1),
        seq_idx=torch.zeros(2, 200, dtype=torch.int64), return_final_states=True),
    "varlen": packed,
    "fused-scan": lambda: inputs(layer=True, config=SSDConfig(
        fused_scan=FusedScanConfig(enabled=True))),
    "grouped": lambda: inputs(1, 640, 8, 32, 128, 1, layer=True, config=SSDConfig(
        state=StateConfig(block_n=128, groups=4))),
    "split": lambda: inputs(layer=True, config=SSDConfig(state=StateConfig(fused=False))),
    "strided-x-bf16-A": strided_x,
    "float16": lambda: inputs(dtype=torch.float16, layer=True),
    "float32": lambda: inputs(dtype=torch.float32),
}
BLANK = ("empty_strided.default", "detach.default")  # torch hands a factory's result on detached
SEQ_LAST = ["arange.start_step", "clamp_.default", "index.Tensor"]  # api.chunk_seq_last
PREPARED = {"every-input": ["_to_copy.default", *SEQ_LAST],  # seq_idx to int32
            "varlen": SEQ_LAST,
            "strided-x-bf16-A": ["clone.default", "_to_copy.default"]}  # x's copy, A in fp32
STAGES_ARGS = ("x", "dt", "A", "B", "C", "chunk_size", "D", "z", "dt_bias", "initial_states",
               "seq_idx", "dt_softplus", "dt_limit", "config")


def uncached(args):
    """What the launchers launch for ``args`` (forward_stages, no plan)."""
    stage_args = {k: v for k, v in args.items() if k in STAGES_ARGS}
    if args.get("return_varlen_states"):
        stage_args["cu_seqlens"] = args["cu_seqlens"]
    with launch.capture() as records:
        api.forward_stages(**stage_args)
    return records


def tensors(args):
    return [v for v in args.values() if isinstance(v, torch.Tensor)]


def call(args):
    with launch.capture() as records:
        out = api.mamba_chunk_scan_combined(**args)
    return out, records


def assert_same_launches(replayed, reference, caller):
    """The same kernels, grids and arguments: scalars equal and of one type, tensors of one
    dtype, shape and strides, and the caller's own tensor wherever the launchers passed it."""
    assert [(r.kernel, r.grid) for r in replayed] == [(r.kernel, r.grid) for r in reference]
    for mine, theirs in zip(replayed, reference):
        for a, b in zip(mine.args, theirs.args, strict=True):
            if isinstance(b, torch.Tensor):
                assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride())
                assert (a is b) == any(b is t for t in caller), "a caller's tensor"
            else:
                assert a == b and type(a) is type(b)


@pytest.mark.parametrize("case", list(CASES))
def test_a_replay_launches_what_the_launchers_launch(case, checks, torch_ops):
    args = CASES[case]()
    reference = uncached(args)
    caller = tensors(args)
    first, recorded = call(args)  # checked, configured, run in full
    assert_same_launches(recorded, reference, caller)
    assert len(checks) == 1 and len(api._plans) == 1
    assert not next(iter(api._plans.values())).traced
    _, traced = call(args)  # traced, then replayed
    assert_same_launches(traced, reference, caller)
    plan = next(iter(api._plans.values()))
    assert plan.steps is not None, "every case is replayable"
    with torch_ops() as ops:
        second, replayed = call(args)
    assert_same_launches(replayed, reference, caller)
    assert len(checks) == 1, "no call checks again"
    # what a replay computes: the blanks, and api.prepare's copies; nothing else
    assert ops.names.count("empty_strided.default") == len(plan.blanks)
    assert [n for n in ops.names if n not in BLANK] == PREPARED.get(case, [])
    outs = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    for a, b in zip(outs(first), outs(second), strict=True):
        assert a is not b and (a.dtype, a.shape) == (b.dtype, b.shape), "fresh outputs"
    written = {id(t) for r in replayed for t in r.args if isinstance(t, torch.Tensor)}
    assert all(id(t) in written for t in outs(second)), "a returned tensor a kernel writes"


def test_the_2_7b_prompt_allocates_only_its_outputs_and_intermediates(torch_ops):
    """A Mamba-2 layer's call with the 2.7b heads: a replay allocates y, final_states, dt_out,
    dA_cumsum and prev_states (the launchers also allocated a stand-in for each of eleven absent
    inputs at every call) and runs no other torch op."""
    args = inputs(1, 512, 80, 64, 128, 1, layer=True, return_final_states=True)
    call(args), call(args)
    with torch_ops() as ops:
        call(args)
    assert [n for n in ops.names if n != "detach.default"] == ["empty_strided.default"] * 5


VARIANTS = {
    "x dtype": lambda a: dict(a, **{k: a[k].half() for k in ("x", "dt", "B", "C")}),
    "a stride of B": lambda a: dict(a, B=torch.randn(2, 200, 2, 128).to(bf16)[..., :64]),
    "B's batch stride": lambda a: dict(a, B=torch.randn(2, 210, 2, 64).to(bf16)[:, :200]),
    "z present": lambda a: dict(a, z=torch.randn(2, 200, 8, 32).to(bf16)),
    "dt_bias absent": lambda a: {k: v for k, v in a.items() if k != "dt_bias"},
    "D per channel": lambda a: dict(a, D=torch.randn(8, 32)),
    "initial_states present": lambda a: dict(a, initial_states=torch.randn(2, 8, 32, 64)),
    "initial_states' dtype": lambda a: dict(a, initial_states=torch.randn(2, 8, 32, 64).to(bf16)),
    "dt_bias' dtype": lambda a: dict(a, dt_bias=a["dt_bias"].to(bf16)),
    "a config": lambda a: dict(a, config=SSDConfig()),
    "an equal config": lambda a: dict(a, config=SSDConfig()),  # another object: another key
    "chunk size": lambda a: dict(a, chunk_size=128),
    "dt_limit": lambda a: dict(a, dt_limit=(0.0, 0.5)),
    "dt_softplus": lambda a: dict(a, dt_softplus=False),
    "seq_idx present": lambda a: dict(a, seq_idx=torch.zeros(2, 200, dtype=torch.int32)),
    "seq_idx's dtype": lambda a: dict(a, seq_idx=torch.zeros(2, 200, dtype=torch.int64)),
}


def test_changing_any_element_of_the_key_misses(checks):
    base = inputs(layer=True)
    call(base)
    call(inputs(layer=True, seed=1))  # other values, the same signature: traced and replayed
    assert len(checks) == 1 and len(api._plans) == 1
    for n, (name, vary) in enumerate(VARIANTS.items(), start=2):
        args = vary(base)
        call(args)
        assert len(checks) == n and len(api._plans) == n, name
        _, replayed = call(args)
        assert len(checks) == n, f"{name}: the second call replays"
        assert_same_launches(replayed, uncached(args), tensors(args))


def test_every_check_still_raises_after_a_plan():
    args = inputs(layer=True)
    call(args)
    bad = [("chunk_size", dict(chunk_size=64.0), ValueError),  # equal to 64, but no int
           ("chunk_size", dict(chunk_size=48), ValueError),
           ("C", dict(B=torch.randn(2, 200, 2, 65).to(bf16)), ValueError),  # n from B
           ("dt_limit", dict(dt_limit=(0.1, 0.01)), ValueError),
           ("dt_limit", dict(dt_limit=(0.0, math.nan)), ValueError),
           ("dt", dict(dt=[1.0]), TypeError),
           ("A", dict(A=-torch.rand(8, dtype=torch.float64)), TypeError)]
    for name, over, exc in bad:
        with pytest.raises(exc, match=rf"^{name}\b"):
            call(dict(args, **over))
    # the value checks run on a replay too, where asked for
    positive = dict(args, A=torch.rand(8))
    call(positive)
    with pytest.raises(ValueError, match="^A: must be finite and <= 0"):
        call(dict(positive, check_values=True))
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):  # not under capture
        api.mamba_chunk_scan_combined(**args)


def test_one_tensor_in_two_roles_is_never_traced():
    """Which role a launch argument plays is unknown where two inputs are one tensor: such a call
    runs in full, and the signature's plan stays untraced (a later call of distinct tensors
    traces it)."""
    args = inputs(layer=True)
    args["C"] = args["B"]
    for _ in range(3):
        _, recorded = call(args)
        assert_same_launches(recorded, uncached(args), tensors(args))
    (plan,) = api._plans.values()
    assert not plan.traced
    call(dict(args, C=args["B"].clone()))
    assert next(iter(api._plans.values())).steps is not None


def test_stages_that_compute_keep_a_plan_without_steps(monkeypatch, checks):
    """A launcher that ran a torch op besides allocating (here a copy of dt) cannot be replayed:
    its plan keeps the checks and the configuration, and each call runs the stages."""
    cumsum = api._cumsum.chunk_cumsum
    monkeypatch.setattr(api._cumsum, "chunk_cumsum", lambda dt, *a, **k: cumsum(dt * 1, *a, **k))
    args = inputs(layer=True)
    for _ in range(3):
        _, recorded = call(args)
        copied = {k: v for k, v in args.items() if k != "dt"}
        assert_same_launches(recorded, uncached(args), tensors(copied))
    (plan,) = api._plans.values()
    assert plan.traced and plan.steps is None and len(checks) == 1


def test_host_profile_writes_a_record_on_the_cpu(tmp_path, monkeypatch):
    from ssd.tools import host_profile

    monkeypatch.setattr(host_profile, "environment", lambda: {"gpu": None, "date": "d"})
    out = tmp_path / "host.json"
    assert host_profile.main(["--device", "cpu", "--reps", "5", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["problem"] == dict(b=1, l=512, h=80, p=64, n=128, g=1, dtype="bfloat16",
                                     chunk_size=64)
    assert record["kernels"] == ["chunk_cumsum", "state_passing", "chunk_scan"]
    assert set(record["first_call_us"]) == {*host_profile.FIRST_CALL, "total"}
    assert set(record["repeated_call_us"]) == set(host_profile.REPEATED_CALL) - {"cutile"}
    phases = [*record["first_call_us"].values(), *record["repeated_call_us"].values()]
    assert all(math.isfinite(v) and v > 0 for v in phases)
    assert record["environment"] == {"gpu": None, "date": "d"} and "eager_ms" not in record


def test_run_enters_the_device_once_and_only_when_it_is_not_current(monkeypatch):
    """launch.run's GPU path with cuTile's launcher and torch.cuda stood in for: each step's
    kernel, grid and argument tuple on the current stream, in order; the device entered once for
    all steps, and only where it is not the current one; a step with a quick build whose key is
    not settled asks launch.pick which kernel to launch."""
    import contextlib

    launched, entered = [], []
    monkeypatch.setattr(launch.ct, "launch", lambda stream, grid, kernel, args: launched.append(
        (stream, grid, kernel, args)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: "stream")
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext(entered.append(d)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(launch, "settled", set())
    tuned, quick, other = object(), object(), object()
    picked = []

    def pick(key, q, record, arch, capturing):
        picked.append((key, record.args, arch, capturing))
        return q.quick

    monkeypatch.setattr(launch, "pick", pick)
    monkeypatch.setattr(launch, "_launched", {tuned, quick, other})
    steps = (launch.Step(other, (1, 2, 3)),
             launch.Step(tuned, (4, 1, 1), launch.QuickFirst(quick, None), ("key",)))
    launch.run(steps, [(1, 2), (3,)], torch.device("cuda", 0))
    assert launched == [("stream", (1, 2, 3), other, (1, 2)), ("stream", (4, 1, 1), quick, (3,))]
    assert picked == [(("key",), (3,), "sm_90", False)] and not entered
    launch.settled.add(("key",))
    launch.run(steps, [(1, 2), (3,)], torch.device("cuda", 1))
    assert launched[-1] == ("stream", (4, 1, 1), tuned, (3,))
    assert entered == [torch.device("cuda", 1)] and len(picked) == 1


def test_interleaved_signatures_each_launch_their_own_call():
    """Calls of several signatures in turn, fresh tensors at every call: each launches what the
    launchers launch for its own tensors, never a plan's earlier tensors nor another
    signature's launches."""
    for _ in range(3):
        for case in ("layer", "every-input", "varlen", "strided-x-bf16-A"):
            args = CASES[case]()
            _, recorded = call(args)
            assert_same_launches(recorded, uncached(args), tensors(args))
    assert len(api._plans) == 4 and all(p.steps is not None for p in api._plans.values())


def test_varlen_arguments_replay_or_miss(checks):
    """cu_seqlens is read only with return_varlen_states (mamba_ssm's rule): without it the call
    is keyed and launched as one without cu_seqlens; its dtype, its number of sequences and
    return_varlen_states are in the key; return_final_states only picks what comes back."""
    base = packed()
    call(base), call(base)
    plain = dict(base, return_varlen_states=False)
    out, recorded = call(plain)
    assert len(out) == 2 and len(checks) == 2
    assert_same_launches(recorded, uncached(plain), tensors(plain))
    no_cu = {k: v for k, v in plain.items() if k != "cu_seqlens"}
    call(no_cu)
    assert len(checks) == 2, "cu_seqlens without return_varlen_states: the same key"
    cu4 = torch.tensor([0, 1, 71, 150, 200], dtype=torch.int32)
    seq4 = torch.repeat_interleave(torch.arange(4, dtype=torch.int32), cu4.diff()).reshape(1, 200)
    for n, over in enumerate([dict(cu_seqlens=base["cu_seqlens"].long()),
                              dict(cu_seqlens=cu4, seq_idx=seq4)], start=3):
        args = dict(base, **over)
        call(args)
        out, replayed = call(args)
        assert len(checks) == n and out[2].shape[0] == len(args["cu_seqlens"]) - 1
        assert_same_launches(replayed, uncached(args), tensors(args))
    (y, states), replayed = call(dict(base, return_final_states=False))
    assert len(checks) == 4 and states.shape == (3, 8, 32, 64)
    assert_same_launches(replayed, uncached(base), tensors(base))
    # a replay checks values where asked for: seq_idx's order, cu_seqlens' offsets
    backwards = dict(base, seq_idx=base["seq_idx"].flip(1).contiguous(), check_values=True)
    with pytest.raises(ValueError, match="^seq_idx: must be >= 0 and non-decreasing"):
        call(backwards)
    moved = dict(base, cu_seqlens=torch.tensor([0, 2, 71, 200], dtype=torch.int32),
                 check_values=True)
    with pytest.raises(ValueError, match="^cu_seqlens"):
        call(moved)
    assert len(checks) == 4


def test_another_device_misses_and_is_checked():
    """The key holds each tensor's device: the same signature on another device is checked
    again (meta tensors fail the device check, as a second GPU's would pass or fail it)."""
    args = inputs(layer=True)
    call(args), call(args)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(ValueError, match="^x: must be a CUDA tensor"):
        call(meta)
    with pytest.raises(ValueError, match="^B: on meta, but x is on cpu"):
        call(dict(args, B=meta["B"]))


def test_a_call_that_needs_a_gradient_never_replays(monkeypatch):
    """Where an input requires grad, the call runs the full forward inside ssd.autograd (which
    saves what the backward reads), even after its signature's plan is traced; its output and
    gradients equal those of a process without plans. Under no_grad the same tensors replay.
    The stages are the float64 NumPy ladder here (ssd.autograd.reference_stages): values on the
    CPU."""
    from ssd import autograd

    stages = []
    monkeypatch.setattr(api, "forward_stages", lambda *a, **k: stages.append(1) or
                        autograd.reference_stages(*a, **k))
    seq = torch.tensor([[0] * 40 + [1] * 60], dtype=torch.int32)
    args = inputs(1, 100, 4, 8, 16, 1, dtype=torch.float32, layer=True, seq_idx=seq,
                  z=torch.randn(1, 100, 4, 8), initial_states=torch.randn(1, 4, 8, 16),
                  chunk_size=32, return_final_states=True)
    _, reference = call(args)  # run in full: the launchers' launches
    call(args)  # traced
    assert next(iter(api._plans.values())).steps is not None and not stages

    def gradients():
        leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point())
                  if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        (y, final), _ = call(leaves)
        assert type(y.grad_fn).__name__ == "ChunkScanCombinedBackward"
        (y.square().sum() + final.sum()).backward()
        return y.detach(), [leaves[k].grad for k in ("x", "dt", "A", "B", "C", "D", "z",
                                                       "dt_bias", "initial_states")]

    y, grads = gradients()
    assert len(stages) == 1, "the full forward, under autograd"
    plan_key = api.plan_key
    monkeypatch.setattr(api, "plan_key", lambda *a, **k: None)  # as without plans
    y_plain, grads_plain = gradients()
    assert torch.equal(y, y_plain)
    assert all(g is not None and torch.equal(g, h) for g, h in zip(grads, grads_plain))
    monkeypatch.setattr(api, "plan_key", plan_key)
    for t in tensors(args):
        t.requires_grad_(t.is_floating_point())
    with torch.no_grad():
        (y, _), replayed = call(args)
    assert y.grad_fn is None and len(stages) == 2, "replayed: no forward_stages"
    assert_same_launches(replayed, reference, tensors(args))
