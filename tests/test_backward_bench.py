"""The forward + backward benchmark's CPU-checkable parts: the gradient gate (on the PyTorch
backward, run on the CPU), the choice of each implementation's fastest chunk size, the table and
the command line; TileGym's forward + backward adapter with stand-ins for its kernels."""
import os

import pytest

torch = pytest.importorskip("torch")

from ssd import autograd as AG  # noqa: E402
from ssd.tools import backward_bench as BB  # noqa: E402
from ssd.tools.bench import Shape, make_inputs  # noqa: E402

TINY = Shape("tiny", 2, 40, 4, 8, 16, 2)


def cpu_gradients(shape, inputs, dy, chunk_size=16):
    """Every leaf's gradient through the autograd Function, the PyTorch forward injected."""
    leaves = BB.leaves_of(inputs)
    x, dt, A, B, C, D, bias = (leaves[k] for k in BB.LEAVES)
    y = AG.chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=bias, dt_softplus=True,
                               stages=AG.torch_stages)
    grads = torch.autograd.grad(y, list(leaves.values()), dy)
    return dict(zip(("d" + k for k in BB.LEAVES), grads))


def test_gate_passes_the_backward_and_fails_a_wrong_gradient():
    inputs = make_inputs(TINY, "bfloat16", device="cpu")
    dy = BB.upstream(TINY, "bfloat16", device="cpu")
    gate = BB.GradGate(TINY, inputs, dy)
    grads = cpu_gradients(TINY, inputs, dy)
    checked = gate(grads)
    print(checked)
    assert checked["ok"] and checked["gate_rel_err"] < 1e-2
    wrong = dict(grads, dA=grads["dA"] * 1.1)  # off by 10 % on every head
    assert not gate(wrong)["ok"]
    with pytest.raises(ValueError, match="^heads"):
        BB.GradGate(TINY, inputs, dy, heads=3)


def record(shape, impl, q, what, ms, mode="graph"):
    return dict(shape=shape, impl=impl, chunk_size=q, what=what, mode=mode, median_ms=ms,
                extra_peak_mb=100.0)


RECORDS = [
    record("a", "ssd", 64, "forward", 0.2), record("a", "ssd", 64, "forward+backward", 1.0),
    record("a", "ssd", 128, "forward", 0.1), record("a", "ssd", 128, "forward+backward", 1.2),
    record("a", "mamba_ssm", 64, "forward", 0.3),
    record("a", "mamba_ssm", 64, "forward+backward", 2.0),
    record("b", "ssd", 64, "forward", 0.5), record("b", "ssd", 64, "forward+backward", 4.0),
    record("b", "mamba_ssm", 64, "forward+backward", 2.0, mode="eager"),
]


def test_each_implementation_at_its_fastest_forward_and_backward():
    top = BB.best(RECORDS)
    assert top[("a", "ssd")]["forward+backward"]["chunk_size"] == 64  # not the faster forward's
    assert top[("a", "ssd")]["forward"]["median_ms"] == 0.2
    assert ("b", "mamba_ssm") not in top  # eager only
    assert BB.speedups(RECORDS) == {"a": 2.0}


def test_table_lists_the_best_records_and_the_geometric_mean():
    payload = dict(records=RECORDS, failures=[dict(shape="b", impl="mamba_ssm", error="boom")],
                   skipped={}, settings=dict(modes=["graph"], l2="flushed"))
    text = BB.table(payload)
    print(text)
    assert "mamba_ssm / ours, forward + backward: geometric mean 2.00x over 1 shapes" in text
    assert "FAILED" in text
    line = next(l for l in text.splitlines() if l.startswith("a") and "ssd " in l)
    assert line.split()[3:6] == ["0.200", "1.000", "5.00"] and not line.endswith("x")
    line = next(l for l in text.splitlines() if l.startswith("a") and "mamba_ssm " in l)
    assert line.endswith("2.00x")  # a peer's line: its time over ours


