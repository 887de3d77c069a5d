"""ssd.book.peers on the recordings the peers chapter reads: every table agrees with the raw
records it summarises, and every figure draws. CPU only, a few seconds."""
from __future__ import annotations

import io
import math

import matplotlib
import pytest

matplotlib.use("Agg")

from ssd.book import peers  # noqa: E402
from ssd.book.recordings import load_recorded  # noqa: E402
from ssd.tools.bench import best_records, speedups  # noqa: E402
from ssd.tools.env import BOOK_GPU  # noqa: E402


@pytest.fixture(scope="module")
def rec():
    return dict(models=load_recorded("models", gpu=BOOK_GPU),
                replayed=load_recorded("tilegym_replayed", gpu=BOOK_GPU),
                serving=load_recorded("serving", gpu=BOOK_GPU),
                first_call=load_recorded("first-call", gpu=BOOK_GPU))


def _names(payload):
    return list(dict.fromkeys(r["shape"] for r in payload["records"]))


def test_headline_is_the_benchmarks_speedup(rec):
    m, t = rec["models"], rec["replayed"]
    head = peers.headline(m, t)
    names = _names(m)
    assert [r["shape"] for r in head] == [*names, "geometric mean"]
    # ours over mamba_ssm: what the benchmark itself computed and stored when it ran
    for r in head.rows[:-1]:
        assert math.isclose(r["x_mamba_ssm"], m["speedup_vs_mamba_ssm"][r["shape"]], rel_tol=1e-12)
    assert math.isclose(head.rows[-1]["x_mamba_ssm"], m["speedup_vs_mamba_ssm"]["geomean"],
                        rel_tol=1e-12)
    # TileGym untuned from the same recording, TileGym tuned within the replay recording
    for over, payload, col in (("tilegym", m, "x_tilegym"),
                               ("tilegym_tuned", t, "x_tilegym_tuned")):
        sp = speedups(payload["records"], over=over)
        for r in head.rows[:-1]:
            assert math.isclose(r[col], sp[r["shape"]], rel_tol=1e-12)
        assert math.isclose(head.rows[-1][col], sp["geomean"], rel_tol=1e-12)
    ours = best_records(m["records"], "ssd")
    for r in head.rows[:-1]:
        o = ours[r["shape"]]
        assert (r["ours_ms"], r["ours_q"]) == (o["median_ms"], o["chunk_size"])
        assert r["ours_q20"] <= r["ours_ms"] <= r["ours_q80"]
    assert "× TileGym tuned" in repr(head) and "<table" in head._repr_html_()
    assert "x_tilegym_tuned" not in peers.headline(m).columns


def test_chunk_table_counts_each_at_its_fastest(rec):
    m = rec["models"]
    t = peers.chunk_table(m)
    for impl in ("ssd", "mamba_ssm"):
        fastest = peers.fastest_chunks(m, impl)
        for shape, q in fastest.items():
            mine = [r for r in t if r["impl"] == impl and r["shape"] == shape]
            assert len(mine) >= 2 and min(r["vs_fastest"] for r in mine) == 1.0
            assert t.find(impl=impl, shape=shape, chunk_size=q)["vs_fastest"] == 1.0
    assert peers.chunk_summary({"a": 64, "b": 64}) == "64 on all 2 shapes"
    assert (peers.chunk_summary({"a": 256, "b": 256, "c": 256, "d": 128})
            == "256 on 3 shapes, 128 on d")


def test_stage_tables_add_up_to_the_raw_kernels(rec):
    m, t = rec["models"], rec["replayed"]
    stages = peers.stage_table(m, t)
    assert set(stages.column("work")) <= set(peers.WORK_COLORS)
    work = peers.work_table(stages)
    raw = {("models", st["shape"], impl): st[impl] for st in m["stages"]
           for impl in ("ssd", "mamba_ssm") if impl in st}
    raw.update({("tilegym_replayed", s, impl): st[impl] for s, st in t["tilegym_stages"].items()
                for impl in ("ssd", "tilegym_tuned")})
    assert {(r["source"], r["shape"], r["impl"]) for r in work} == set(raw)
    for r in work:
        kernels = raw[r["source"], r["shape"], r["impl"]]
        assert r["kernels"] == len(kernels)
        assert math.isclose(r["sum_ms"], sum(kernels.values()), rel_tol=1e-12)
        # kernels timed alone account for the forward (eager launches and an empty L2 each)
        assert 0.8 < r["sum_over_forward"] < 1.3, r
    for r in peers.stage_ratios(work):
        assert r["peer"] in ("mamba_ssm", "tilegym_tuned") and 0 < r["outputs_share"] < 1
        assert (r["x_states"] is None) == (r["ours_kernels"] == 2)


