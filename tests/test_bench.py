"""CPU tests of the benchmark bookkeeping: the floor model, best-of and speedup tables, the
recorded-results plumbing the GPU chapters use, and the results folder names."""
import json
import math
import os
import sys
from dataclasses import asdict, replace

import pytest

from ssd.tools import bench
from ssd.book import recordings
from ssd.config import (CHUNK64_SCAN, GROUPED_WALK, NARROW_STATE, ONE_WAVE_CHUNK, ONE_WAVE_STATE,
                        SMALL_STATE_AT, SMALL_STATE_SCAN, FusedScanConfig, default_config)
from ssd.tools.env import gpu_slug


def test_floor_by_hand_on_a_tiny_shape():
    # b=l-only problem: b1 l256 h1 p1 n1 g1. Bytes: x and y (2*256), dt (256), B and C (2*256)
    # at 2 bytes, plus one fp32 final state: 2564. FLOPs at q (c = 256/q chunks), diagonal
    # blocks halved: 1536 + 2c + 2 c q^2 -> q=64: 34312, q=128: 67076, q=256: 132610.
    shape = bench.Shape("tiny", 1, 256, 1, 1, 1, 1)
    f = bench.floor_ms(shape, dict(copy_bytes_per_s=1e9, bf16_flops_per_s=1e9))
    assert f["floor_bytes"] == 2564
    assert f["floor_flops"] == 34312
    assert f["floor_bound"] == "compute"
    assert f["floor_ms"] == pytest.approx(34312 / 1e9 * 1e3)
    g = bench.floor_ms(shape, dict(copy_bytes_per_s=1e3, bf16_flops_per_s=1e12))
    assert g["floor_bound"] == "memory" and g["floor_ms"] == pytest.approx(2564 / 1e3 * 1e3)


def _rec(shape, impl, q, ms, mode="graph", l2="flushed"):
    return dict(shape=shape, impl=impl, chunk_size=q, median_ms=ms, mode=mode, l2=l2)


def test_best_records_and_speedups():
    records = [_rec("a", "ssd", 256, 1.0), _rec("a", "mamba_ssm", 64, 3.0),
               _rec("a", "mamba_ssm", 256, 2.0), _rec("b", "ssd", 256, 2.0),
               _rec("b", "mamba_ssm", 128, 8.0), _rec("b", "mamba_ssm", 128, 0.1, mode="eager")]
    best = bench.best_records(records, "mamba_ssm")
    assert best["a"]["chunk_size"] == 256 and best["b"]["median_ms"] == 8.0
    sp = bench.speedups(records)
    assert sp["a"] == pytest.approx(2.0) and sp["b"] == pytest.approx(4.0)
    assert sp["geomean"] == pytest.approx(math.sqrt(8.0))


def test_ours_is_timed_at_every_suite_chunk_size_and_counted_at_its_fastest():
    # ours, like mamba_ssm, at 64/128/256 (the callables are built, not run: no GPU here)
    inputs = bench.make_inputs(bench.Shape("tiny", 1, 128, 2, 8, 8, 1), "float32", device="cpu")
    table, _ = bench.implementations(inputs, names=("ssd",))
    assert sorted(table["ssd"]) == list(bench.SUITE_CHUNKS)
    # its stage times go with its fastest graph-replay, L2-flushed record
    records = [_rec("a", "ssd", 64, 1.0), _rec("a", "ssd", 128, 2.0),
               _rec("a", "ssd", 256, 0.5, mode="eager"), _rec("a", "ssd", 256, 0.7, l2="warm")]
    assert bench.fastest_chunk(records, "a", "ssd") == 64
    assert bench.fastest_chunk(records, "b", "ssd") is None
    assert bench.fastest_chunk(records, "a", "mamba_ssm") is None


def test_suites_have_the_issue_shapes():
    dims = {s.name: s.dims for s in bench.SUITES["models"]}
    assert dims == {"130m": (8, 2048, 24, 64, 128, 1), "2.7b": (4, 4096, 80, 64, 128, 1),
                    "long-16k": (1, 16384, 80, 64, 128, 1),
                    "codestral-7b": (2, 8192, 128, 64, 128, 8),
                    "small-state": (16, 1024, 32, 64, 64, 1)}
    assert all(s.b * s.l == 65536 for s in bench.SUITES["seqlen"])


_BASE = default_config((9, 0))
_NARROW = replace(_BASE, state=replace(_BASE.state, **NARROW_STATE))
_SMALL = replace(_BASE, scan=replace(_BASE.scan, **SMALL_STATE_SCAN))
_ONE_WAVE = replace(_BASE, state=replace(_BASE.state, **ONE_WAVE_STATE))
_GROUPED = replace(_BASE, state=replace(_BASE.state, **ONE_WAVE_STATE, groups=GROUPED_WALK))


def _at64(cfg):
    """``cfg`` with chunk_scan's hint at chunk 64 (CHUNK64_SCAN), where its tiles take it."""
    return cfg if cfg.scan.whole_chunk else replace(cfg, scan=replace(cfg.scan, **CHUNK64_SCAN))


