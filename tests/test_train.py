"""ssd.tools.train on the CPU: the MQAR generator (deterministic, labels right), the Mamba-2
language model (every weight gets a gradient), a real learning check, reproducible curves, the
record, and the training-step timer on a tiny stack with the torch backend (times are
perf_counter wall times here: only their bookkeeping is checked, never their values)."""
import contextlib
import json
import math
from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssd.layer import Mamba2Config, Mamba2LM, Mamba2Stack  # noqa: E402
from ssd.tools import train as T  # noqa: E402
from ssd.tools.env import write_json  # noqa: E402

TINY = T.TRAIN_PRESETS["tiny"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny problems gain nothing from more, and a second thread
    waiting on a core another process holds would multiply the run time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- the task


def test_mqar_is_deterministic():
    task = T.MQARConfig(vocab_size=64, num_pairs=4, seq_len=40)
    a, b, c = (T.mqar(task, 32, seed) for seed in (3, 3, 4))
    for name in ("inputs", "targets", "queries", "answers"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(a.inputs, c.inputs)
    assert a.inputs.shape == (32, task.seq_len) and a.queries.shape == (32, task.num_pairs)
    assert a.inputs.dtype == torch.int64 and len(a) == 32


@pytest.mark.parametrize("task", [
    T.MQARConfig(vocab_size=64, num_pairs=4, seq_len=40),
    T.MQARConfig(vocab_size=20, num_pairs=8, seq_len=32, power_a=1.0),  # every slot queried
    T.MQARConfig(vocab_size=1000, num_pairs=5, seq_len=33),  # odd length
], ids=["default", "full", "odd"])
def test_mqar_labels(task):
    """Each query's target is the value that followed the same key in the context."""
    V, P = task.vocab_size, task.num_pairs
    data = T.mqar(task, 50, seed=1)
    for x, y, q, ans in zip(data.inputs.tolist(), data.targets.tolist(), data.queries.tolist(),
                            data.answers.tolist()):
        keys, values = x[0:2 * P:2], x[1:2 * P:2]
        assert len(set(keys)) == P and all(1 <= k < V // 2 for k in keys)
        assert len(set(values)) == P and all(V // 2 <= v < V for v in values)
        assert all(0 <= t < V for t in x)
        context = dict(zip(keys, values))
        labelled = [i for i, t in enumerate(y) if t != T.IGNORE]
        assert sorted(q) == labelled  # targets exactly at the queries
        assert sorted(x[i] for i in q) == sorted(keys)  # every key queried once
        for i, a in zip(q, ans):
            assert i >= 2 * P and (i - 2 * P) % 2 == 0
            assert y[i] == a == context[x[i]]


@pytest.mark.parametrize("choices, k", [(10, 3), (5, 4)], ids=["by-rejection", "by-top-k"])
def test_distinct_draws_are_uniform(choices, k):
    """Every column of the draws is uniform over the range, and a row never repeats a value."""
    draws = T._draw_distinct(np.random.default_rng(0), 20_000, choices, k)
    assert draws.shape == (20_000, k) and draws.min() >= 0 and draws.max() < choices
    assert (np.sort(draws, axis=1)[:, 1:] != np.sort(draws, axis=1)[:, :-1]).all()
    for column in draws.T:
        freq = np.bincount(column, minlength=choices) / len(column)
        assert np.abs(freq - 1 / choices).max() < 0.01


def test_mqar_power_law_clusters_queries():
    """power_a = 0.01 puts the queries nearer the context than uniform slots (power_a = 1)."""
    near = T.mqar(T.MQARConfig(vocab_size=64, num_pairs=4, seq_len=200), 400, seed=0)
    flat = T.mqar(T.MQARConfig(vocab_size=64, num_pairs=4, seq_len=200, power_a=1.0), 400, seed=0)
    slots = (200 - 8) // 2
    mean_slot = lambda d: ((d.queries - 8) / 2).float().mean().item()  # noqa: E731
    assert mean_slot(flat) == pytest.approx((slots - 1) / 2, rel=0.1)
    assert mean_slot(near) < 0.6 * mean_slot(flat)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(vocab_size=8, num_pairs=4), "num_pairs"),
    (dict(num_pairs=16, seq_len=63), "seq_len"),
    (dict(power_a=0.0), "power_a"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_mqar_rejects(kwargs, arg):
    with pytest.raises(ValueError, match=f"^{arg}"):
        T.MQARConfig(**kwargs)


def test_train_config_rejects():
    with pytest.raises(ValueError, match="^precision"):
        replace(TINY, precision="fp8")
    with pytest.raises(ValueError, match="^eval_examples"):
        replace(TINY, eval_examples=TINY.batch + 1)
    with pytest.raises(ValueError, match="^headdim"):
        replace(TINY, headdim=48)


def test_override_parses_by_field_type():
    c = T._override(TINY, ["lr=1e-3", "tie=false", "betas=0.9,0.99", "steps=7"])
    assert (c.lr, c.tie, c.betas, c.steps) == (1e-3, False, (0.9, 0.99), 7)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        T._override(TINY, ["nope=1"])


# ----------------------------------------------------------------------------- the model


LM_CONFIG = Mamba2Config(d_model=32, d_state=8, headdim=16, ngroups=2, chunk_size=16,
                         dtype="float32")


@pytest.mark.parametrize("tie", [True, False])
def test_lm_every_weight_gets_a_gradient(tie):
    model = Mamba2LM(50, LM_CONFIG, 2, "torch", tie=tie, seed=0)
    tokens = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[3, 20], [0, 23]])
    logits = model(tokens, positions)
    assert logits.shape == (2, 2, 50)
    full = model(tokens)
    assert full.shape == (2, 24, 50)
    torch.testing.assert_close(logits[1, 1], full[1, 23])  # the gather picks the positions
    logits.square().mean().backward()
    names = [n for n, _ in model.named_parameters()]
    assert any("A_log" in n for n in names) and any("dt_bias" in n for n in names)
    assert ("head.weight" in names) == (not tie)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, name


def test_lm_trains_through_the_autograd_function():
    """The cutile backend's path without its kernels: ``ssd.autograd.ChunkScanCombined`` (the
    backward of ``ssd.backward``) over the PyTorch stages gives the LM the gradients that
    autograd through the torch backend gives."""
    from functools import partial

    from ssd.autograd import chunk_scan_combined, torch_stages
    from ssd.layer import ssd_replaced

    tokens = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[5, 39], [17, 30]])
    grads = []
    for fn in (None, partial(chunk_scan_combined, stages=torch_stages)):
        model = Mamba2LM(50, LM_CONFIG, 2, "torch", seed=3)
        with ssd_replaced(model, fn) if fn else contextlib.nullcontext():
            model(tokens, positions).logsumexp(-1).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_lm_seeded_and_frozen_stack_unchanged():
    a, b, c = (Mamba2LM(50, LM_CONFIG, 2, seed=s) for s in (1, 1, 2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embedding.weight, c.embedding.weight)
    # the stack inside is the stack a seed builds; a plain stack stays frozen (no graph)
    stack = Mamba2Stack(LM_CONFIG, 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.stack.parameters(), stack.parameters()))
    u = torch.randn(1, 20, 32)
    assert not stack(u).requires_grad


