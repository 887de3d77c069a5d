"""ssd.tools.endtoend on the CPU: Amdahl's law, the timer switch, and the share / prefill / sweep
pipeline end to end with the torch backend on tiny sizes (times are perf_counter wall times
here, so only their bookkeeping is checked, never their values)."""
import json
import math

import pytest

torch = pytest.importorskip("torch")

import ssd.layer as mamba2  # noqa: E402
from ssd.tools import endtoend  # noqa: E402
from ssd.tools.endtoend import (GateFailed, amdahl, amdahl_rows, cpu_time, gate,  # noqa: E402
                          main, merge, prefill, run, ssd_share, timer)
from ssd.layer import Mamba2Config, Mamba2Mixer, Mamba2Stack  # noqa: E402

TINY = Mamba2Config(d_model=32, d_state=8, headdim=16, ngroups=2, chunk_size=16, dtype="float32")


# ----------------------------------------------------------------------------- Amdahl


def test_amdahl_seed_example():
    """Half the time in the kernel, kernel 2x faster: the job is 1.33x faster, time -25 %."""
    s = amdahl(0.5, 2.0)
    assert s == pytest.approx(4 / 3)
    assert 1 - 1 / s == pytest.approx(0.25)


@pytest.mark.parametrize("share,speedup,expected", [
    (0.0, 10.0, 1.0),  # nothing of the job in the kernel
    (1.0, 3.0, 3.0),  # all of it
    (0.3, 1.0, 1.0),  # kernel unchanged
    (0.5, 0.5, 1 / 1.5),  # a slower kernel slows the job
    (0.9, 1e12, 10.0),  # the bound 1 / (1 - share)
    (0.25, 4.0, 1 / (0.75 + 0.0625)),
])
def test_amdahl_values(share, speedup, expected):
    assert amdahl(share, speedup) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("share,speedup,arg", [(-0.1, 2, "share"), (1.5, 2, "share"),
                                               (0.5, 0, "kernel_speedup"),
                                               (0.5, -1, "kernel_speedup"),
                                               (math.nan, 2, "share")])
def test_amdahl_rejects(share, speedup, arg):
    with pytest.raises(ValueError, match=arg):
        amdahl(share, speedup)


def test_amdahl_rows_pairs_base_and_new():
    rows = [dict(shape="a", backend="mamba_ssm", mixer_ms=10.0, ssd_ms=5.0),
            dict(shape="a", backend="cutile", mixer_ms=7.5, ssd_ms=2.5),
            dict(shape="b", backend="mamba_ssm", mixer_ms=4.0, ssd_ms=1.0),
            dict(shape="b", backend="cutile", mixer_ms=5.0, ssd_ms=2.0),  # ours slower
            dict(shape="c", backend="mamba_ssm", mixer_ms=1.0, ssd_ms=0.5)]  # no partner
    out = amdahl_rows(rows)
    assert [r["shape"] for r in out] == ["a", "b"]
    a, b = out
    assert a["share"] == 0.5 and a["kernel_speedup"] == 2.0
    assert a["predicted"] == pytest.approx(4 / 3) and a["measured"] == pytest.approx(4 / 3)
    assert a["max_possible"] == pytest.approx(2.0)
    assert b["kernel_speedup"] == 0.5 and b["predicted"] == pytest.approx(1 / (0.75 + 0.5))
    assert b["measured"] == pytest.approx(0.8)


# ----------------------------------------------------------------------------- timer


def test_cpu_time_keys_and_order():
    stats = cpu_time(lambda: sum(range(1000)), reps=7, warmup=1)
    assert set(stats) == {"median_ms", "q20_ms", "q80_ms", "min_ms", "reps"}
    assert 0 < stats["min_ms"] <= stats["q20_ms"] <= stats["median_ms"] <= stats["q80_ms"]
    assert cpu_time(lambda: None, reps=1, warmup=0)["reps"] == 1