@pytest.mark.parametrize("dims, at64, elsewhere", [
    (None, _BASE, _BASE),
    ((8, 2048, 24, 64, 128, 1), _BASE, _BASE),            # 130m
    ((4, 4096, 80, 64, 128, 1), _ONE_WAVE, _BASE),        # 2.7b: whole states in one wave at 64
    ((1, 16384, 80, 64, 128, 1), _GROUPED, _NARROW),      # long-16k: few stage-2 blocks
    ((2, 8192, 128, 64, 128, 8), _BASE, _BASE),           # codestral-7b
    # small-state: whole-chunk scan tiles, at 128 with the hint of 2, 64-row tiles at 256
    ((16, 1024, 32, 64, 64, 1), _SMALL, {q: replace(_SMALL, scan=replace(_SMALL.scan, **at))
                                         for q, at in SMALL_STATE_AT.items()}),
])
def test_config_space_varies_one_factor_at_a_time_around_the_default(dims, at64, elsewhere):
    """On 132 SMs: the first point is what the API ships for the shape at OUR_CHUNK, the chunk-size
    points what it ships at 128 and 256, and every other point changes one stage of the default
    at OUR_CHUNK, none repeating it; the narrow point is the API's narrow slices (on 2.7b too,
    not its whole states narrowed) and no scan tile exceeds a chunk (it would be clamped back)."""
    assert bench.OUR_CHUNK == ONE_WAVE_CHUNK  # the 2.7b case's premise
    space = bench.config_space(dims, 132)
    factor, q0, shipped = space[0]
    # 130m, codestral-7b and small-state run stages 2 and 3 as one kernel at 64: the points
    # vary the three stages it configures, beside the one kernel's own
    one_kernel = dims is not None and dims[0] * dims[2] in (192, 256, 512)
    d = replace(shipped, fused_scan=FusedScanConfig())
    assert shipped.fused_scan.enabled is one_kernel
    assert (factor, q0, d) == ("default", bench.OUR_CHUNK, _at64(at64))
    assert dims is None or shipped == bench.shape_default(dims, 132)   # what the API picks there
    own = [(f, cfg.fused_scan) for f, _, cfg in space if f.startswith("one kernel")]
    assert own == ([("one kernel", FusedScanConfig())]
                   + [(f"one kernel {k}", replace(shipped.fused_scan, **{k: v}))
                      for k, v in (("block_p", 32), ("occupancy", None), ("occupancy", 3))]
                   if one_kernel else [])
    space = [(f, q, cfg) for f, q, cfg in space if not f.startswith("one kernel")]
    assert {q: c for f, q, c in space if f == "chunk size"} == (
        elsewhere if isinstance(elsewhere, dict) else {128: elsewhere, 256: elsewhere})
    narrow = [cfg.state for f, _, cfg in space if f == "state narrow"]
    assert narrow == ([] if at64 is _NARROW else [_NARROW.state])
    for factor, q, cfg in space[1:]:
        assert cfg.scan.block_m <= q, factor
        if factor == "chunk size":
            continue
        assert q == q0, factor
        changed = [f for f in ("state", "scan") if getattr(cfg, f) != getattr(d, f)]
        assert len(changed) == 1, factor
    labels = [bench.config_label(q, c) for _, q, c in space]
    assert len(set(labels)) == len(labels)


def test_recorded_results_replay_on_a_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(recordings, "RESULTS", tmp_path)
    monkeypatch.setattr(recordings, "DEFAULT_GPU", "h200")  # the book's GPU, whichever it is
    monkeypatch.setattr(recordings, "gpu_available", lambda: False)
    with pytest.raises(FileNotFoundError, match="no recorded result"):
        recordings.live_or_recorded("thing", lambda: {"never": "called"})
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "thing.json").write_text(json.dumps(
        {"value": 3, "environment": {"gpu": "NVIDIA H200", "date": "d", "git_revision": "r"}}))
    got = recordings.live_or_recorded("thing", lambda: {"never": "called"})
    assert got["value"] == 3 and got["source"] == "recorded"
    assert "No GPU here" in capsys.readouterr().out


def test_a_gpu_machine_reads_its_own_nested_recording_or_the_books(tmp_path, monkeypatch):
    # On a GPU, "tilegym_tuned/130m" is read from results/<this GPU>/tilegym_tuned/ when that GPU
    # recorded it, else from the book's results/h200/ (a nested name is not a GPU's folder).
    import torch

    monkeypatch.setattr(recordings, "RESULTS", tmp_path)
    monkeypatch.setattr(recordings, "DEFAULT_GPU", "h200")
    monkeypatch.setattr(recordings, "gpu_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    for gpu, v in (("h200", "book"), ("h100", "own")):
        (tmp_path / gpu / "tilegym_tuned").mkdir(parents=True)
        (tmp_path / gpu / "tilegym_tuned" / "130m.json").write_text(json.dumps({"v": v}))
    (tmp_path / "h200" / "tilegym_tuned" / "2.7b.json").write_text(json.dumps({"v": "book"}))
    assert recordings.load_recorded("tilegym_tuned/130m")["v"] == "own"
    assert recordings.load_recorded("tilegym_tuned/2.7b")["v"] == "book"


def test_live_measurement_is_recorded_with_its_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(recordings, "RESULTS", tmp_path)
    monkeypatch.setattr(recordings, "gpu_available", lambda: True)
    monkeypatch.setattr(recordings, "environment", lambda: {"gpu": "NVIDIA H100 80GB HBM3"})
    got = recordings.live_or_recorded("thing", lambda: {"value": 7})
    assert got["source"] == "live"
    saved = json.loads((tmp_path / "h100" / "thing.json").read_text())
    assert saved == {"value": 7, "environment": {"gpu": "NVIDIA H100 80GB HBM3"}}


def test_glue_refuses_strings_that_would_render_with_quotes():
    for text in ("each shape's fastest", "`chunk_scan`"):
        with pytest.raises(ValueError, match="plain text"):
            recordings.glue("name", text, display=False)


def test_glue_stores_numpy_scalars_as_numbers(monkeypatch):
    """The book formats a glued number from its stored text/plain; np.float64's repr in NumPy 2
    (``np.float64(...)``) is no number, and -W fails the build on it."""
    import numpy as np

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda bundle, **kw: shown.append(bundle))
    recordings.glue("err", np.float64(1.5e-16), display=False)
    recordings.glue("n", np.int64(3), display=False)
    assert [b["application/papermill.record/text/plain"] for b in shown] == ["1.5e-16", "3"]