def test_lm_rejects_bad_tokens():
    model = Mamba2LM(50, LM_CONFIG, 1)
    with pytest.raises(ValueError, match="^tokens"):
        model(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="^positions"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long))


def test_reference_backend_refuses_to_train():
    model = Mamba2LM(50, LM_CONFIG, 1, "reference")
    with pytest.raises(NotImplementedError, match="reference backend"):
        model(torch.zeros(1, 16, dtype=torch.long))
    with torch.no_grad():  # inference still runs
        assert model(torch.zeros(1, 16, dtype=torch.long)).shape == (1, 16, 50)


def test_schedule_warms_up_then_decays():
    config = replace(TINY, steps=20, warmup=4, lr=1.0, min_lr_ratio=0.1)
    opt, schedule = T.optimizer(Mamba2LM(50, LM_CONFIG, 1), config)
    lrs = []
    for _ in range(config.steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)
    assert [g["weight_decay"] for g in opt.param_groups] == [config.weight_decay, 0.0]
    assert all(p.dim() < 2 for p in opt.param_groups[1]["params"])


# ----------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def record():
    """The tiny preset trained with the torch backend for two seeds; the reference backend
    (no backward) and the GPU backends are recorded as a failure and skips."""
    return T.run(TINY, ("torch", "reference", "cutile", "mamba_ssm"), seeds=(0, 1),
                 device="cpu", progress=False, name="tiny")


def test_loss_decreases(record):
    """30 steps learn which tokens answer (a value, from half the vocabulary: the loss falls
    from ln V towards ln(V/2), 0.69 nats lower); recall itself takes the GPU run's steps."""
    run = next(r for r in record["runs"] if r["seed"] == 0)
    V = TINY.vocab_size
    assert run["eval_loss"][0] == pytest.approx(math.log(V), abs=0.1)  # uniform at init
    assert run["eval_loss"][-1] < run["eval_loss"][0] - 0.5
    first, last = run["train_loss"][:5], run["train_loss"][-5:]
    assert sum(last) / 5 < sum(first) / 5 - 0.5
    assert run["eval_loss"][-1] < math.log(V / 2) + 0.1


