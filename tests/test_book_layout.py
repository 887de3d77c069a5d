"""ssd.book.layout on the recorded layout study and compiled resources: the layout chapter's
tables agree with the raw records, the cost model with a count by hand, and the rules and
figure names it quotes with ssd.config and the chapter. CPU only, a few seconds."""
from __future__ import annotations

import json
import re

import pytest

import ssd.config as config
from ssd.book import layout as L
from ssd.book.recordings import RESULTS, load_recorded
from ssd.tools import bench

CHAPTER = RESULTS.parent / "notebooks" / "09_layout_tiling.ipynb"


@pytest.fixture(scope="module")
def study():
    return load_recorded("study")


@pytest.fixture(scope="module")
def resources():
    return json.loads((RESULTS / "compile" / "sm_90_resources.json").read_text())


def rows_of(study, shape):
    return [r for r in study["rows"] if r["shape"] == shape]


def test_study_table_one_row_a_shape(study):
    table = L.study_table(study)
    assert table.column("shape") == L.shapes(study)
    for r in table.rows:
        assert r["points"] == len(rows_of(study, r["shape"]))
        assert r["default"] == L.default_row(study, r["shape"])["label"]
    assert "<table" in table._repr_html_() and "shape" in repr(table)


def test_path_bytes_by_hand():
    b, l, h, p, n, g = dims = (2, 256, 4, 8, 16, 1)
    q = 64
    c, io = l // q, 2
    states = b * c * h * p * n
    x, bc, dt, chunked = b * l * h * p, b * l * g * n, b * l * h, b * h * c * q
    final = b * h * p * n * 4
    stage1 = dt * io + 2 * chunked * 4
    walk_in = (x + bc) * io + 2 * chunked * 4            # x, B, dt_out, dA_cumsum
    scan_in = (x + 2 * bc) * io + 2 * chunked * 4        # x, B, C, dt_out, dA_cumsum
    y = x * io
    got = L.path_bytes(dims, q)
    assert got["one kernel"] == stage1 + scan_in + y + final
    assert got["fused"] == stage1 + walk_in + 2 * states * io + final + scan_in + y
    # split adds the fp32 chunk states written and read back, and the chunk-end decays read
    assert got["split"] - got["fused"] == 2 * states * 4 + b * h * c * 4
    assert got["chunk states"] == 2 * states * 4 and got["entering states"] == 2 * states * io


def test_traffic_table_reads_the_study(study):
    table = L.traffic_table(study, bandwidth=1e12)
    for r in table.rows:
        assert r["split MB"] > r["fused MB"] > r["one kernel MB"]
        assert r["fused floor ms"] == pytest.approx(r["fused MB"] * 1e6 / 1e12 * 1e3)
        split = next(x for x in rows_of(study, r["shape"]) if x["factor"] == "stage 2 split")
        assert r["split ms"] == split["median_ms"]
        dflt = L.default_row(study, r["shape"])
        key = "one kernel ms" if L.config_of(dflt).fused_scan.enabled else "fused ms"
        assert r[key] == dflt["median_ms"]
    assert "split floor ms" not in L.traffic_table(study).columns


def test_chunk_size_table_ratios(study):
    table = L.chunk_size_table(study)
    for s in L.shapes(study):
        mine = table.where(shape=s)
        assert [r["q"] for r in mine] == sorted(r["q"] for r in mine)
        assert table.where(shape=s, q=bench.OUR_CHUNK)[0]["ratio"] == 1.0
        for r in mine:
            raw = next(x for x in rows_of(study, s) if x["chunk_size"] == r["q"]
                       and x["factor"] in ("default", "chunk size"))
            assert r["ms"] == raw["median_ms"]
            assert r["chunks"] * r["q"] >= raw["dims"][1]


def test_blocks_per_sm():
    use = lambda regs, shared: dict(registers=regs, shared_bytes=shared)  # noqa: E731
    assert L.blocks_per_sm(use(128, 93544)) == 2
    assert L.blocks_per_sm(use(255, 1000)) == 1
    assert L.blocks_per_sm(use(80, 51688)) == 3
    assert L.blocks_per_sm(use(64, 51704)) == 4
    assert L.blocks_per_sm(use(64, 120 * 1024)) == 1   # shared memory bounds it


def test_stage2_table_waves(study, resources):
    table = L.stage2_table(study, resources)
    assert table.rows, "no three-stage base in the study"
    sms, dims = L.sm_count(study), L.dims_of(study)
    ratios = L.ratios(study)
    for r in table.rows:
        if r["factor"] == "base":
            assert r["ratio"] == 1.0
        if r["fit"]:
            assert r["waves"] == pytest.approx(r["blocks"] / (r["fit"] * sms))
        b, _, h, p, n, _ = dims[r["shape"]]
        assert r["blocks"] % (b * h) == 0
    # each point's ratio is the one bench.study_ratios reads
    shipped = {(r["shape"], r["factor"], r["block_n"], r["occupancy"]): r["ratio"]
               for r in table.rows}
    for row in study["rows"]:
        if row["factor"] in L.STAGE2_FACTORS:
            st = L.config_of(row).state
            key = (row["shape"], row["factor"], st.slices(dims[row["shape"]][3],
                                                          dims[row["shape"]][4])[0],
                   st.occupancy)
            if key in shipped:
                assert shipped[key] == pytest.approx(ratios[row["shape"], row["label"]])