@pytest.mark.parametrize("name,slug", [("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA GeForce RTX 5090", "5090"), (None, "cpu")])
def test_results_folder_names(name, slug):
    assert gpu_slug({"gpu": name}) == slug


def test_gate_passes_the_reference_and_fails_a_wrong_output():
    torch = pytest.importorskip("torch")
    from ssd.reference import ssd_chunked

    shape = bench.Shape("tiny-g2", 2, 300, 4, 8, 16, 2)
    inputs = bench.make_inputs(shape, dtype="float32", device="cpu")
    np64 = {k: v.double().numpy() for k, v in inputs.items()}
    y = torch.from_numpy(ssd_chunked(np64["x"], np64["dt"], np64["A"], np64["B"], np64["C"], 64,
                                     D=np64["D"], dt_bias=np64["dt_bias"], dt_softplus=True))
    gate = bench.Gate(shape, inputs)
    assert 0 <= gate(y) < 1e-12
    wrong = y.clone()
    wrong[-1, :, -1] *= 1.1  # the last head of the last batch row: inside the gated slice
    assert gate(wrong) < 0
    outside = y.clone()
    outside[0, :, 0] = float("nan")  # outside the gated slice: not seen
    assert 0 <= gate(outside) < 1e-12
    y_nan = y.clone()
    y_nan[-1, 0, -1, 0] = float("nan")
    assert gate(y_nan) == float("inf")
    with pytest.raises(ValueError, match="^heads"):
        bench.Gate(shape, inputs, heads=3)


def test_vary_space_is_one_point_per_value_around_the_default():
    space = bench.vary_space(["state.block_k=16,32", "scan.occupancy=None,3", "q=256",
                              "scan.block_m=32+scan.block_s=32"])
    d = default_config((9, 0), chunk_size=bench.OUR_CHUNK)   # what ships at the default point
    assert space[0] == ("default", bench.OUR_CHUNK, d)
    assert [c.state.block_k for _, _, c in space[1:3]] == [16, 32]
    assert [c.scan.occupancy for _, _, c in space[3:5]] == [None, 3]
    assert space[5] == ("q=256", 256, d)
    assert (space[6][2].scan.block_m, space[6][2].scan.block_s) == (32, 32) and len(space) == 7
    labels = [bench.config_label(q, c) for _, q, c in space]
    assert len(set(labels)) == len(labels) and " k16 " in labels[1]
    # The study's own points keep their labels: block_k etc. show only when changed.
    assert all(" k" not in bench.config_label(q, c) for _, q, c in bench.config_space())


def test_vary_space_around_a_shapes_shipped_default():
    # long-16k (one sequence) ships the narrow stage-2 slices; a point around it keeps them
    dims = next(s for s in bench.SUITES["models"] if s.name == "long-16k").dims
    shipped = bench.shape_default(dims, sms=132)
    assert shipped != default_config((9, 0))
    space = bench.vary_space(["scan.block_h=1"], shipped)
    assert space[0][2] == shipped and space[1][2].state == shipped.state
    assert space[1][2].scan.block_h == 1


def test_study_points_are_built_for_every_shape_before_any_is_timed():
    # --vary scan.persistent=False is valid around most shipped defaults but not around
    # whole-chunk tiles (small-state's at chunk 128), which a study would find out on its last shape. Building every shape's points first turns that into an error before
    # any timing.
    shapes = [s for s in bench.SUITES["models"] if s.name in ("2.7b", "small-state")]
    space = lambda shape, sms: bench.vary_space(  # noqa: E731
        ["scan.persistent=False"], bench.shape_default(shape.dims, sms, chunk_size=128))
    with pytest.raises(ValueError, match="whole_chunk"):
        bench.study_points(shapes, space, sms=132)
    ok = bench.study_points(shapes[:1], space, sms=132)
    assert [f for f, _, _ in ok["2.7b"]] == ["default", "scan.persistent=False"]


def test_study_ratios_set_each_point_against_its_runs_default():
    row = lambda shape, factor, ms, scan=None: dict(  # noqa: E731
        shape=shape, factor=factor, label=factor, median_ms=ms,
        **({"stages": {"chunk_scan": scan, "chunk_cumsum": 1.0}} if scan else {}))
    rows = [row("a", "default", 2.0, 4.0), row("a", "x", 1.0, 1.0), row("b", "default", 1.0), row("b", "y", 3.0)]
    got = bench.study_ratios(rows)
    assert got["a"] == [("default", "default", 1.0, {"chunk_scan": 1.0, "chunk_cumsum": 1.0}),
                        ("x", "x", 0.5, {"chunk_scan": 0.25, "chunk_cumsum": 1.0})]
    assert got["b"] == [("default", "default", 1.0, {}), ("y", "y", 3.0, {})]