def test_timer_uses_cuda_events_only_on_cuda(monkeypatch):
    seen = []

    def fake_time_fn(fn, *, mode, l2, reps, warmup):
        seen.append((mode, l2, reps, warmup))
        return dict(median_ms=1.0, q20_ms=0.9, q80_ms=1.1, min_ms=0.8, reps=reps)

    import ssd.tools.bench

    monkeypatch.setattr(ssd.tools.bench, "time_fn", fake_time_fn)
    cpu = timer(lambda: None, torch.device("cpu"), reps=3)
    assert cpu["timer"].startswith("perf_counter") and seen == []
    gpu = timer(lambda: None, torch.device("cuda"), mode="eager", l2="warm", reps=4, warmup=1)
    assert gpu["timer"] == "CUDA events" and seen == [("eager", "warm", 4, 1)]
    assert (gpu["mode"], gpu["l2"]) == ("eager", "warm")


# ----------------------------------------------------------------------------- share, prefill


def test_ssd_share_on_cpu():
    r = ssd_share(TINY, 2, 40, "torch", reps=3, device="cpu")
    assert r["dims"] == [2, 40, TINY.nheads, 16, 8, 2] and r["backend"] == "torch"
    assert r["mixer_ms"] > 0 and r["ssd_ms"] > 0 and r["rest_ms"] > 0
    assert r["share"] == pytest.approx(r["ssd_ms"] / r["mixer_ms"])
    assert r["share_by_rest"] == pytest.approx(1 - r["rest_ms"] / r["mixer_ms"])
    assert r["mixer"]["q20_ms"] <= r["mixer"]["median_ms"] <= r["mixer"]["q80_ms"]
    assert r["timer"].startswith("perf_counter") and r["gate_rel_err"] is None
    json.dumps(r)  # JSON-able


def test_ssd_share_gates_another_backend():
    """A backend other than torch is compared with the torch backend before timing."""
    mixer = Mamba2Mixer(TINY, "torch", seed=1)
    r = ssd_share(TINY, 1, 24, "reference", reps=1, device="cpu", rest=False, mixer=mixer)
    assert 0 < r["gate_rel_err"] < endtoend.GATE_TOL["float32"]
    assert "rest_ms" not in r and mixer.backend == "reference"


def test_gate_catches_a_wrong_backend(monkeypatch):
    real = mamba2.backend_function

    def broken(x, *args, **kwargs):
        return 1.2 * mamba2.ssd_torch(x, *args, **kwargs)  # 20 % off

    monkeypatch.setattr(mamba2, "backend_function",
                        lambda name: broken if name == "reference" else real(name))
    mixer = Mamba2Mixer(TINY, "reference")
    u = torch.randn(1, 24, TINY.d_model)
    with pytest.raises(GateFailed, match="reference"):
        gate(mixer, u)
    assert mixer.backend == "reference"  # restored after the comparison


def test_hook_captures_what_the_mixer_passes():
    """The SSD timed alone gets exactly the tensors the layer hands it."""
    mixer = Mamba2Mixer(TINY, seed=2)
    u = torch.randn(2, 40, TINY.d_model)
    out, calls = mamba2.capture_ssd_calls(mixer, u)
    x, dt, A, B, C, D, dt_bias = calls[0]
    assert x.shape == (2, 40, TINY.nheads, TINY.headdim) and B.shape == (2, 40, 2, 8)
    assert x.stride(-1) == 1 and B.stride(-1) == 1  # no copy needed inside the SSD
    assert torch.equal(out, mixer(u))
    stack = Mamba2Stack(TINY, 3)
    _, calls = mamba2.capture_ssd_calls(stack, u)
    assert len(calls) == 3
    _, calls = mamba2.capture_ssd_calls(stack, u, limit=1)
    assert len(calls) == 1


def test_prefill_on_cpu():
    r = prefill(TINY, 2, 2, 40, "torch", reps=2, device="cpu")
    assert (r["n_layers"], r["batch"], r["seqlen"], r["tokens"]) == (2, 2, 40, 80)
    assert r["tokens_per_s"] == pytest.approx(80 / (r["latency_ms"] * 1e-3))
    assert r["ssd_ms_total"] == pytest.approx(2 * r["ssd_ms_per_layer"])
    assert r["ssd_share"] == pytest.approx(r["ssd_ms_total"] / r["latency_ms"])
    stack = Mamba2Stack(TINY, 3)
    assert prefill(TINY, 99, 1, 16, "torch", reps=1, device="cpu", stack=stack,
                   measure_ssd=False)["n_layers"] == 3


# ----------------------------------------------------------------------------- sweep, CLI


