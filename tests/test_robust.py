"""CPU tests of the robust benchmark suite: the shapes drawn from published Mamba-2 layers are
the same on every machine, span the stated batch and sequence ranges under the size cap, and
their packed rows carry a valid seq_idx, which reaches every implementation that takes it and
the correctness gate; the summary reads the graph and eager speedups against the goals."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from ssd.tools import bench

torch = pytest.importorskip("torch")

ROBUST = bench.SUITES["robust"]
DRAW = bench.RobustDraw()


def test_the_robust_list_is_drawn_the_same_every_time():
    assert bench.robust_shapes() == ROBUST == bench.robust_shapes(bench.RobustDraw())
    assert bench.robust_shapes(bench.RobustDraw(seed=DRAW.seed + 1)) != ROBUST
    assert len(ROBUST) >= 24 and len({s.name for s in ROBUST}) == len(ROBUST)


def test_the_robust_list_spans_the_stated_ranges_under_the_cap():
    b = [s.b for s in ROBUST]
    l = [s.l for s in ROBUST]
    assert DRAW.batch == (1, 32) and DRAW.seqlen == (256, 32768)
    assert all(1 <= v <= 32 for v in b) and all(256 <= v <= 32768 for v in l)
    # both ends reached: one batch of one, a batch of 16 or more, short and 16k+ sequences
    assert min(b) == 1 and max(b) >= 16 and min(l) <= 512 and max(l) >= 16384
    assert all(s.b * s.l * s.h <= DRAW.token_heads for s in ROBUST)
    # every model as often as another, with its heads; packed and not; 2^k and ragged lengths
    models = [next(m for m in bench.MAMBA2_MODELS if s.name.startswith(f"r{i:02d}-{m.name}-b"))
              for i, s in enumerate(ROBUST)]
    assert all(s.dims[2:] == (m.h, m.p, m.n, m.g) for s, m in zip(ROBUST, models))
    assert sorted(m.name for m in models) == sorted(
        m.name for m in bench.MAMBA2_MODELS for _ in range(DRAW.per_model))
    packed = sum(s.packed for s in ROBUST)
    assert len(ROBUST) // 3 <= packed <= len(ROBUST) - len(ROBUST) // 3
    powers = sum(s.l & (s.l - 1) == 0 for s in ROBUST)
    assert 0 < powers < len(ROBUST)


@pytest.mark.parametrize("m", bench.MAMBA2_MODELS, ids=lambda m: m.name)
def test_every_model_configuration_is_a_valid_ssd_problem(m):
    from ssd.api import MAX_DSTATE

    assert all(isinstance(v, int) and v > 0 for v in (m.h, m.p, m.n, m.g))
    assert m.h % m.g == 0, "B and C are shared by h / g heads"
    assert m.h // m.g >= 2, "the correctness gate checks two heads of one group"
    assert m.n <= MAX_DSTATE and m.p % 8 == 0
    assert len({x.name for x in bench.MAMBA2_MODELS}) == len(bench.MAMBA2_MODELS)


def test_packed_shapes_carry_a_valid_seq_idx():
    for shape in (s for s in ROBUST if s.packed):
        starts = shape.seq_boundaries
        assert list(starts) == sorted(set(starts)) and 0 < starts[0] and starts[-1] < shape.l
        assert 2 <= len(starts) + 1 <= DRAW.max_sequences
        assert shape.name.endswith(f"-s{len(starts) + 1}")
        idx = bench.packed_seq_idx(shape, device="cpu")
        assert idx.shape == (shape.b, shape.l) and idx.dtype == torch.int32
        assert (idx == idx[:1]).all()  # every row packed alike
        row = idx[0].numpy()
        assert row[0] == 0 and row[-1] == len(starts) and (np.diff(row) >= 0).all()
        assert list(np.flatnonzero(np.diff(row)) + 1) == list(starts)  # steps at the starts
    assert all(not s.seq_boundaries for s in ROBUST if not s.packed)


TINY_PACKED = bench.Shape("tiny-packed", 2, 96, 4, 16, 8, 2, seq_boundaries=(1, 40, 41))


def test_packed_inputs_reach_every_implementation_that_takes_seq_idx(monkeypatch):
    from ssd import api
    from ssd.tools import peers

    inputs = bench.make_inputs(TINY_PACKED, "float32", device="cpu")
    assert torch.equal(inputs["seq_idx"], bench.packed_seq_idx(TINY_PACKED, device="cpu"))
    assert "seq_idx" not in bench.make_inputs(bench.Shape("flat", 1, 64, 2, 8, 8), "float32",
                                              device="cpu")
    seen = []
    monkeypatch.setattr(api, "mamba_chunk_scan_combined",
                        lambda *a, **kw: seen.append(("ssd", kw.get("seq_idx"))))
    monkeypatch.setattr(peers, "mamba_ssm_forward",
                        lambda: lambda *a, **kw: seen.append(("mamba_ssm", kw.get("seq_idx"))))
    table, skipped = bench.implementations(inputs, ("ssd", "mamba_ssm", "tilegym"))
    for by_chunk in table.values():
        by_chunk[64]()
    assert [name for name, _ in seen] == ["ssd", "mamba_ssm"]
    assert all(idx is inputs["seq_idx"] for _, idx in seen)
    assert "tilegym" not in table and "seq_idx" in skipped["tilegym"]


def test_the_gate_of_a_packed_shape_resets_at_its_boundaries():
    from ssd.layer import ssd_torch

    inputs = bench.make_inputs(TINY_PACKED, "float32", device="cpu")
    gate = bench.Gate(TINY_PACKED, inputs)
    args = (inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 32)
    kw = dict(D=inputs["D"], dt_bias=inputs["dt_bias"], dt_softplus=True)
    packed = ssd_torch(*args, seq_idx=inputs["seq_idx"], **kw)
    print(f"packed: rel err {gate(packed):.1e}")
    assert 0 <= gate(packed) < 1e-5
    assert gate(ssd_torch(*args, **kw)) < 0  # one sequence a row: fails


def _rec(shape, impl, ms, mode):
    return dict(shape=shape, impl=impl, chunk_size=64, median_ms=ms, mode=mode, l2="flushed",
                floor_ms=0.1)


RECORDS = [_rec("a", "ssd", 1.0, "graph"), _rec("a", "mamba_ssm", 3.0, "graph"),
           _rec("b", "ssd", 1.0, "graph"), _rec("b", "mamba_ssm", 1.5, "graph"),
           _rec("a", "ssd", 2.0, "eager"), _rec("a", "mamba_ssm", 4.0, "eager"),
           _rec("b", "ssd", 2.0, "eager"), _rec("b", "mamba_ssm", 2.2, "eager")]


def test_the_summary_reads_graph_and_eager_speedups_against_the_goals(capsys):
    summary = bench.speedup_summary(RECORDS, goals=bench.ROBUST_GOALS)
    graph, eager = summary["graph"], summary["eager"]
    assert graph["geomean"] == pytest.approx(math.sqrt(3.0 * 1.5))
    assert (graph["min"], graph["min_shape"], graph["shapes"]) == (1.5, "b", 2)
    assert graph["met"] is False  # 2.12x mean, but b at 1.5x < 1.6x
    assert eager["min"] == pytest.approx(1.1) and eager["met"] is True
    assert "met" not in bench.speedup_summary(RECORDS)["graph"]
    payload = dict(records=RECORDS, speedup_vs_mamba_ssm=bench.speedups(RECORDS),
                   summary=summary)
    bench.print_suite(payload)
    text = capsys.readouterr().out
    assert "eager x" in text and "1.10x" in text
    assert "graph: geomean speedup over mamba_ssm 2.12x, slowest 1.50x (b), 2 shapes  goals missed" in text


def test_shards_split_the_suite_into_recordings_that_merge(monkeypatch):
    taken = []
    monkeypatch.setattr(bench, "fresh_kernel_caches", lambda stack: {})
    monkeypatch.setattr(bench, "_run", lambda parser, args, shapes, names, caches:
                        taken.append([s.name for s in shapes]) or 0)
    for i in (1, 2, 3):
        assert bench.main(["--suite", "robust", "--shard", f"{i}/3", "--merge"]) == 0
    assert sorted(sum(taken, [])) == sorted(s.name for s in ROBUST)
    assert taken[1] == [s.name for s in ROBUST[1::3]]
    args = SimpleNamespace(vary=None, suite="robust", shapes=None, shard="2/3", merge=False)
    env = dict(gpu="NVIDIA H100 80GB HBM3")
    assert bench._suite_path(args, [], env).name == "robust-shard2of3.json"
    assert bench._suite_path(SimpleNamespace(**{**vars(args), "merge": True}), [],
                             env).name == "robust.json"


@pytest.mark.parametrize("argv, message", [
    (["--suite", "robust", "--shard", "0/3"], "expected I/K with 1 <= I <= K"),
    (["--suite", "robust", "--shard", "4/3"], "expected I/K"),
    (["--suite", "robust", "--shard", "1/2", "--shapes", "x"], "--shard goes with"),
    (["--suite", "robust", "--merge"], "--merge goes with --shapes or --shard")])
def test_bad_shards_are_clear_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