def test_table_and_speedups_with_tilegym_beside():
    """A third implementation: its own speedup line, its own column entries."""
    tg = [record("a", "tilegym", 64, "forward", 0.4), record("a", "tilegym", 64,
                                                              "forward+backward", 1.5),
          record("b", "tilegym_tuned", 64, "forward+backward", 2.0)]
    records = RECORDS + tg
    assert BB.speedups(records, over="tilegym") == {"a": 1.5}
    assert BB.speedups(records, over="tilegym_tuned") == {"b": 0.5}
    assert BB.speedups(records) == {"a": 2.0}  # mamba_ssm's unchanged
    text = BB.table(dict(records=records, failures=[], skipped={"b/tilegym": "why"},
                         settings=dict(modes=["graph"], l2="flushed")))
    print(text)
    assert "tilegym / ours, forward + backward: geometric mean 1.50x over 1 shapes" in text
    assert "tilegym_tuned / ours, forward + backward: geometric mean 0.50x over 1 shapes" in text
    line = next(l for l in text.splitlines() if l.startswith("a") and " tilegym " in l)
    assert line.split()[2:5] == ["64", "0.400", "1.500"] and line.endswith("1.50x")
    assert "skipped b/tilegym: why" in text


# ----------------------------------------------------------------------------- TileGym's adapter


class StandIn:
    """TileGym's forward and backward stand-ins: they record what they were called with and
    the autotune switch at the call; y = x * dt' * (1 + 0 * ...) so that autograd reaches them,
    the gradients are fixed tensors to find again on the leaves."""

    def __init__(self):
        self.calls = []

    def forward(self, x, a, b, c, d, dt, init_state, chunk_size):
        self.calls.append(("forward", dict(x=x, a=a, b=b, c=c, d=d, dt=dt, init=init_state,
                                           q=chunk_size), os.environ.get(ENV)))
        return x * dt[..., None], init_state + 1.0

    def backward(self, x, a, b, c, d, dt, init_state, dout, dfinal_state, chunk_size):
        self.calls.append(("backward", dict(dout=dout, dfinal=dfinal_state, dt=dt,
                                            q=chunk_size), os.environ.get(ENV)))
        self.grads = dict(dx=torch.full_like(x, 2.0), da=torch.full_like(a, 3.0),
                          db=torch.full_like(b, 4.0), dc=torch.full_like(c, 5.0),
                          dd=torch.full_like(d, 6.0), ddt=torch.full_like(dt, 7.0),
                          dinit=torch.full_like(init_state, 8.0))
        return tuple(self.grads.values())


ENV = "TILEGYM_DISABLE_AUTOTUNE"


def tiny_inputs(dtype=torch.float32, l=32):
    b, h, p, n, g = 2, 4, 8, 16, 2
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return dict(x=r(b, l, h, p), dt=r(b, l, h), A=(-torch.rand(h, generator=gen)).requires_grad_(),
                B=r(b, l, g, n), C=r(b, l, g, n), D=torch.randn(h, generator=gen).requires_grad_(),
                dt_bias=torch.randn(h, generator=gen).requires_grad_())


@pytest.mark.parametrize("tuned,switch", [(False, "1"), (True, "0")])
def test_tilegym_adapter_maps_our_arguments_and_gradients(tuned, switch, monkeypatch):
    from ssd.tools import peers

    monkeypatch.delenv(ENV, raising=False)
    fake = StandIn()
    run = peers.tilegym_training_adapter(tuned=tuned, kernels=(fake.forward, fake.backward))
    v = tiny_inputs()
    y = run(v["x"], v["dt"], v["A"], v["B"], v["C"], 16, D=v["D"], dt_bias=v["dt_bias"],
            dt_softplus=True)
    step = torch.nn.functional.softplus(v["dt"].detach() + v["dt_bias"].detach())
    (_, args, env), = fake.calls
    assert env == switch and ENV not in os.environ  # set for the call only, then restored
    assert args["q"] == 16 and args["a"] is v["A"] and args["d"] is v["D"]
    assert args["b"] is v["B"] and args["c"] is v["C"]
    assert torch.allclose(args["dt"], step) and torch.equal(args["init"], torch.zeros(2, 4, 8, 16))
    dy = torch.randn_like(y)
    grads = dict(zip(BB.LEAVES, torch.autograd.grad(y, [v[k] for k in BB.LEAVES], dy)))
    (_, bargs, env) = fake.calls[1]
    assert env == switch and torch.equal(bargs["dout"], dy) and bargs["q"] == 16
    assert torch.equal(bargs["dfinal"], torch.zeros(2, 4, 8, 16))  # final states not used
    for leaf, key in (("x", "dx"), ("A", "da"), ("B", "db"), ("C", "dc"), ("D", "dd")):
        assert torch.equal(grads[leaf], fake.grads[key]), leaf
    # dt and dt_bias through the softplus autograd differentiates: 7 * sigmoid(dt + dt_bias)
    sig = torch.sigmoid(v["dt"].detach() + v["dt_bias"].detach())
    assert torch.allclose(grads["dt"], 7.0 * sig)
    assert torch.allclose(grads["dt_bias"], (7.0 * sig).sum(dim=(0, 1)))