@pytest.mark.parametrize("make", [L.scan_tiles_table, L.occupancy_table])
def test_resource_tables(study, resources, make):
    table = make(study, resources)
    res = L.resource_index(resources)
    for r in table.rows:
        assert r["regs"] is not None, r
        assert r["fit"] == L.blocks_per_sm(dict(registers=r["regs"],
                                                shared_bytes=round(r["shared_KiB"] * 1024)))
        assert all(0.5 < x < 5 for x in r["ratios"])
    assert any(str(r.get("change", r.get("hint"))).endswith("(shipped)") for r in table.rows)
    # the registers shown are the compiled kernel's for a point of the study
    labels = {label for label, _ in res}
    assert all(r["label"] in labels for r in study["rows"])


def test_one_kernel_table_follows_the_rule(study):
    table = L.one_kernel_table(study)
    sms = L.sm_count(study)
    dims = {**{s.name: s.dims for s in bench.SUITES["models"]}, **L.dims_of(study)}
    for r in table.rows:
        b, l, h, p, n, g = dims[r["shape"]]
        assert r["takes"] == config.fused_scan_fills(config.FusedScanConfig(), (b, h, p, n), sms)
        assert r["takes"] == bench.shape_default(dims[r["shape"]], sms).fused_scan.enabled
        assert 0 < r["fill"] <= 1
        if r["one_over_three"]:
            one = L.default_row(study, r["shape"])
            three = bench.study_base(study["rows"], r["shape"])
            assert r["one_over_three"] == pytest.approx(one["median_ms"] / three["median_ms"])


def test_rules_quote_config_and_point_at_the_chapter():
    nb = json.loads(CHAPTER.read_text())
    meta_names = {c["metadata"].get("mystnb", {}).get("figure", {}).get("name")
                  for c in nb["cells"] if c["cell_type"] == "code"}
    prose = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    sections = set(re.findall(r"^\((layout-[a-z0-9-]+)\)=$", prose, re.M))
    assert set(L.FIGURES) <= meta_names
    table = L.rules_table()
    assert len(table.rows) == len(L.RULES)
    for (_, consts, _, evidence), row in zip(L.RULES, table.rows):
        for c in consts:
            assert hasattr(config, c), c
            assert c in row["constants"]
        for ref in evidence.split(", "):
            assert (ref in L.FIGURES or ref in sections or ref.startswith("chapter ")), ref
    assert f"FUSED_SCAN_MAX_WAVES = {config.FUSED_SCAN_MAX_WAVES}" in table.rows[-1]["constants"]


def test_shipped_table_matches_the_api(study):
    sms = L.sm_count(study)
    table = L.shipped_table(study)
    for r in table.rows:
        s = next((x for x in bench.SUITES["models"] if x.name == r["shape"]), None)
        if s is None:
            continue
        cfg = bench.shape_default(s.dims, sms)
        assert r["shipped"] == bench.config_label(bench.OUR_CHUNK, cfg)
        assert ("one kernel" in r["rules"]) == cfg.fused_scan.enabled
    for s in L.shapes(study):  # the study timed what the API ships
        assert table.where(shape=s)[0]["shipped"] == L.default_row(study, s)["label"]


def test_default_vs_best(study):
    table = L.default_vs_best(study)
    for r in table.rows:
        mine = rows_of(study, r["shape"])
        assert r["best_ms"] == min(x["median_ms"] for x in mine)
        assert r["gap_pct"] >= 0
    assert len(L.to_default(study)) == len(study["rows"]) - len(L.shapes(study))


def test_figures(study, resources):
    for fig in (L.plot_chunk_size(study), L.plot_stage2_waves(study, resources),
                L.plot_one_kernel_fill(study), L.plot_default_vs_best(study)):
        assert fig.axes and fig.dpi <= 100


def test_prose_helpers():
    assert L.span([1.234, 1.5]) == "1.23–1.50" and L.span([2.0, 2.001]) == "2.00"
    assert L.join(["a"]) == "a" and L.join("abc") == "a, b and c"
    assert L.verdict([0.9, 0.95]) == "faster on every shape"
    assert L.verdict([0.9, 1.1]) == "faster on some shapes and slower on others"
    assert L.by_value({"a": 64, "b": 64}) == "64 on every shape"
    assert L.by_value({"a": 64, "b": 128}) == "64 on a, 128 on b"