def test_run_writes_results_and_merges(tmp_path):
    out = tmp_path / "endtoend.json"
    shape = endtoend.SMOKE_SHAPES[0]
    grid = [(mamba2.config_for_shape(shape, chunk_size=32, dtype="float32"), 1, 40)]
    payload = run([shape], ("torch", "cutile"), grid, reps=2, prefill_reps=1, n_layers=2,
                  chunk_size=32, dtype="float32", device="cpu", out=out, progress=False)
    disk = json.loads(out.read_text())
    assert disk["environment"]["python"] and disk == json.loads(json.dumps(payload))
    share, pre = disk["share"], disk["prefill"]
    assert [(r["shape"], r["backend"]) for r in share["rows"]] == [("smoke", "torch")]
    assert [(r["n_layers"], r["batch"], r["seqlen"]) for r in pre["rows"]] == [(2, 1, 40)]
    if not torch.cuda.is_available():
        assert "cutile" in share["skipped"] and "no CUDA GPU" in share["skipped"]["cutile"]
    assert share["failures"] == [] and pre["failures"] == []
    assert share["environment"] == disk["environment"]
    # a second run of one part replaces its rows and keeps the other part
    old_prefill = pre
    again = run([shape], ("torch",), grid, parts=("share",), reps=2, chunk_size=32,
                dtype="float32", device="cpu", out=out, progress=False)
    assert again["prefill"] == old_prefill
    assert len(again["share"]["rows"]) == 1
    # ... but never a part recorded at another revision: one recording, one revision
    disk = json.loads(out.read_text())
    disk["environment"]["git_revision"] = "another"
    out.write_text(json.dumps(disk))
    third = run([shape], ("torch",), grid, parts=("share",), reps=2, chunk_size=32,
                dtype="float32", device="cpu", out=out, progress=False)
    assert "prefill" not in third and "prefill" not in json.loads(out.read_text())