def test_same_seed_same_curves(record):
    again = T.train(TINY, "torch", seed=0, device="cpu", progress=False)
    first = next(r for r in record["runs"] if r["seed"] == 0)
    for key in ("train_loss", "eval_step", "eval_loss", "eval_accuracy", "final_accuracy"):
        assert again[key] == first[key], key
    other = next(r for r in record["runs"] if r["seed"] == 1)
    assert other["train_loss"] != first["train_loss"]  # another seed, another run


def test_steps_after_the_first_run_tuned_builds(monkeypatch):
    """The steady steps must not time chunk_scan's quick build: training waits for the tuned
    builds once, after the first step's clock stopped and before the second step starts."""
    events = []
    clock = T.StepClock
    monkeypatch.setattr("ssd.launch.wait_tuned", lambda *a: events.append("wait"))

    class Logged(clock):
        def start(self):
            events.append("start")
            super().start()

    monkeypatch.setattr(T, "StepClock", Logged)
    T.train(replace(TINY, steps=3), "torch", seed=0, device="cpu", progress=False)
    assert events == ["start", "wait", "start", "start"]


def test_record_is_well_formed(record, tmp_path):
    path = write_json(tmp_path / "training.json", record)
    back = json.loads(path.read_text())
    assert back["name"] == "tiny" and back["config"]["steps"] == TINY.steps
    assert back["task"] == dict(vocab_size=32, num_pairs=4, seq_len=32, power_a=0.01)
    assert "git_revision" in back["environment"] and back["device"] == "cpu"
    assert [(r["backend"], r["seed"]) for r in back["runs"]] == [("torch", 0), ("torch", 1)]
    assert [(f["backend"], f["seed"]) for f in back["failures"]] == [("reference", 0),
                                                                   ("reference", 1)]
    assert "NotImplementedError" in back["failures"][0]["error"]
    assert set(back["skipped"]) == {"cutile", "mamba_ssm"}
    for r in back["runs"]:
        assert len(r["train_loss"]) == len(r["step_ms"]) == TINY.steps
        assert r["eval_step"] == TINY.eval_points() == [0, 10, 20, 30]
        assert len(r["eval_loss"]) == len(r["eval_accuracy"]) == len(r["eval_step"])
        assert all(0 <= a <= 1 for a in r["eval_accuracy"])
        assert len(r["first_steps_ms"]) == TINY.timing_warmup
        assert r["steady"]["q20_ms"] <= r["steady"]["median_ms"] <= r["steady"]["q80_ms"]
        assert r["final_accuracy"] == r["eval_accuracy"][-1]
        assert r["timer"] == "perf_counter (CPU)" and r["peak_mem_mib"] is None
        if r["steps_to_target"] is not None:
            assert r["eval_accuracy"][r["eval_step"].index(r["steps_to_target"])] >= 0.9
    assert [row["backend"] for row in back["summary"]] == ["torch", "torch"]
    within = back["comparison"]["between_seeds"]
    assert len(within) == 1 and within[0]["mean_abs"] > 0
    assert back["comparison"]["between_backends"] == []
    assert back["comparison"]["within_noise"] is None


def test_curve_gaps_compares_backends_with_seeds():
    def rec(backend, seed, losses):
        return dict(backend=backend, seed=seed, eval_step=[0, 1, 2], eval_loss=losses)

    runs = [rec("a", 0, [3.0, 2.0, 1.0]), rec("b", 0, [3.0, 2.01, 1.02]),
            rec("a", 1, [3.0, 2.2, 1.1]), rec("b", 1, [3.0, 2.2, 1.11])]
    gaps = T.curve_gaps(runs)
    assert [g["seed"] for g in gaps["between_backends"]] == [0, 1]
    assert gaps["between_backends"][0]["mean_abs"] == pytest.approx(0.01)
    assert gaps["between_backends"][0]["max_abs"] == pytest.approx(0.02)
    assert [g["backend"] for g in gaps["between_seeds"]] == ["a", "b"]
    assert gaps["within_noise"] is True
    runs[1] = rec("b", 0, [3.0, 2.5, 1.5])  # a backend far off
    assert T.curve_gaps(runs)["within_noise"] is False


def test_report_prints_the_summary(record, capsys):
    T.report(record)
    out = capsys.readouterr().out
    assert "final acc" in out and "FAILED" in out and "SKIPPED" in out


# ----------------------------------------------------------------------------- step timer


