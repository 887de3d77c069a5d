"""ssd.tools.backward_stages on the CPU: the stages' arguments are those the backward passes,
the breakdown adds up, the split choices divide the heads, and the command line refuses bad
input by name. The timing itself needs a GPU (make gpu-backward-stages)."""
import functools
import re

import pytest

torch = pytest.importorskip("torch")

from ssd import api, autograd  # noqa: E402
from ssd.backward import TORCH_BACKWARDS  # noqa: E402
from ssd.tools import backward_stages as BS  # noqa: E402
from ssd.tools.bench import Shape  # noqa: E402

SMALL = Shape("small", 2, 40, 4, 8, 8, 2)
STAGE_CALLS = BS.stage_calls
MAKE_INPUTS = pytest.importorskip("ssd.tools.bench").make_inputs
UPSTREAM = pytest.importorskip("ssd.tools.backward_bench").upstream


def test_stage_calls_keep_what_each_stage_was_given():
    forward = functools.partial(autograd.chunk_scan_combined, stages=autograd.torch_stages)
    calls = BS.stage_calls(SMALL, 16, dtype="float32", device="cpu", forward=forward,
                           backwards=TORCH_BACKWARDS)
    assert list(calls) == list(BS.STAGES[:-1])  # the order the backward runs them
    fn, args, kwargs = calls["chunk_scan"]
    assert fn is TORCH_BACKWARDS.chunk_scan
    dy, B, C, x = args[:4]
    assert dy.shape == x.shape == (2, 40, 4, 8) and B.shape == C.shape == (2, 40, 2, 8)
    again = fn(*args, **kwargs)  # a kept call reruns to the same gradients
    first = TORCH_BACKWARDS.chunk_scan(*args, **kwargs)
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert calls["state_passing"][1][0].shape == (2, 3, 4, 8, 8)  # dprev_states (b, c, h, p, n)


def torch_fold(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx, *, walk, dx_dtype):
    """StageBackwards.fold's contract from the torch stages: the walk inside, chunk_state's
    parts added to chunk_scan's."""
    scan = TORCH_BACKWARDS.chunk_scan(dy, B, C, x, dt_out, dA_cumsum, prev_states, D, z, seq_idx)
    passing = walk(scan.pop("dprev_states"))
    state = TORCH_BACKWARDS.chunk_state(passing["dstates"], B, x, dt_out, dA_cumsum, seq_idx)
    for k in ("dB", "ddt_out", "ddA_cumsum"):
        scan[k] = scan[k] + state[k]
    return dict(scan, dx=(scan["dx"] + state["dx"]).to(dx_dtype or x.dtype), passing=passing)


def test_stage_calls_keep_the_folded_call_in_place_of_two_stages():
    forward = functools.partial(autograd.chunk_scan_combined, stages=autograd.torch_stages)
    calls = BS.stage_calls(SMALL, 16, dtype="float32", device="cpu", forward=forward,
                           backwards=TORCH_BACKWARDS._replace(fold=torch_fold))
    assert list(calls) == ["fold", "state_passing", "chunk_cumsum"]  # the walk runs inside fold
    fn, args, kwargs = calls["fold"]
    assert set(kwargs) == {"walk", "dx_dtype"} and fn(*args, **kwargs)["passing"]


def test_a_stage_never_called_is_an_error():
    def no_backward(x, dt, A, B, C, chunk_size, D, dt_bias, **kwargs):  # differentiable, no SSD
        return x * 2 + sum(t.sum() for t in (dt, A, B, C, D, dt_bias))

    with pytest.raises(RuntimeError, match="never called chunk_scan, state_passing"):
        BS.stage_calls(SMALL, 16, dtype="float32", device="cpu", forward=no_backward,
                       backwards=TORCH_BACKWARDS)


@pytest.mark.parametrize("wanted, splits", [((1, 2, 3, 4), [1, 2]), ((), [])])
def test_head_split_choices_divide_the_heads_per_group(wanted, splits):
    default, tried = BS.head_split_choices(SMALL, 16, wanted)
    assert tried == splits and 2 % default == 0