def test_merge_replaces_rows_by_key():
    old = dict(share=dict(rows=[dict(shape="a", backend="cutile", mixer_ms=2.0, ssd_ms=1.0),
                                dict(shape="b", backend="cutile", mixer_ms=2.0, ssd_ms=1.0)],
                          failures=[dict(shape="a", backend="mamba_ssm", error="x")]),
               environment={"date": "old"})
    new = dict(share=dict(rows=[dict(shape="a", backend="cutile", mixer_ms=3.0, ssd_ms=1.0),
                                dict(shape="a", backend="mamba_ssm", mixer_ms=4.0, ssd_ms=2.0)],
                          failures=[], skipped={}, settings={}),
               environment={"date": "new"})
    m = merge(old, new)
    rows = {(r["shape"], r["backend"]): r["mixer_ms"] for r in m["share"]["rows"]}
    assert rows == {("a", "cutile"): 3.0, ("b", "cutile"): 2.0, ("a", "mamba_ssm"): 4.0}
    assert m["share"]["failures"] == []  # the failed row was redone
    assert m["environment"] == {"date": "new"}
    assert [a["shape"] for a in m["share"]["amdahl"]] == ["a"]


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "e.json"
    assert main(["--suite", "smoke", "--backend", "torch", "--reps", "2", "--prefill-reps", "1",
                 "--layers", "2", "--device", "cpu", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "smoke" in text and "tokens/s" in text and str(out) in text
    disk = json.loads(out.read_text())
    assert disk["share"]["rows"][0]["dtype"] == "float32"
    assert disk["prefill"]["rows"][0]["n_layers"] == 2


def test_presets_in_the_prefill_grid():
    assert {name for name, _, _ in endtoend.PREFILL_GRID} <= set(mamba2.PRESETS)
    assert {name for name, _, _ in endtoend.QUICK_PREFILL_GRID} <= set(mamba2.PRESETS)


def test_each_backend_at_its_own_chunk_size(tmp_path):
    """chunk_sizes calls one backend's SSD at another chunk size than the layer's: the rows
    and settings record it, the output does not change beyond rounding, and the next backend
    on the same (reused) mixer or stack gets the layer's chunk size back."""
    shape = endtoend.SMOKE_SHAPES[0]
    config = mamba2.config_for_shape(shape, chunk_size=32, dtype="float32")
    grid = [(config, 1, 40)]
    payload = run([shape], ("torch", "reference"), grid, reps=1, prefill_reps=1, n_layers=2,
                  chunk_size=32, chunk_sizes={"torch": 16}, dtype="float32", device="cpu",
                  progress=False)
    for part in ("share", "prefill"):
        rows = {r["backend"]: r["chunk_size"] for r in payload[part]["rows"]}
        assert rows == {"torch": 16, "reference": 32}, part
        assert payload[part]["settings"]["chunk_sizes"] == {"torch": 16}
    mixer = Mamba2Mixer(config, "torch", seed=0)
    u = torch.randn(1, 40, config.d_model)
    at32 = mixer(u)
    at16 = mixer.set_backend("torch", 16)(u)
    assert mixer.ssd.chunk_size == 16
    assert torch.allclose(at16, at32, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not run"):
        run([shape], ("torch",), grid, chunk_sizes={"cutile": 128}, device="cpu", progress=False)


@pytest.mark.parametrize("spec", ["cutile", "cutile=big", "=128x"])
def test_cli_rejects_a_malformed_chunk_size(spec, capsys):
    with pytest.raises(SystemExit):
        main(["--suite", "smoke", "--backend", "torch", "--device", "cpu", "--chunk-size", spec])
    assert "expected BACKEND=Q" in capsys.readouterr().err


# ----------------------------------------------------------------------------- both layers, floor


def test_rest_floor_counts_what_the_layer_moves():
    """ssd.cost.rest_floor against counts taken from the layer's own tensors: the projections'
    FLOPs from their weights, the conv's and norm's bytes from the tensors the SSD gets (the
    conv's output is x, B, C; the norm reads y, shaped as x, and z, and writes as much)."""
    from ssd.cost import rest_floor

    mixer = Mamba2Mixer(TINY, seed=3)
    b, l = 2, 24
    _, calls = mamba2.capture_ssd_calls(mixer, torch.randn(b, l, TINY.d_model))
    x, dt, A, B, C, D, dt_bias = calls[0]
    e, t = x.element_size(), b * l
    conv_w = mixer.conv1d.weight.numel() + mixer.conv1d.bias.numel()
    flops = 2 * t * (mixer.in_proj.weight.numel() + mixer.out_proj.weight.numel())
    conv = e * (2 * (x.numel() + B.numel() + C.numel()) + conv_w)
    norm = e * 3 * x.numel() + mixer.norm.weight.numel() * mixer.norm.weight.element_size()
    ceilings = dict(copy_bytes_per_s=3e9, bf16_flops_per_s=7e11)
    f = rest_floor(TINY, b, l, ceilings)
    assert (f["proj_flops"], f["conv_bytes"], f["norm_bytes"]) == (flops, conv, norm)
    assert f["floor_ms"] == pytest.approx(1e3 * (flops / 7e11 + (conv + norm) / 3e9))
    assert f["floor_ms"] == pytest.approx(f["proj_ms"] + f["bytes_ms"])
    with pytest.raises(ValueError, match="ceilings"):
        rest_floor(TINY, b, l, dict(copy_bytes_per_s=0.0, bf16_flops_per_s=1.0))


def test_plain_output_is_the_plain_layer_and_restores_the_mixer():
    mixer = Mamba2Mixer(TINY, "reference", seed=4).set_backend("reference", 8)
    u = torch.randn(1, 24, TINY.d_model)
    plain = Mamba2Mixer(TINY, "torch", seed=4).set_backend("torch", 8)(u)
    assert torch.equal(endtoend.plain_output(mixer, u), plain)
    assert (mixer.backend, mixer.ssd.chunk_size, mixer.kernels) == ("reference", 8, "torch")


@pytest.fixture(scope="module")
def share_record(tmp_path_factory):
    """The share part of a CPU run on the smoke shape: the torch SSD in the plain layer (the
    fast layer's kernels need a GPU), projections, the floor."""
    out = tmp_path_factory.mktemp("share") / "endtoend.json"
    shape = endtoend.SMOKE_SHAPES[0]
    run([shape], ("torch",), (), parts=("share",), reps=2, chunk_size=32, dtype="float32",
        device="cpu", out=out, progress=False)
    return shape, out, json.loads(out.read_text())


def test_share_record_schema(share_record):
    from ssd.cost import rest_floor

    shape, _, disk = share_record
    part = disk["share"]
    ceil = part["ceilings"]
    assert ceil["copy_bytes_per_s"] > 0 and ceil["bf16_flops_per_s"] > 0
    assert part["settings"]["kernels"] == ["torch"]
    if not torch.cuda.is_available():
        assert "kernels:cutile" in part["skipped"] and "mamba_ssm" in part["skipped"]
    (r,) = part["rows"]
    assert (r["shape"], r["backend"], r["kernels"]) == (shape.name, "torch", "torch")
    assert r["rest_diff_ms"] == pytest.approx(r["mixer_ms"] - r["ssd_ms"])
    config = mamba2.config_for_shape(shape, chunk_size=32, dtype="float32")
    assert r["rest_floor"] == pytest.approx(rest_floor(config, shape.b, shape.l, ceil))
    assert r["rest_floor_ms"] == r["rest_floor"]["floor_ms"]
    assert r["rest_over_floor"] == pytest.approx(r["rest_diff_ms"] / r["rest_floor_ms"])
    pr, t = r["projections"], shape.b * shape.l
    assert pr["in_proj_flops"] == 2 * t * config.d_model * config.d_in_proj
    assert pr["out_proj_flops"] == 2 * t * config.d_inner * config.d_model
    for name in ("in_proj", "out_proj"):
        rate = pr[f"{name}_flops"] / (pr[f"{name}_ms"] * 1e-3)
        assert pr[f"{name}_tflops"] == pytest.approx(rate / 1e12)
        assert pr[f"{name}_of_ceiling"] == pytest.approx(rate / ceil["bf16_flops_per_s"])


def test_a_merged_run_keeps_the_recorded_ceilings(share_record):
    """Every floor of one recording comes from one measurement of the ceilings; rows are
    keyed by shape, backend and layer."""
    shape, out, disk = share_record
    again = run([shape], ("torch",), (), parts=("share",), reps=1, chunk_size=32,
                dtype="float32", device="cpu", out=out, progress=False)
    assert again["share"]["ceilings"] == disk["share"]["ceilings"]
    assert len(again["share"]["rows"]) == 1
    assert endtoend.ROW_KEYS["share"] == ("shape", "kernels", "backend")


def test_amdahl_pairs_within_one_layer():
    rows = [dict(shape="a", kernels=k, backend=b, mixer_ms=m, ssd_ms=s)
            for k, b, m, s in (("torch", "mamba_ssm", 10.0, 2.0), ("torch", "cutile", 9.0, 1.0),
                               ("cutile", "mamba_ssm", 4.0, 2.0), ("cutile", "cutile", 3.0, 1.0),
                               (endtoend.PEER_KERNELS, "mamba_ssm", 5.0, 2.0))]
    out = amdahl_rows(rows, key=endtoend.AMDAHL_KEYS["share"])
    assert [(a["kernels"], a["share"], a["measured"]) for a in out] == [
        ("torch", 2.0 / 10.0, 10.0 / 9.0), ("cutile", 2.0 / 4.0, 4.0 / 3.0)]
    # the same kernel gain, a larger share in the faster layer: a larger predicted speedup
    assert out[1]["predicted"] > out[0]["predicted"]


def _fake_mamba_ssm(root):
    """A stand-in mamba_ssm package with the parts peer_share touches: an unfused Mamba2 whose
    SSD is the module-level ``mamba_chunk_scan_combined`` (here ssd.layer.ssd_torch)."""
    pkg = root / "mamba_ssm"
    for sub in ("", "ops", "ops/triton", "modules"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "ops" / "triton" / "ssd_combined.py").write_text(
        "from ssd.layer import ssd_torch as mamba_chunk_scan_combined\n"
        "causal_conv1d_fwd_function = None\n")
    (pkg / "modules" / "mamba2.py").write_text('''
import torch
from torch import nn
from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
from ssd.layer import GatedRMSNorm, causal_conv1d_torch

causal_conv1d_fn = None


class Mamba2(nn.Module):
    def __init__(self, d_model, d_state, d_conv, expand, headdim, ngroups, chunk_size, dt_limit,
                 use_mem_eff_path, device, dtype):
        super().__init__()
        assert not use_mem_eff_path
        self.p, self.g, self.n, self.chunk_size = headdim, ngroups, d_state, chunk_size
        self.d_inner = d_inner = expand * d_model
        self.h, conv_dim = d_inner // headdim, d_inner + 2 * ngroups * d_state
        kw = dict(device=device, dtype=dtype)
        self.in_proj = nn.Linear(d_model, d_inner + conv_dim + self.h, bias=False, **kw)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim,
                                padding=d_conv - 1, **kw)
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.zeros(self.h)) for _ in range(3))
        self.norm = GatedRMSNorm(d_inner, d_inner // ngroups)
        self.out_proj = nn.Linear(d_inner, d_model, bias=False, **kw)

    def forward(self, u):
        z, xBC, dt = torch.split(self.in_proj(u), [self.d_inner, self.conv1d.in_channels, self.h],
                                 dim=-1)
        x, B, C = torch.split(causal_conv1d_torch(xBC, self.conv1d),
                              [self.d_inner, self.g * self.n, self.g * self.n], dim=-1)
        y = mamba_chunk_scan_combined(x.unflatten(-1, (self.h, self.p)), dt,
                                      -torch.exp(self.A_log), B.unflatten(-1, (self.g, self.n)),
                                      C.unflatten(-1, (self.g, self.n)), self.chunk_size, D=self.D,
                                      dt_bias=self.dt_bias, dt_softplus=True)
        return self.out_proj(self.norm(y.flatten(-2), z))
''')


def test_peer_share_times_the_module_with_the_layers_weights(tmp_path, monkeypatch):
    import sys

    _fake_mamba_ssm(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        mixer = Mamba2Mixer(TINY, "torch", seed=5)
        ceilings = dict(copy_bytes_per_s=1e9, bf16_flops_per_s=1e10)
        r = endtoend.peer_share(mixer, 2, 40, reps=2, tune=False, ceilings=ceilings)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
            del sys.modules[name]
    assert (r["backend"], r["kernels"]) == ("mamba_ssm", endtoend.PEER_KERNELS)
    assert r["path"]["fused"] is False and "nn.Conv1d" in r["path"]["conv"]
    assert "Triton" in r["path"]["norm"] and r["ssd_timed_on"] == "the tensors Mamba2 passed"
    assert r["gate_rel_err"] < 1e-5  # the same weights: the same function as the plain layer
    assert r["rest_ms"] > 0 and r["rest_diff_ms"] == pytest.approx(r["mixer_ms"] - r["ssd_ms"])
    assert r["chunk_size"] == TINY.chunk_size and r["rest_floor_ms"] > 0
    json.dumps(r)


def test_cli_shapes(tmp_path, capsys):
    out = tmp_path / "e.json"
    with pytest.raises(SystemExit):
        main(["--suite", "models", "--shapes", "nonesuch", "--device", "cpu", "--out", str(out)])
    assert "nonesuch" in capsys.readouterr().err and not out.exists()


def test_a_failing_mamba2_import_keeps_the_loaded_triton_modules(tmp_path, monkeypatch):
    """Where mamba_ssm's package __init__ fails, its Triton SSD loads through a bare package;
    if its Mamba2 module then fails to import (a dependency missing), the peer is unavailable
    and the SSD module already loaded stays the one the layer holds."""
    import sys

    from ssd.tools import peers

    _fake_mamba_ssm(tmp_path)
    (tmp_path / "mamba_ssm" / "__init__.py").write_text("import selective_scan_cuda_missing\n")
    modules = tmp_path / "mamba_ssm" / "modules"
    (modules / "mamba2.py").write_text("import huggingface_hub_missing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
        monkeypatch.delitem(sys.modules, name)
    try:
        forward = peers.mamba_ssm_forward()
        loaded = sys.modules["mamba_ssm.ops.triton.ssd_combined"]
        with pytest.raises(peers.PeerUnavailable, match="huggingface_hub_missing"):
            peers.mamba_ssm_mixer(Mamba2Mixer(TINY))
        assert sys.modules["mamba_ssm.ops.triton.ssd_combined"] is loaded
        assert peers.mamba_ssm_forward() is forward
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "mamba_ssm"]:
            del sys.modules[name]