def test_study_ratios_read_stage_factors_around_a_one_kernel_default_against_its_three_stages():
    row = lambda factor, ms: dict(shape="a", factor=factor, label=factor, median_ms=ms)  # noqa: E731
    rows = [row("default", 1.0), row("chunk size", 2.0), row("one kernel", 1.25),
            row("one kernel occupancy", 1.5), row("scan occupancy", 1.0)]
    assert [fwd for _, _, fwd, _ in bench.study_ratios(rows)["a"]] == [1.0, 2.0, 1.25, 1.5, 0.8]
    assert bench.study_reference(rows, rows[4]) is rows[2]
    assert bench.study_reference(rows, rows[3]) is rows[0]


def test_stages_and_around_are_study_options(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--suite", "models", "--stages"])
    assert "--stages goes with --suite study" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--suite", "study", "--around", "global"])
    assert "--around goes with --vary" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [("state.block_q=16", "unknown field"),
                                           ("stage.block_k=16", "unknown field"),
                                           ("state.block_k", "expected STAGE.FIELD"),
                                           ("state.block_k=24", "power of two"),
                                           ("scan.block_m=32", "must divide"),
                                           ("scan.block_m=32,64+scan.block_s=32", "one value")])
def test_vary_space_rejects_what_it_cannot_build(spec, message):
    with pytest.raises(ValueError, match=message):
        bench.vary_space([spec])


def test_retune_mamba_ssm_forgets_only_mamba_ssms_tuned_configurations(monkeypatch):
    """A stand-in for triton's Autotuner (triton is not installed on CPU CI): the tuned
    configurations of mamba_ssm's Triton modules are cleared, anything else is left alone."""
    import sys
    import types

    from ssd.tools import peers

    class Autotuner:
        def __init__(self, cache):
            self.cache = cache

    autotuner = types.ModuleType("triton.runtime.autotuner")
    autotuner.Autotuner = Autotuner
    for name in ("triton", "triton.runtime"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "triton.runtime.autotuner", autotuner)
    ours = types.ModuleType("mamba_ssm.ops.triton.ssd_chunk_scan")
    ours.tuned, ours.untuned = Autotuner({(256, 64, 128): "config"}), Autotuner({})
    other = types.ModuleType("somewhere.else")
    other.tuned = Autotuner({(1,): "config"})
    monkeypatch.setitem(sys.modules, ours.__name__, ours)
    monkeypatch.setitem(sys.modules, other.__name__, other)
    assert peers.mamba_ssm_configs() == {"ssd_chunk_scan.tuned": {"(256, 64, 128)": "config"}}
    assert peers.retune_mamba_ssm() == 1
    assert peers.mamba_ssm_configs() == {}
    assert ours.tuned.cache == {} and other.tuned.cache == {(1,): "config"}


@pytest.mark.parametrize("argv, message", [(["--shapes", "2.7b,7b"], "7b not in the models suite"),
                                           (["--suite", "first-call", "--shapes", "130m"],
                                            "no named shapes"),
                                           (["--suite", "study", "--shapes", "x"], "x not in"),
                                           (["--tilegym-replay"],
                                            "goes with --impl tilegym_tuned"),
                                           (["--merge"], "--merge goes with --shapes")])