def test_the_sweep_times_every_combination_and_marks_the_defaults(monkeypatch):
    """run() on the CPU with the timer replaced: chunk_scan's backward at each combination of
    the swept fields, head splits that do not divide the heads per group skipped."""
    import ssd.tools.backward_bench as BB
    import ssd.tools.bench as bench

    forward = functools.partial(autograd.chunk_scan_combined, stages=autograd.torch_stages)
    def without_grad(fn):  # as autograd runs a backward: a launch with grad mode on refuses the
        def call(*args, **kwargs):  # kept leaves that require grad
            assert not torch.is_grad_enabled(), "a stage's backward timed in grad mode"
            kwargs.pop("config", None)  # the sweep's tiles: the torch functions take none
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(BS, "stage_calls", lambda shape, q, backwards: {
        k: (without_grad(fn), a, kw) for k, (fn, a, kw) in STAGE_CALLS(
            shape, q, "float32", "cpu", forward, TORCH_BACKWARDS).items()})
    chosen = []
    monkeypatch.setattr(BS, "where_dprev_forms", lambda where: chosen.append(where) or
                        TORCH_BACKWARDS)
    monkeypatch.setattr(BS, "timed", lambda fn, reps: fn() is None or dict(median_ms=1.0,
                                                                          mode="graph"))
    monkeypatch.setattr(bench, "make_inputs", functools.partial(MAKE_INPUTS, device="cpu"))
    monkeypatch.setattr(api, "mamba_chunk_scan_combined", forward)
    monkeypatch.setattr(BB, "upstream", functools.partial(UPSTREAM, device="cpu"))
    lines = []
    payload = BS.run([SMALL], chunks=(16,), sweep=dict(head_splits=(1, 2, 3), warps=(4, 8)),
                     reps=3, state_tiles=[(64, 32, 32, 4), (16, 8, 8, 2)],
                     passing_tiles=[(8, 8, 4)], progress=lines.append)
    assert len(lines) == len(payload["records"])  # a line as each record is taken
    assert "small q16 fold chunk_state (sweep) block_s=16 block_p=8 block_n=8 occupancy=2: " \
        "1.000 ms" in lines
    assert chosen == ["fold", "walk", "kernel"]  # the default first: chunk_state folded into
    # chunk_scan after the walk; then chunk_state's own kernels; dprev_states by the states kernel
    sweep = [r for r in payload["records"] if r["what"] == "chunk_scan (sweep)"]
    assert {r["dprev"] for r in sweep} == {"fold"}  # the sweep takes the first placement
    assert sorted((r["head_splits"], r["warps"]) for r in sweep) == [(1, 4), (1, 8), (2, 4),
                                                                     (2, 8)]
    # the default point: head_splits' rule for this shape, 4 warps
    assert [(r["head_splits"], r["warps"]) for r in sweep if r["default"]] == [(2, 4)]
    state = [r for r in payload["records"] if r["what"] == "chunk_state (sweep)"]
    assert [(r["block_s"], r["block_p"], r["block_n"], r["occupancy"], r["default"])
            for r in state] == [(64, 32, 32, 4, True), (16, 8, 8, 2, False)]  # at the first
    passing = [r for r in payload["records"] if r["what"] == "state_passing (sweep)"]  # placement
    assert [(r["block_p"], r["block_n"], r["occupancy"], r["default"]) for r in passing] == [
        (8, 8, 4, False)]
    assert "chunk_state's backward by" in BS.table(payload)
    assert "state_passing's backward by" in BS.table(payload)
    for dprev in BS.PLACEMENTS:  # the torch table has no fold: its four stages each time
        assert {r["what"] for r in payload["records"] if r["dprev"] == dprev} >= {
            *BS.STAGES[:-1], "forward", "forward+backward"}


def test_breakdown_adds_up_and_the_table_marks_the_default():
    where = dict(shape="s", dims=[1], chunk_size=64, dprev="walk")
    ms = dict(chunk_scan=0.5, state_passing=0.1, chunk_state=0.2, chunk_cumsum=0.05,
              forward=0.3, **{"forward+backward": 1.3})
    records = [dict(where, what=k, median_ms=v, head_splits=4 if k == "chunk_scan" else None)
               for k, v in ms.items()]
    records += [dict(where, what="chunk_scan (sweep)", head_splits=s, block_q=64,
                     rows_block_q=None, warps=8, occupancy=None, default=s == 4,
                     median_ms=0.6 / s)
                for s in (1, 4)]
    (row,) = BS.breakdown(records)
    assert row["stages"] == pytest.approx(0.85) and row["backward"] == pytest.approx(1.0)
    assert row["between stages"] == pytest.approx(0.15)
    text = BS.table(dict(records=records, settings=dict(reps=30)))
    assert "    4    64  None     8  None*     0.150" in text
    assert "    1    64  None     8  None      0.600" in text


def test_breakdown_of_the_folded_stages_counts_the_walk_once():
    """With fold (chunk_scan's and chunk_state's backward in one call that runs the walk
    inside) the stages' sum is fold + chunk_cumsum; the stages it replaces print as '–'."""
    where = dict(shape="s", dims=[1], chunk_size=64, dprev="fold")
    ms = dict(fold=0.9, state_passing=0.1, chunk_cumsum=0.05, forward=0.3,
              **{"forward+backward": 1.3})
    records = [dict(where, what=k, median_ms=v, head_splits=4 if k == "fold" else None)
               for k, v in ms.items()]
    (row,) = BS.breakdown(records)
    assert row["stages"] == pytest.approx(0.95) and row["chunk_scan"] is None
    assert row["between stages"] == pytest.approx(0.05)
    line = BS.table(dict(records=records, settings=dict(reps=30))).splitlines()[-1]
    assert line.split()[3:8] == ["4", "–", "0.100", "–", "0.050"]


@pytest.mark.parametrize("argv, match", [(["--shapes", "nope"], "--shapes: nope unknown"),
                                         (["--chunks", "48"], r"--chunks: \[48\]"),
                                         (["--head-splits", "0"], r"--head-splits: \[0\]"),
                                         (["--head-splits", "a"], "comma-separated integers"),
                                         (["--block-q", "48"], r"--block-q: \[48\]"),
                                         (["--rows-block-q", "4"], r"--rows-block-q: \[4\]"),
                                         (["--warps", "6"], r"--warps: \[6\]"),
                                         (["--occupancy", "0"], r"--occupancy: \[0\]"),
                                         (["--dprev", "both"],
                                          r"--dprev: \['both'\] not of fold, walk, kernel"),
                                         (["--state-tiles", "64x32"],
                                          r"--state-tiles: \[\(64, 32, None\)\] not 3"),
                                         (["--state-tiles", "64xax32"], r"not NxNxN\[@O\]"),
                                         (["--passing-tiles", "64x48"],
                                          r"--passing-tiles: \[\(64, 48, None\)\] not 2"),
                                         (["--passing-tiles", "64x64@0"],
                                          "the occupancy after @ is 1..32")])
def test_bad_arguments_are_refused_by_name(argv, match, capsys):
    with pytest.raises(SystemExit):
        BS.main(argv)
    assert re.search(match, capsys.readouterr().err)