def test_tilegym_adapter_initial_and_final_states_and_rounding():
    from ssd.tools import peers

    fake = StandIn()
    run = peers.tilegym_training_adapter(kernels=(fake.forward, fake.backward))
    v = tiny_inputs(torch.bfloat16)
    init = torch.randn(2, 4, 8, 16).requires_grad_()
    y, final = run(v["x"], v["dt"], v["A"], v["B"], v["C"], 32, initial_states=init,
                   return_final_states=True)
    args = fake.calls[0][1]
    assert args["dt"].dtype == torch.bfloat16 and torch.equal(args["dt"], v["dt"].detach())
    assert args["init"] is init and torch.equal(args["d"], torch.zeros(4))  # D absent: zeros
    dfinal = torch.randn_like(final)
    dinit, ddt = torch.autograd.grad((y, final), (init, v["dt"]), (torch.ones_like(y), dfinal))
    assert torch.equal(fake.calls[1][1]["dfinal"], dfinal) and torch.equal(dinit, fake.grads["dinit"])
    assert ddt.dtype == torch.bfloat16  # each gradient in its input's dtype


@pytest.mark.parametrize("kwargs,l,named", [
    (dict(z="z"), 32, "z (the gate)"),
    (dict(seq_idx="s"), 32, "seq_idx"),
    (dict(cu_seqlens="c"), 32, "cu_seqlens"),
    (dict(D=torch.zeros(4, 8)), 32, "D per head and channel"),
    (dict(dt_limit=(0.0, 0.1)), 32, "dt_limit"),
    ({}, 40, "seqlen % chunk_size != 0 (40 % 16)"),
])
def test_tilegym_adapter_refuses_what_tilegym_lacks(kwargs, l, named):
    from ssd.tools import peers

    fake = StandIn()
    run = peers.tilegym_training_adapter(kernels=(fake.forward, fake.backward))
    v = tiny_inputs(l=l)
    with pytest.raises(peers.PeerUnavailable, match="TileGym's Mamba-2 takes no") as err:
        run(v["x"], v["dt"], v["A"], v["B"], v["C"], 16, **kwargs)
    assert named in str(err.value) and not fake.calls  # nothing computed instead