def test_main_rejects_shapes_outside_the_suite(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_fresh_kernel_caches_unless_the_caller_set_one(monkeypatch):
    """python -m ssd.tools.bench gives cuTile and Triton empty caches of its own, so that a first call
    compiles even on a machine that compiled the same kernels before; a cache the caller named
    is kept, and the record says which."""
    import contextlib
    import os
    import types

    for name in ("cuda.tile", "triton"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delenv("CUDA_TILE_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/mine")
    with contextlib.ExitStack() as stack:
        state = bench.fresh_kernel_caches(stack)
        fresh = os.environ["CUDA_TILE_CACHE_DIR"]
        assert state == {"CUDA_TILE_CACHE_DIR": "fresh", "TRITON_CACHE_DIR": "caller's"}
        assert os.path.isdir(fresh) and not os.listdir(fresh)
        assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/mine"
    assert "CUDA_TILE_CACHE_DIR" not in os.environ and not os.path.exists(fresh)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    with contextlib.ExitStack() as stack, pytest.raises(RuntimeError, match="already imported"):
        bench.fresh_kernel_caches(stack)


def test_write_json_takes_the_string_an_out_argument_gives(tmp_path):
    """--out arrives as a str, which has no `.parent`: results must not be lost to it."""
    import json

    from ssd.tools.env import write_json

    path = write_json(str(tmp_path / "sub" / "x.json"), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}


def test_write_json_puts_one_record_on_a_line_and_reads_back_the_same(tmp_path):
    import json

    from ssd.tools.env import write_json

    payload = {"records": [{"shape": "a", "dims": [1, 2], "ms": 0.5},
                           {"shape": "b", "dims": [3, 4], "ms": 1.5, "config": {"q": 64}}],
               "settings": {"reps": 30}, "empty": [], "none": None, "nested": [[1, 2], [3]]}
    text = write_json(tmp_path / "x.json", payload).read_text()
    assert json.loads(text) == payload
    lines = text.splitlines()
    assert '  {"shape": "a", "dims": [1, 2], "ms": 0.5},' in lines   # a flat record: one line
    assert ' "settings": {"reps": 30},' in lines
    assert '   "config": {"q": 64}' in lines                          # nested: indented by depth


def test_tilegym_configs_reads_the_tune_caches(monkeypatch):
    """The configurations TileGym chose are read from its per-kernel caches; none without it."""
    import sys
    import types

    from ssd.tools import peers

    monkeypatch.delitem(sys.modules, "tilegym.ops.cutile.mamba2", raising=False)
    assert peers.tilegym_configs() == {}
    mamba2 = types.ModuleType("tilegym.ops.cutile.mamba2")
    mamba2._compute_out_tune_cache = {("key",): (types.SimpleNamespace(BLOCK_STATE=64), "kernel")}
    mamba2._chunk_cumsum_tune_cache = {}  # never ran: left out
    monkeypatch.setitem(sys.modules, mamba2.__name__, mamba2)
    assert peers.tilegym_configs() == {"compute_out": ["namespace(BLOCK_STATE=64)"]}


def test_tilegym_replaying_takes_the_recorded_configuration_instead_of_searching(monkeypatch):
    """TileGym's own search call is answered with the recorded choice, only inside the block; a
    recorded configuration that is not exactly one of its candidates is an error."""
    import sys
    import types

    from ssd.tools import peers

    ns = types.SimpleNamespace
    mamba2 = types.ModuleType("tilegym.ops.cutile.mamba2")
    search = mamba2.exhaustive_search = lambda configs, *args: "searched"
    monkeypatch.setitem(sys.modules, mamba2.__name__, mamba2)
    monkeypatch.setattr(peers, "tilegym_forward", lambda: None)
    chosen = {"compute_out": ["namespace(BLOCK_STATE=64, H_LAT=4)"],
              "chunk_cumsum": ["namespace(BLOCK_H=8)"]}
    candidates = [ns(BLOCK_STATE=s, H_LAT=h) for s in (32, 64) for h in (3, 4)]
    with peers.tilegym_replaying(chosen):
        got = mamba2.exhaustive_search(candidates, "stream", "grid", "kernel", "args", "hints")
        assert got.best.config is candidates[3]
        assert mamba2.exhaustive_search([ns(BLOCK_H=4), ns(BLOCK_H=8)]).best.config == ns(BLOCK_H=8)
        with pytest.raises(peers.PeerUnavailable, match="0 of its 2 candidate"):
            mamba2.exhaustive_search([ns(BLOCK_H=4), ns(BLOCK_H=16)])
    assert mamba2.exhaustive_search is search


def test_tilegym_table_keeps_what_a_searched_run_chose_and_replay_reads_it(tmp_path):
    """make gpu-tilegym: each searched run's chosen configurations and tuning time go into the
    table under the run's GPU; --tilegym-replay reads them back for that GPU and shape."""
    run = dict(tilegym_configs={"2.7b": {"compute_out": ["namespace(BLOCK_STATE=64)"]}},
               records=[dict(shape="2.7b", impl="tilegym_tuned", first_call_s=170.0)],
               environment=dict(gpu="NVIDIA H200", tilegym="1.5.1", date="d"))
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "2.7b.json").write_text(json.dumps(run))
    table = tmp_path / "tilegym_tuned.json"
    bench.write_tilegym_table(tmp_path / "runs", table)
    got = bench.tilegym_replay_source("h200", "2.7b", table)
    assert got == dict(configs=run["tilegym_configs"]["2.7b"], tilegym="1.5.1",
                       gpu="NVIDIA H200", date="d", tuning_s=170.0)
    with pytest.raises(FileNotFoundError, match="no tuning of 2.7b on h100"):
        bench.tilegym_replay_source("h100", "2.7b", table)
    replayed = dict(run, records=[dict(r, tuning="replayed") for r in run["records"]])
    with pytest.raises(ValueError, match="no searched TileGym tuning"):  # never keep a replay
        bench.tilegym_tuning(replayed, "2.7b")


def test_the_book_replays_tilegym_tuned_on_every_models_shape():
    """results/tilegym_tuned.json holds the H100's and the H200's tuning of every models shape."""
    for gpu in ("h100", "h200"):
        for shape in bench.SUITES["models"]:
            assert bench.tilegym_replay_source(gpu, shape.name)["configs"]


def test_first_call_shapes_reach_both_last_chunks():
    """The first-call goal's never-seen shapes take both launcher paths at every suite chunk size:
    a ragged last chunk and full chunks only (where whole-chunk tiles that load once may run, the
    slowest kernel to compile), and the grouped walk at the first-call chunk size is taken both
    ways too (its full-chunk tiles compile for longest)."""
    for q in bench.SUITE_CHUNKS:
        ragged = [s for s in bench.FIRST_CALL_SHAPES if s.l % q]
        assert ragged and len(ragged) < len(bench.FIRST_CALL_SHAPES), q
    suites = {s.name for shapes in bench.SUITES.values() for s in shapes}
    assert not {s.name for s in bench.FIRST_CALL_SHAPES} & suites   # never seen by a suite
    grouped = [s for s in bench.FIRST_CALL_SHAPES
               if bench.shape_default(s.dims, 132).state.groups > 1]   # the grouped walk's kernels
    assert sorted(bool(s.l % bench.OUR_CHUNK) for s in grouped) == [False, True]


def test_worst_gate_result_is_a_failure_before_any_pass():
    """bench.worst: the first call's and the tuned build's gates (ssd.launch) judged together."""
    from ssd.tools.bench import worst

    assert worst(1e-3, 2e-3) == 2e-3
    assert worst(1e-3, -0.5) == -0.5 and worst(-0.5, 1e-3) == -0.5
    assert worst(-0.02, -0.5) == -0.5
    assert worst(math.inf, -0.5, 1e-3) == math.inf


def test_a_suite_split_over_commands_merges_into_one_recording_of_its_revision():
    """--shapes A --merge then --shapes B --merge: one models.json holding both, each shape's
    rows from its own command; another revision's file is never merged into."""
    env = dict(git_revision="rev-a", gpu="NVIDIA H200")
    settings = dict(reps=30)

    def run(shape, ms):
        return dict(records=[dict(shape=shape, impl="ssd", median_ms=ms)],
                    stages=[dict(shape=shape, ssd={"chunk_scan": ms})], failures=[],
                    skipped={f"{shape}/tilegym": "absent"}, mamba_ssm_configs={shape: {"c": 1}},
                    tilegym_configs={}, tilegym_stages={}, ceilings=dict(copy_bytes_per_s=1.0),
                    settings=settings, environment=env)

    merged = bench.merge_runs(run("130m", 1.0), run("2.7b", 2.0))
    assert [(r["shape"], r["median_ms"]) for r in merged["records"]] == [("130m", 1.0),
                                                                       ("2.7b", 2.0)]
    assert set(merged["mamba_ssm_configs"]) == {"130m", "2.7b"}
    assert set(merged["skipped"]) == {"130m/tilegym", "2.7b/tilegym"}
    again = bench.merge_runs(merged, run("130m", 1.5))  # a shape measured again replaces its rows
    assert sorted((r["shape"], r["median_ms"]) for r in again["records"]) == [("130m", 1.5),
                                                                             ("2.7b", 2.0)]
    assert [s["shape"] for s in again["stages"]] == ["2.7b", "130m"]
    other = dict(run("2.7b", 2.0), environment=dict(env, git_revision="rev-b"))
    with pytest.raises(ValueError, match="another revision"):
        bench.merge_runs(other, run("130m", 1.0))
    with pytest.raises(ValueError, match="settings"):
        bench.merge_runs(dict(run("2.7b", 2.0), settings=dict(reps=10)), run("130m", 1.0))


def test_merge_target_is_the_suite_file_of_this_revision_only(tmp_path):
    from types import SimpleNamespace

    args = SimpleNamespace(merge=True, out=str(tmp_path / "models.json"), suite="models",
                           vary=None, shapes="130m")
    env = dict(git_revision="rev-a", gpu="NVIDIA H200")
    assert bench._merge_target(args, env) is None                    # nothing recorded yet
    (tmp_path / "models.json").write_text(json.dumps(dict(environment=env, records=[])))
    assert bench._merge_target(args, env) == dict(environment=env, records=[])
    assert bench._merge_target(args, dict(env, git_revision="rev-b")) is None
    assert bench._merge_target(SimpleNamespace(**{**vars(args), "merge": False}), env) is None


def test_compile_ahead_needs_a_cache_and_reports_a_failed_worker(tmp_path, monkeypatch):
    """compile_ahead fills a kernel cache, so it refuses to run without one; a worker that fails
    (here: no GPU on this machine) fails the call with the worker's own error."""
    from ssd.config import SSDConfig

    shape = bench.Shape("tiny", 1, 64, 2, 8, 16, 1)
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", "off")
    with pytest.raises(RuntimeError, match="no cache folder"):
        bench.compile_ahead([(shape, 64, SSDConfig())], workers=2)
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"1 of 1 workers failed(.|\n)*Error"):
        bench.compile_ahead([(shape, 64, SSDConfig())], workers=2)