def test_floor_table(rec):
    m, t = rec["models"], rec["replayed"]
    floor = peers.floor_table(m, t)
    ours = best_records(m["records"], "ssd")
    one = {st["shape"] for st in m["stages"] if peers.FUSED_SCAN_STAGE in st["ssd"]}
    for r in floor:
        o = ours[r["shape"]]
        assert math.isclose(r["ssd_pct"], 100 * o["floor_ms"] / o["median_ms"])
        assert r["bound"] == o["floor_bound"] and 0 < r["ssd_pct"] < 100
        assert r["ours_kernels"] == ("one kernel" if r["shape"] in one else "two kernels")
        assert (r["states_us"] is None) == (r["shape"] in one)
    # b c h p n entering states in bf16, written once and read once
    assert (peers.states_round_trip_bytes((4, 4096, 80, 64, 128, 1), 64)
            == 2 * 4 * 64 * 80 * 64 * 128 * 2)


def test_cache_and_launch_table(rec):
    m, s = rec["models"], rec["serving"]
    t = peers.cache_launch_table(m, s)
    assert len(t) == 3 * (len(_names(m)) + len(_names(s)))
    for r in t:
        payload = m if r["shape"] in _names(m) else s
        at = (payload["records"], r["shape"], r["impl"], r["chunk_size"])
        g = peers.record(*at, "graph", "warm")
        f = peers.record(*at, "graph", "flushed")
        e = peers.record(*at, "eager", "warm")
        assert math.isclose(r["warm_over_flushed"], g["median_ms"] / f["median_ms"])
        assert math.isclose(r["eager_over_graph"], e["median_ms"] / g["median_ms"])
    host = peers.host_bound(t)
    for impl, times in host.items():
        assert all(any(r["impl"] == impl and r["eager_warm"] == v and r["eager_over_graph"] > 1.5
                       for r in t) for v in times)


def test_first_call_and_tuning(rec):
    fc = peers.first_call_table(rec["first_call"])
    raw = rec["first_call"]["rows"]
    assert [r["shape"] for r in fc] == [r["shape"] for r in raw]
    for r, x in zip(fc, raw):
        assert r["first_s"] == x["first_s"] and 0 < r["compiled_in_call_s"] < r["first_s"]
        assert math.isclose(r["compiled_in_call_s"] + r["background_s"],
                            sum(map(sum, x["compile_s"].values())))
    tune = peers.tuning_table(rec["models"], rec["replayed"])
    best_m = best_records(rec["models"]["records"], "mamba_ssm")
    for r in tune:
        assert r["mamba_ssm_s"] == best_m[r["shape"]]["first_call_s"]
        src = rec["replayed"].get("tilegym_replayed_from", {}).get(r["shape"], {})
        assert r["tilegym_search_s"] == src.get("tuning_s")


def test_tuning_table_shows_no_first_call_of_kernels_compiled_ahead(rec):
    """A run that compiled our kernels first (bench.SuitePolicy.precompile) times a cache hit
    as ours' first call: the table shows none, and mamba_ssm's as recorded."""
    m = rec["models"]
    ahead = dict(m, records=[dict(r, precompiled=True) if r["impl"] == "ssd" else r
                             for r in m["records"]])
    for cold, warm in zip(peers.tuning_table(m), peers.tuning_table(ahead)):
        assert warm["ssd_s"] is None and warm["ssd_tuned_s"] is None
        assert cold["ssd_s"] is not None and warm["mamba_ssm_s"] == cold["mamba_ssm_s"]


def test_method_and_environment(rec):
    m = rec["models"]
    how = {r["what"]: r["how"] for r in peers.method_table(m)}
    assert str(m["settings"]["reps"]) in how["statistic"] and "0 failed" in how["correctness gate"]
    assert m["environment"]["gpu"] in peers.environment_line(m)


def test_figures_draw(rec):
    from matplotlib.figure import Figure

    m, t, s = rec["models"], rec["replayed"], rec["serving"]
    cache = peers.cache_launch_table(m, s)
    figs = {"chunks": peers.plot_chunk_sizes(m), "stages": peers.plot_stages(m, t),
            "roofline": peers.plot_roofline(m, t), "l2": peers.plot_l2(cache),
            "launches": peers.plot_launches(cache)}
    assert all(isinstance(f, Figure) for f in figs.values())
    assert len(figs["stages"].axes) == len(m["stages"])
    assert len(figs["roofline"].axes) == 2
    for f in figs.values():  # renders: a PNG of some size
        buf = io.BytesIO()
        f.savefig(buf, format="png")
        assert buf.tell() > 1000