def test_step_timer_on_a_tiny_stack():
    payload = T.step_sweep(T.SMOKE_STEP_SHAPES, ("torch", "cutile"),
                           chunk_size=T.SMOKE_STEP_CHUNK, precision="fp32", reps=2, warmup=1,
                           device="cpu", progress=False)
    assert set(payload["skipped"]) == {"cutile"} and payload["failures"] == []
    (row,) = payload["rows"]
    assert row["shape"] == "smoke" and row["backend"] == "torch" and row["n_layers"] == 2
    for key in ("step_ms", "ssd_fwd_ms", "ssd_fb_ms", "first_step_s"):
        assert row[key] > 0 and math.isfinite(row[key]), key
    assert row["ssd_ms_total"] == pytest.approx(2 * row["ssd_fb_ms"])
    assert row["ssd_share"] == pytest.approx(row["ssd_ms_total"] / row["step_ms"])
    assert payload["amdahl"] == []  # no mamba_ssm / cutile pair on the CPU
    assert payload["settings"]["mode"] == "eager" and "environment" in payload


def test_ssd_alone_repeats_the_layers_call():
    """The SSD's forward + backward timed alone runs on the layer's own tensors and upstream
    gradient: its gradient of dt_bias is the one the stack's backward accumulated (the stack
    has one layer here, so dt_bias gets nothing else)."""
    stack = Mamba2Stack(LM_CONFIG, 1, seed=0).requires_grad_(True)
    u = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(0))

    def step():
        stack(u).square().sum().backward()

    args, dy = T.capture_ssd_step(stack, step)
    assert dy.shape == args[0].shape  # y has x's shape
    forward, forward_backward = T.ssd_calls(stack.mixers[0].ssd, args, dy, "fp32", "cpu")
    assert forward().shape == args[0].shape
    grads = forward_backward()
    assert len(grads) == 7  # x, dt, A, B, C, D, dt_bias all require grad
    torch.testing.assert_close(grads[-1], stack.mixers[0].dt_bias.grad)


def test_cli_runs_both_parts(tmp_path, capsys):
    out = tmp_path / "t.json"
    for seed in ("0", "1"):  # two commands, one recording
        assert T.main(["mqar", "--preset", "tiny", "--backend", "torch", "--steps", "3",
                       "--set", "eval_every=3", "--seed", seed, "--device", "cpu", "--out",
                       str(out), "--no-progress"]) == 0
    back = json.loads(out.read_text())
    assert [(r["seed"], r["steps"]) for r in back["runs"]] == [(0, 3), (1, 3)]
    assert len(back["summary"]) == 2 and len(back["comparison"]["between_seeds"]) == 1
    out = tmp_path / "s.json"
    assert T.main(["step", "--suite", "smoke", "--backend", "torch", "--precision", "fp32",
                   "--reps", "1", "--layers", "1", "--device", "cpu", "--out", str(out),
                   "--no-progress"]) == 0
    assert json.loads(out.read_text())["rows"][0]["n_layers"] == 1
    assert "ssd share" in capsys.readouterr().out


def test_merge_keeps_other_rows_of_the_same_revision_and_settings():
    env = dict(git_revision="abc")
    row = lambda shape, backend, ms: dict(shape=shape, backend=backend, step_ms=ms,  # noqa: E731
                                          ssd_ms_total=ms / 2)
    old = dict(rows=[row("a", "mamba_ssm", 10.0), row("b", "mamba_ssm", 4.0)], failures=[],
               settings=dict(n_layers=2), environment=env, amdahl=[])
    new = dict(rows=[row("a", "cutile", 8.0), row("b", "mamba_ssm", 5.0)], failures=[],
               settings=dict(n_layers=2), environment=env, amdahl=[])
    merged = T.merge(old, new)
    assert [(r["shape"], r["backend"], r["step_ms"]) for r in merged["rows"]] == [
        ("a", "mamba_ssm", 10.0), ("a", "cutile", 8.0), ("b", "mamba_ssm", 5.0)]
    (a,) = merged["amdahl"]
    assert a["shape"] == "a" and a["measured"] == pytest.approx(10 / 8)
    assert T.merge(old, dict(new, settings=dict(n_layers=4))) == dict(new, settings=dict(
        n_layers=4))  # other settings: the new record alone
    assert T.merge(old, dict(new, environment=dict(git_revision="def")))["rows"] == new["rows"]


def test_mqar_data_split_is_disjoint_streams():
    train, held_out = T.make_data(replace(TINY, train_examples=256, eval_examples=64), "cpu")
    assert len(train) == 256 and len(held_out) == 64
    seen = {tuple(x) for x in train.inputs.tolist()}
    assert not any(tuple(x) in seen for x in held_out.inputs.tolist())
    assert np.array_equal(T.make_data(replace(TINY, train_examples=256, eval_examples=64),
                                      "cpu")[1].inputs.numpy(), held_out.inputs.numpy())