def test_compile_ahead_hands_each_worker_its_share_of_the_calls(tmp_path, monkeypatch):
    """Every call reaches one worker, round robin, as JSON the worker reads back into the same
    shape (a packed one's boundaries included), chunk size and configuration (None: the API's
    default on the GPU)."""
    from ssd.config import SSDConfig

    jobs = []

    class Proc:
        def __init__(self, argv, stdin, **kw):
            assert argv[1:] == ["-m", "ssd.tools.bench", "--compile-job"]
            assert kw["env"]["SSD_QUICK_FIRST_CALL"] == "0"  # tuned builds only
            self.stdin = self

        def write(self, text):
            jobs.append(json.loads(text))

        def close(self):
            pass

        def wait(self):
            return 0

    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench.subprocess, "Popen", Proc)
    packed = next(s for s in bench.SUITES["robust"] if s.packed)
    flat = bench.Shape("flat", 1, 64, 2, 8, 16, 1)
    calls = [(packed, 64, None), (flat, 64, SSDConfig()), (flat, 128, None)]
    assert bench.compile_ahead(calls, workers=2) >= 0
    assert [len(j) for j in jobs] == [2, 1]
    fields, q, cfg = jobs[0][0]
    assert bench.Shape(**dict(fields, seq_boundaries=tuple(fields["seq_boundaries"]))) == packed
    assert (q, cfg) == (64, None) and SSDConfig.from_dict(jobs[1][0][2]) == SSDConfig()