def stand_in_tilegym(monkeypatch, fake):
    """A ``tilegym.ops.cutile.mamba2`` module of stand-ins, with one kernel's tune cache keyed
    as TileGym keys it (the autotune switch last)."""
    import sys
    import types

    module = types.ModuleType("tilegym.ops.cutile.mamba2")
    module.mamba2_chunk_forward, module.mamba2_chunk_backward = fake.forward, fake.backward
    module._bwd_pass_state_tune_cache = {("shape", True): ("untuned-config", "kernel"),
                                         ("shape", False): ("tuned-config", "kernel")}
    for name in ("tilegym", "tilegym.ops", "tilegym.ops.cutile"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_tilegym_module_found_its_configurations_recorded_and_reset(monkeypatch):
    import sys

    from ssd.tools import peers

    fake = StandIn()
    module = stand_in_tilegym(monkeypatch, fake)
    assert peers.tilegym_backward() == (fake.forward, fake.backward)
    assert peers.tilegym_configs(tuned=False) == {"bwd_pass_state": ["untuned-config"]}
    assert peers.tilegym_configs(tuned=True) == {"bwd_pass_state": ["tuned-config"]}
    assert peers.retune_tilegym() == 1 and not module._bwd_pass_state_tune_cache
    monkeypatch.setitem(sys.modules, module.__name__, None)  # import fails: absent
    with pytest.raises(peers.PeerUnavailable, match="backward is unavailable"):
        peers.tilegym_backward()


def test_implementations_run_tilegym_at_its_chunk_size_or_say_why_not(monkeypatch):
    import sys

    from ssd.tools import peers

    fake = StandIn()
    stand_in_tilegym(monkeypatch, fake)
    leaves = tiny_inputs(l=64)
    table, skipped = BB.implementations(leaves, ("tilegym", "tilegym_tuned"), chunks=(128, 256))
    assert set(table) == {"tilegym", "tilegym_tuned"} and not skipped
    assert list(table["tilegym"]) == [peers.TILEGYM_CHUNK]
    table["tilegym_tuned"][64]()
    (_, args, env), = fake.calls
    assert args["q"] == 64 and env == "0" and args["d"] is leaves["D"]
    monkeypatch.setitem(sys.modules, "tilegym.ops.cutile.mamba2", None)
    table, skipped = BB.implementations(leaves, ("tilegym",))
    assert not table and "unavailable" in skipped["tilegym"]


def test_implementations_time_ours_unfolded_beside_ours(monkeypatch):
    """``ssd_stages`` is ours with chunk_state's backward in kernels of its own, at
    every chunk size ours runs at."""
    from ssd import api
    from ssd.backward import cutile_backwards

    calls = []
    monkeypatch.setattr(api, "mamba_chunk_scan_combined", lambda *a, **kw: calls.append(kw))
    table, skipped = BB.implementations(tiny_inputs(l=64), ("ssd", "ssd_stages"),
                                        chunks=(64, 128))
    assert set(table) == {"ssd", "ssd_stages"} and not skipped
    assert list(table["ssd_stages"]) == [64, 128]
    table["ssd"][64]()
    table["ssd_stages"][64]()
    assert "backwards" not in calls[0] and calls[1]["backwards"] == cutile_backwards(fold=False)


@pytest.mark.parametrize("argv,message", [
    (["--shapes", "7b"], "--shapes: 7b unknown"),
    (["--modes", "graph,fast"], "--modes: fast unknown"),
    (["--chunks", "48"], "--chunks: [48]"),
    (["--impl", "tilegym_fast"], "invalid choice: 'tilegym_fast'"),
])
def test_main_rejects_what_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        BB.main(argv)
    assert message in capsys.readouterr().err


def test_merge_keeps_other_shapes_of_the_same_revision_only(tmp_path):
    env = dict(git_revision="abc", gpu="G")
    settings = dict(modes=["graph"], l2="flushed")

    def payload(shape, ms, revision="abc"):
        recs = [dict(r, median_ms=ms) for r in RECORDS if r["shape"] == shape]
        return dict(records=recs, failures=[], skipped={f"{shape}/tilegym": "no"},
                    mamba_ssm_configs={shape: {}}, settings=settings,
                    environment=dict(env, git_revision=revision))

    path = tmp_path / "backward.json"
    assert BB.merged(path, payload("a", 1.0)) == payload("a", 1.0)  # nothing there yet
    BB.write_json(path, payload("a", 1.0))
    both = BB.merged(path, payload("b", 2.0))
    assert {r["shape"] for r in both["records"]} == {"a", "b"}
    assert set(both["skipped"]) == {"a/tilegym", "b/tilegym"} and set(both["mamba_ssm_configs"]) == {"a", "b"}
    again = BB.merged(path, payload("a", 3.0))  # a shape run again replaces its records
    assert {r["median_ms"] for r in again["records"]} == {3.0}
    other = BB.merged(path, payload("b", 2.0, revision="def"))  # another revision: alone
    assert {r["shape"] for r in other["records"]} == {"b"}