class FakeClock:
    """A stand-in for the wall clock: time moves only when a stub says so."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t

    def advance(self, seconds):
        self.t += seconds


def test_phase_clock_adds_up_each_phase_and_what_none_covered(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(bench, "_now", clock)
    phases = bench.PhaseClock()
    for _ in range(2):
        with phases("gate"):
            clock.advance(1.5)
        clock.advance(0.25)  # in no phase
    with pytest.raises(ValueError), phases("first/ssd"):  # a phase that raises still counts
        clock.advance(4.0)
        raise ValueError
    got = phases.stop()
    assert got == {"gate": 3.0, "first/ssd": 4.0, "other": 0.5, "total": 7.5}
    assert list(got) == ["gate", "first/ssd", "other", "total"]
    assert bench.phase_line("r00", got) == ("[bench] r00: 7.5 s: gate 3.0, first/ssd 4.0, "
                                            "other 0.5")


# seconds each stubbed step takes: (first call, one timed run) per implementation
COST = {"ssd": (2.0, 0.5), "mamba_ssm": (30.0, 1.0)}


def _stub_suite(monkeypatch, clock):
    """run_suite with every GPU step stubbed, each advancing ``clock`` by a known time;
    returns the list compile_ahead's calls go to and the SSD_QUICK_FIRST_CALL each first call
    of ours saw."""
    from ssd.tools import peers

    compiled, quick = [], []
    monkeypatch.setenv("SSD_QUICK_FIRST_CALL", "1")  # as a user's process has it
    monkeypatch.setattr(bench, "_now", clock)
    monkeypatch.setattr(bench, "compile_ahead", lambda calls, workers:
                        compiled.append((calls, workers)) or clock.advance(7.0))
    monkeypatch.setattr(bench, "make_inputs", lambda shape, dtype: clock.advance(0.5) or {})

    class Gate:
        def __init__(self, shape, inputs):
            clock.advance(4.0)  # the float64 reference

        def __call__(self, y):
            clock.advance(0.25)
            return 1e-3

    def first_call(fn):
        if fn == "ssd":
            quick.append(os.environ.get("SSD_QUICK_FIRST_CALL"))
        clock.advance(COST[fn][0])
        return COST[fn][0], None, "y", "y"

    monkeypatch.setattr(bench, "Gate", Gate)
    monkeypatch.setattr(bench, "implementations", lambda inputs, names, config, our_chunks: (
        {"ssd": dict.fromkeys(our_chunks, "ssd"),
         "mamba_ssm": dict.fromkeys(bench.SUITE_CHUNKS, "mamba_ssm")}, {}))
    monkeypatch.setattr(bench, "first_call", first_call)
    monkeypatch.setattr(bench, "time_fn", lambda fn, mode, l2, reps:
                        clock.advance(COST[fn][1]) or dict(median_ms=1.0))
    monkeypatch.setattr(bench, "floor_ms", lambda shape, ceilings: dict(floor_ms=0.1))
    monkeypatch.setattr(peers, "retune_mamba_ssm", lambda: 0)
    monkeypatch.setattr(peers, "mamba_ssm_configs", lambda: {})
    return compiled, quick


def test_a_suite_records_where_each_shapes_seconds_go(monkeypatch, capsys):
    """Per shape, the wall seconds of each phase (stubbed steps of known cost): the reference
    and comparisons in gate, each implementation's first calls and timed runs apart; the
    run's own phases (compiling ahead) in a row naming its shapes; a line a shape printed."""
    clock = FakeClock()
    compiled, quick = _stub_suite(monkeypatch, clock)
    shapes = bench.SUITES["robust"][:2]
    payload = bench.run_suite(shapes, impls=("ssd", "mamba_ssm"), l2s=("flushed",),
                              stages=False, ceilings={}, reps=3, compile_workers=3,
                              policy=bench.SUITE_POLICIES["robust"])
    # robust: ours at one chunk size (2 modes), mamba_ssm at three; two gate checks a call
    want = {"inputs": 0.5, "gate": 4.0 + 4 * 2 * 0.25, "first/ssd": 2.0, "timed/ssd": 2 * 0.5,
            "first/mamba_ssm": 3 * 30.0, "timed/mamba_ssm": 3 * 2 * 1.0, "other": 0.0}
    want["total"] = sum(want.values())
    assert payload["phase_s"] == {s.name: want for s in shapes}
    assert list(payload["phase_s"][shapes[0].name]) == list(want)
    assert payload["run_phase_s"] == [dict(shapes=[s.name for s in shapes], precompile=7.0,
                                           all_shapes=2 * want["total"], other=0.0,
                                           total=7.0 + 2 * want["total"], compile_workers=3)]
    out = capsys.readouterr().out
    assert f"[bench] {shapes[1].name}: 105.5 s: inputs 0.5, gate 6.0, first/ssd 2.0" in out
    # compiled ahead: ours' kernels for every shape at its chunk size, before any first call,
    # which then takes the tuned build from the cache (no quick build)
    assert compiled == [([(s, bench.OUR_CHUNK, None) for s in shapes], 3)]
    assert quick == ["0", "0"] and os.environ["SSD_QUICK_FIRST_CALL"] == "1"  # restored
    ours = [r for r in payload["records"] if r["impl"] == "ssd"]
    theirs = [r for r in payload["records"] if r["impl"] == "mamba_ssm"]
    assert {r["chunk_size"] for r in ours} == {bench.OUR_CHUNK}
    assert {r["chunk_size"] for r in theirs} == set(bench.SUITE_CHUNKS)
    assert all(r["precompiled"] for r in ours) and not any("precompiled" in r for r in theirs)
    assert payload["settings"]["our_chunk_sizes"] == [bench.OUR_CHUNK]
    assert payload["settings"]["precompiled"] is True


def test_the_models_suite_keeps_cold_first_calls_at_every_chunk_size(monkeypatch):
    clock = FakeClock()
    compiled, quick = _stub_suite(monkeypatch, clock)
    policy = bench.SUITE_POLICIES.get("models", bench.SuitePolicy())
    payload = bench.run_suite(bench.SUITES["models"][:1], impls=("ssd", "mamba_ssm"),
                              l2s=("flushed",), stages=False, ceilings={}, policy=policy)
    assert compiled == [] and quick == ["1"] * 3
    assert "precompile" not in payload["run_phase_s"][0]
    ours = [r for r in payload["records"] if r["impl"] == "ssd"]
    assert {r["chunk_size"] for r in ours} == set(bench.SUITE_CHUNKS)
    assert not any("precompiled" in r for r in payload["records"])
    assert payload["phase_s"]["130m"]["first/ssd"] == 3 * 2.0


def test_suite_policies():
    """robust: ours at the recommended chunk size only, against mamba_ssm's best of three,
    compiled ahead; serving compiled ahead; the suites whose first calls are a result keep
    them cold."""
    robust, serving = bench.SUITE_POLICIES["robust"], bench.SUITE_POLICIES["serving"]
    assert robust == bench.SuitePolicy(our_chunks=(bench.OUR_CHUNK,), precompile=True)
    assert serving.precompile and serving.our_chunks == bench.SUITE_CHUNKS
    for suite in ("models", "first-call", "study", "seqlen"):
        assert not bench.SUITE_POLICIES.get(suite, bench.SuitePolicy()).precompile
    inputs = bench.make_inputs(bench.Shape("tiny", 1, 128, 2, 8, 8, 1), "float32", device="cpu")
    table, _ = bench.implementations(inputs, names=("ssd",), our_chunks=(64,))
    assert list(table["ssd"]) == [64]


@pytest.mark.parametrize("argv, want", [
    (["--suite", "robust"], bench.SuitePolicy((bench.OUR_CHUNK,), True)),
    (["--suite", "robust", "--no-precompile"], bench.SuitePolicy((bench.OUR_CHUNK,), False)),
    (["--suite", "robust", "--our-chunks", "256,64"], bench.SuitePolicy((64, 256), True)),
    (["--suite", "models"], bench.SuitePolicy()),
    (["--suite", "models", "--precompile"], bench.SuitePolicy(precompile=True))])
def test_the_command_line_reads_the_suites_policy(argv, want, monkeypatch):
    taken = []
    monkeypatch.setattr(bench, "fresh_kernel_caches", lambda stack: {})
    monkeypatch.setattr(bench, "_run", lambda parser, args, shapes, names, caches:
                        taken.append(args.policy) or 0)
    assert bench.main(argv) == 0 and taken == [want]


@pytest.mark.parametrize("argv, message", [
    (["--suite", "robust", "--our-chunks", "32"], "expected some of 64,128,256"),
    (["--suite", "study", "--precompile"], "go with a suite of shapes"),
    (["--suite", "first-call", "--our-chunks", "64"], "go with a suite of shapes")])
def test_bad_policy_options_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_merged_shards_keep_each_shapes_phases_and_each_runs_row():
    env = dict(git_revision="rev-a", gpu="NVIDIA H100")

    def run(*names):
        return dict(records=[dict(shape=n, impl="ssd") for n in names], settings={},
                    environment=env, phase_s={n: dict(total=1.0) for n in names},
                    run_phase_s=[dict(shapes=list(names), precompile=5.0)])

    merged = bench.merge_runs(run("a", "b"), run("c"))
    assert set(merged["phase_s"]) == {"a", "b", "c"}
    assert [r["shapes"] for r in merged["run_phase_s"]] == [["a", "b"], ["c"]]
    again = bench.merge_runs(merged, run("c"))  # a shard run again replaces its run's row
    assert [r["shapes"] for r in again["run_phase_s"]] == [["a", "b"], ["c"]]


def test_a_compile_worker_runs_each_call_once_on_its_shapes_inputs(monkeypatch):
    """A compile_ahead worker makes a shape's inputs once for its calls, passes a packed shape's
    seq_idx, and the configuration it was given (None: the API's default)."""
    import torch

    from ssd import api
    from ssd.config import SSDConfig

    made, calls, make = [], [], bench.make_inputs
    monkeypatch.setattr(bench, "make_inputs", lambda shape: made.append(shape.name) or
                        make(shape, "float32", device="cpu"))
    monkeypatch.setattr(api, "mamba_chunk_scan_combined", lambda *a, config, **kw:
                        calls.append((a[5], config, "seq_idx" in kw)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    packed = bench.Shape("p", 1, 96, 4, 16, 8, 2, seq_boundaries=(40,))
    flat = bench.Shape("f", 1, 64, 2, 8, 16, 1)
    job = [[asdict(s), q, c] for s, q, c in
           ((packed, 64, None), (packed, 128, None), (flat, 64, asdict(SSDConfig())))]
    bench._compile_job(json.loads(json.dumps(job)))
    assert made == ["p", "f"]
    assert calls == [(64, None, True), (128, None, True), (64, SSDConfig(), False)]
