"""Tile configuration objects: validation, clamping to the problem, the dtype of the entering
states (CPU only)."""
from dataclasses import replace

import pytest

from ssd.config import FusedScanConfig, ScanConfig, SSDConfig, StateConfig, default_config


@pytest.mark.parametrize("kwargs", [dict(block_p=48), dict(block_n=0), dict(block_k=3),
                                    dict(occupancy=0), dict(occupancy=33),
                                    dict(state_dtype="float64"), dict(groups=0),
                                    dict(groups=2, fused=False)])
def test_state_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StateConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(block_h=3), dict(block_m=96), dict(occupancy=-1),
                                    dict(block_m=32, block_s=64),
                                    dict(whole_chunk=True, persistent=False), dict(shared=True)])
def test_scan_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        ScanConfig(**kwargs)


@pytest.mark.parametrize("heads_per_group, block_h", [(1, 1), (2, 2), (3, 1), (6, 2), (16, 2)])
def test_head_block_divides_heads_per_group(heads_per_group, block_h):
    cfg = SSDConfig(scan=ScanConfig(block_h=2)).for_problem(256, 64, 128, heads_per_group)
    assert cfg.scan.block_h == block_h


def test_for_problem_clamps_tiles_to_the_problem():
    cfg = SSDConfig(state=StateConfig(block_p=64, block_n=128),
                    scan=ScanConfig(block_m=128, block_s=64, block_p=64, block_h=4))
    small = cfg.for_problem(chunk_size=32, headdim=17, dstate=16, heads_per_group=12)
    assert (small.scan.block_m, small.scan.block_s, small.scan.block_p) == (32, 32, 32)
    assert (small.state.block_p, small.state.block_n) == (32, 16)
    assert small.scan.block_h == 4
    assert cfg.for_problem(256, 64, 128, 4).scan == cfg.scan  # nothing to clamp


@pytest.mark.parametrize("state_dtype, input_dtype, stored", [
    ("input", "bfloat16", "bfloat16"), ("input", "float32", "float32"),
    ("input", "float16", "float16"), ("float32", "bfloat16", "float32"),
    ("bfloat16", "float32", "bfloat16")])
def test_entering_state_dtype(state_dtype, input_dtype, stored):
    cfg = SSDConfig(state=StateConfig(state_dtype=state_dtype))
    assert cfg.state.storage_dtype(input_dtype) == stored
    assert cfg.for_problem(256, 64, 128, 1, input_dtype=input_dtype).state.state_dtype == stored
    assert cfg.for_problem(256, 64, 128, 1).state.state_dtype == state_dtype  # unresolved


def test_split_state_passing_needs_a_resolved_state_dtype():
    torch = pytest.importorskip("torch")
    pytest.importorskip("cuda.tile")
    from ssd import launch
    from ssd.kernels import state_passing

    states = torch.zeros(1, 2, 2, 64, 128)
    dA = torch.zeros(1, 2, 2, 64)
    with launch.capture() as records:
        with pytest.raises(ValueError, match="state_dtype"):
            state_passing.state_passing(states, dA, config=StateConfig(fused=False))
        state_passing.state_passing(states, dA, config=StateConfig(fused=False, state_dtype="float32"))
    assert len(records) == 1


def test_unmeasured_architectures_fall_back_to_the_sm90_default():
    assert default_config((8, 0)) == default_config((10, 0)) == default_config((9, 0))


def test_state_slices_match_the_stage2_launch_grids():
    """StateConfig.slices is the one formula for the stage-2 grids; the launchers use it."""
    import torch

    from ssd import launch
    from ssd.api import forward_stages

    assert StateConfig(block_p=64, block_n=32).slices(64, 128) == (32, 4, 4)
    assert StateConfig(block_p=32, block_n=16).slices(64, 128) == (16, 8, 16)
    assert StateConfig(block_p=64, block_n=32).slices(48, 24) == (32, 1, 1)  # n=24 pads to 32
    b, l, h, p, n = 2, 200, 4, 48, 24
    for fused in (True, False):
        cfg = SSDConfig(state=StateConfig(block_p=16, block_n=8, fused=fused))
        with launch.capture() as recs:
            forward_stages(torch.randn(b, l, h, p), torch.rand(b, l, h), -torch.rand(h),
                           torch.randn(b, l, 1, n), torch.randn(b, l, 1, n), 64, config=cfg)
        grids = {r.kernel._pyfunc.__name__: r.grid for r in recs}
        assert grids["state_passing_kernel"] == (b, h, 3 * 3)  # cdiv(48, 16) * cdiv(24, 8)
        if not fused:
            assert grids["chunk_state_kernel"] == (b * 4, h, 9)


def test_from_dict_reads_recordings_made_before_a_field_existed():
    """A recording's config dict round-trips; a field it lacks takes its default; an unknown one
    raises."""
    from dataclasses import asdict

    cfg = SSDConfig(state=StateConfig(block_n=16, fused=False), scan=ScanConfig(block_h=1))
    record = asdict(cfg)
    assert SSDConfig.from_dict(record) == cfg
    del record["state"]["warps"]                      # as if warps were added after the record
    assert SSDConfig.from_dict(record) == cfg
    record["scan"]["no_such_field"] = 1
    with pytest.raises(TypeError):
        SSDConfig.from_dict(record)


@pytest.mark.parametrize("b,h,narrow", [(1, 80, True), (4, 80, False), (8, 24, False)])
def test_default_narrows_stage2_slices_where_the_fused_walk_has_few_blocks(b, h, narrow):
    """On 132 SMs, one sequence of 80 heads (long-16k) gives the wide default 160 fused-walk
    blocks, under two per SM: the default takes the narrow slices there, and only there."""
    from ssd.config import MIN_STAGE2_BLOCKS_PER_SM, NARROW_STATE

    wide = default_config((9, 0))
    cfg = default_config((9, 0), problem=(b, h, 64, 128), sms=132)
    assert (b * h * wide.state.slices(64, 128)[2] < MIN_STAGE2_BLOCKS_PER_SM * 132) is narrow
    want = replace(wide.state, **NARROW_STATE) if narrow else wide.state
    assert cfg.state == want and cfg.scan == wide.scan
    if narrow:  # the narrow slices double the blocks
        assert cfg.state.slices(64, 128)[2] == 2 * wide.state.slices(64, 128)[2]


@pytest.mark.parametrize("b,h,q,one_wave", [
    (4, 80, 64, True),     # 2.7b: 640 blocks of 64-wide slices > 528 resident; 320 whole <= 396
    (4, 80, 128, False),   # the same problem at chunk 128, where whole states are slower
    (4, 80, None, False),  # no chunk size given: the default as before the rule
    (2, 128, 64, False),   # codestral-7b: 512 blocks fit one wave already
    (8, 24, 64, False),    # 130m: 384
    (8, 80, 64, False),    # 1280 blocks; 640 whole states would need two waves too
    (1, 80, 64, False),    # long-16k: the narrow slices (160 blocks < 2 a SM)
    (1, 264, 64, False),   # the edges on 132 SMs: 528 sliced blocks fit at four a SM ...
    (1, 265, 64, True),    # ... 530 do not, and 265 whole states fit at three
    (2, 198, 64, True),    # 396 whole states fit at three a SM ...
    (1, 397, 64, False),   # ... 397 do not
])
def test_default_takes_whole_states_where_they_make_stage2_one_wave(b, h, q, one_wave):
    """On 132 SMs, at chunk size 64 only: the default's stage-2 occupancy (four resident blocks a
    SM) for its 64-wide slices, ONE_WAVE_STATE's (three) for whole states."""
    from ssd.config import ONE_WAVE_STATE

    base = default_config((9, 0))
    cfg = default_config((9, 0), problem=(b, h, 64, 128), sms=132, chunk_size=q)
    whole = replace(base.state, **ONE_WAVE_STATE)
    assert (cfg.state == whole) is one_wave
    assert cfg.scan == default_config((9, 0), chunk_size=q).scan   # chunk_scan as at any problem
    sliced_blocks, whole_blocks = (b * h * st.slices(64, 128)[2] for st in (base.state, whole))
    fits = lambda blocks, st: blocks <= st.occupancy * 132  # noqa: E731
    assert one_wave is (q == 64 and not fits(sliced_blocks, base.state) and fits(whole_blocks, whole)
                        and sliced_blocks >= 2 * 132)


@pytest.mark.parametrize("b, h, q, l, groups", [
    (1, 80, 64, 16384, 4),    # long-16k: 160 sliced blocks < 2 a SM; 4 x 80 whole states fit at three
    (1, 80, 64, 8129, 4),     # 128 chunks, the last one ragged: GROUPED_MIN_CHUNKS ...
    (1, 80, 64, 8128, 1),     # ... 127 chunks: too short (the narrow slices)
    (1, 80, 64, 512, 1),      # a short prompt
    (1, 80, 64, None, 1),     # the length unknown
    (1, 80, 128, 32768, 1),   # only at chunk 64
    (1, 99, 64, 16384, 4),    # 396 grouped whole states fit at three a SM on 132 SMs ...
    (1, 100, 64, 16384, 1),   # ... 400 do not: the narrow slices
    (2, 66, 64, 16384, 1),    # 264 sliced blocks: 2 a SM, not few
    (4, 80, 64, 16384, 1),    # 2.7b's pattern: the one-wave walk, not grouped
])
def test_default_walks_few_sequences_in_groups_of_chunks(b, h, q, l, groups):
    """Where the fused walk would take NARROW_STATE at chunk 64 on sm_90, the default walks whole
    states (ONE_WAVE_STATE) in GROUPED_WALK groups of chunks, if those fit in one wave and the
    sequences span GROUPED_MIN_CHUNKS chunks."""
    from ssd.config import GROUPED_MIN_CHUNKS, GROUPED_WALK, NARROW_STATE, ONE_WAVE_STATE

    assert GROUPED_MIN_CHUNKS == 128   # the rows' lengths
    cfg = default_config((9, 0), problem=(b, h, 64, 128), sms=132, chunk_size=q, seqlen=l)
    assert cfg.state.groups == groups
    if groups > 1:
        assert groups == GROUPED_WALK
        assert cfg.state == replace(default_config((9, 0)).state, **ONE_WAVE_STATE, groups=groups)
    narrow = replace(default_config((9, 0)).state, **NARROW_STATE)
    assert (cfg.state == narrow) is (groups == 1 and b * h * 2 < 2 * 132)
    # not for small states, not off sm_90
    for cap, n in (((9, 0), 64), ((10, 0), 128)):
        assert default_config(cap, problem=(b, h, 64, n), sms=132, chunk_size=q,
                              seqlen=l).state.groups == 1


def test_whole_states_only_where_measured(monkeypatch):
    """Not on another architecture than sm_90, not without an occupancy hint (the resident blocks
    unknown), not for a state wider than one whole-state slice."""
    from ssd.config import ONE_WAVE_STATE

    two_seven_b = dict(problem=(4, 80, 64, 128), sms=132, chunk_size=64)
    whole = replace(default_config((9, 0)).state, **ONE_WAVE_STATE)
    assert default_config((9, 0), **two_seven_b).state == whole
    assert default_config((8, 0), **two_seven_b).state != whole
    assert default_config((10, 0), **two_seven_b).state != whole
    wide = default_config((9, 0), problem=(4, 40, 64, 256), sms=132, chunk_size=64)
    assert wide.state == default_config((9, 0)).state   # 640 blocks at state 256, but no whole state
    # a default without an occupancy hint: the rule stays out
    import ssd.config as cfgmod

    hintless = replace(cfgmod._DEFAULTS[9], state=replace(cfgmod._DEFAULTS[9].state, occupancy=None))
    monkeypatch.setitem(cfgmod._DEFAULTS, 9, hintless)
    assert default_config((9, 0), **two_seven_b).state == hintless.state


@pytest.mark.parametrize("problem", [None, (8, 24, 64, 128), (4, 80, 64, 128), (1, 80, 64, 128)])
def test_chunk_scan_takes_its_chunk64_tiles_at_chunk_64_only(problem):
    """chunk_scan's whole-chunk tiles loaded once with the hint of 2 at chunk 64 (CHUNK64_SCAN),
    whatever stage 2 the problem takes (130m: sliced, 2.7b: whole states, one sequence:
    narrow); not at other chunk sizes, not on another architecture, not for the whole-chunk
    tiles of a small state (one head, the default's hint)."""
    from ssd.config import CHUNK64, CHUNK64_SCAN

    kw = dict(problem=problem, sms=132 if problem else None)
    at64 = default_config((9, 0), chunk_size=CHUNK64, **kw)
    assert at64.scan == replace(default_config((9, 0), **kw).scan, **CHUNK64_SCAN)
    assert at64.state == default_config((9, 0), chunk_size=CHUNK64, **kw).state
    for q in (16, 32, 128, 256, None):
        other = default_config((9, 0), chunk_size=q, **kw).scan
        assert other.occupancy == default_config((9, 0)).scan.occupancy != CHUNK64_SCAN["occupancy"]
        assert not other.whole_chunk and not other.shared
    assert default_config((10, 0), chunk_size=CHUNK64, **kw).scan == default_config((10, 0), **kw).scan
    small = default_config((9, 0), problem=(16, 32, 64, 64), sms=132, chunk_size=CHUNK64)
    assert small.scan.whole_chunk and small.scan.shared and small.scan.block_h == 1
    assert small.scan.occupancy == default_config((9, 0)).scan.occupancy


def test_resolve_config_passes_the_chunk_size(monkeypatch):
    """The API resolves the default at the caller's chunk size: the one-wave rule reaches it."""
    import torch

    from ssd import api
    from ssd.config import ONE_WAVE_STATE

    class H200:
        major, minor, multi_processor_count = 9, 0, 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H200)
    x = torch.empty(4, 128, 80, 64, device="meta")
    B = torch.empty(4, 128, 1, 128, device="meta")
    at64, at128 = (api.resolve_config(None, q, x, B).state for q in (64, 128))
    assert at64.block_n == ONE_WAVE_STATE["block_n"] and at64.block_k == ONE_WAVE_STATE["block_k"]
    assert at128.block_n == default_config((9, 0)).state.block_n


def test_persistent_chunk_scan_launches_one_axis_of_blocks():
    import torch

    from ssd import launch
    from ssd.api import forward_stages

    b, l, h, p, n = 1, 256, 4, 64, 128
    with launch.capture() as recs:
        forward_stages(torch.randn(b, l, h, p), torch.rand(b, l, h), -torch.rand(h),
                       torch.randn(b, l, 1, n), torch.randn(b, l, 1, n), 128,
                       config=SSDConfig(scan=ScanConfig(persistent=True)))
    scan = next(r for r in recs if r.kernel._pyfunc.__name__ == "chunk_scan_kernel")
    assert scan.grid[1:] == (1, 1)


@pytest.mark.parametrize("whole_chunk, shared, seqlen, tiles, constants", [
    (False, False, 256, 2 * 2 * 2, (False, False)),
    (True, False, 256, 2 * 2, (True, False)),
    (True, True, 256, 2 * 2, (True, True)),
    (True, True, 200, 2 * 2, (True, False))])
def test_whole_chunk_tiles_cover_every_row_block_once(whole_chunk, shared, seqlen, tiles, constants):
    """The persistent grid is capped by the tile count: a whole-chunk tile holds both row blocks
    of a 128-chunk (block_m 64), so there are half as many tiles. (1 sequence, 2 chunks,
    4 heads in head blocks of 2, one channel slice; CPU capture, 1 "SM".) The kernel's last two
    constants, WHOLE_CHUNK and SHARED: tiles loaded once only where every chunk is full."""
    import torch

    from ssd import launch
    from ssd.api import forward_stages

    b, l, h, p, n = 1, seqlen, 4, 64, 128
    config = SSDConfig(scan=ScanConfig(whole_chunk=whole_chunk, shared=shared, occupancy=32))
    with launch.capture() as recs:
        forward_stages(torch.randn(b, l, h, p), torch.rand(b, l, h), -torch.rand(h),
                       torch.randn(b, l, 1, n), torch.randn(b, l, 1, n), 128, config=config)
    scan = next(r for r in recs if r.kernel._pyfunc.__name__ == "chunk_scan_kernel")
    assert scan.grid == (tiles, 1, 1) and scan.args[-3:-1] == constants  # then GROUPED


def test_small_states_take_their_own_tiles_at_chunk_128_and_256():
    """SMALL_STATE_AT on sm_90: the whole-chunk tiles of one head at the hint of 2 at chunk 128,
    64-row tiles at 256 (where the whole-chunk tile spills); elsewhere and off sm_90 the
    whole-chunk tiles at the default's hint."""
    from ssd.config import SMALL_STATE_AT, SMALL_STATE_SCAN

    small = dict(problem=(16, 32, 64, 64), sms=132)
    base = default_config((9, 0)).scan
    assert default_config((9, 0), chunk_size=128, **small).scan == replace(
        base, **SMALL_STATE_SCAN, occupancy=2)
    at256 = default_config((9, 0), chunk_size=256, **small).scan
    assert at256 == replace(base, **{**SMALL_STATE_SCAN, **SMALL_STATE_AT[256]})
    assert not at256.whole_chunk and not at256.shared and at256.block_h == 1
    for cap, q in (((9, 0), 32), ((9, 0), None), ((10, 0), 128), ((10, 0), 256)):
        scan = default_config(cap, chunk_size=q, **small).scan
        assert scan == replace(default_config(cap).scan, **SMALL_STATE_SCAN), (cap, q)
    big = default_config((9, 0), chunk_size=256, problem=(8, 24, 64, 128), sms=132).scan
    assert big == base   # state 128: not a small state


@pytest.mark.parametrize("b, h, n, l", [
    (8, 24, 128, 2048),     # 130m: inference takes the one kernel
    (2, 128, 128, 8192),    # codestral-7b: the one kernel
    (16, 32, 64, 1024),     # small-state: the one kernel
    (1, 80, 128, 16384),    # long-16k: the grouped walk
])
def test_a_training_forward_stores_every_entering_state(b, h, n, l):
    """stores_states (the autograd forward's): neither the one kernel nor the grouped walk, which
    keep the entering states the backward reads out of memory; the rest of the rule stands."""
    args = dict(problem=(b, h, 64, n), sms=132, chunk_size=64, seqlen=l)
    inference = default_config((9, 0), **args)
    training = default_config((9, 0), **args, stores_states=True)
    assert inference.fused_scan.enabled or inference.state.groups > 1  # what the rows test
    assert not training.fused_scan.enabled and training.state.groups == 1
    assert training.scan == inference.scan


@pytest.mark.parametrize("kwargs", [dict(block_p=48), dict(occupancy=0), dict(occupancy=2.5)])
def test_fused_scan_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        FusedScanConfig(**kwargs)


# The model suite's shapes (b, h, p, n) on the H200's 132 SMs at chunk 64: the one kernel is
# faster on the first three and slower on the last two (chapter 9, fig-one-kernel); a serving batch of 8 x 80 heads needs three waves, more than measured.
@pytest.mark.parametrize("name,problem,taken", [
    ("codestral-7b", (2, 128, 64, 128), True), ("small-state", (16, 32, 64, 64), True),
    ("130m", (8, 24, 64, 128), True), ("2.7b", (4, 80, 64, 128), False),
    ("long-16k", (1, 80, 64, 128), False), ("prompts-8x1k", (8, 80, 64, 128), False),
    ("state 256", (2, 128, 64, 256), False), ("headdim 128", (2, 128, 128, 128), False)])
def test_default_takes_one_kernel_where_its_grid_fills_the_gpu(name, problem, taken):
    """ssd.config.fused_scan_fills, at chunk 64 on sm_90 only."""
    b = problem[0]
    cfg = default_config((9, 0), problem=problem, sms=132, chunk_size=64, seqlen=4096 // b)
    assert cfg.fused_scan.enabled is taken
    for capability, q in (((9, 0), 128), ((9, 0), 256), ((10, 0), 64), ((8, 0), 64)):
        assert not default_config(capability, problem=problem, sms=132, chunk_size=q,
                                  seqlen=4096 // b).fused_scan.enabled
    # the three stages stay configured as without the rule (seq_idx takes them)
    assert replace(cfg, fused_scan=FusedScanConfig()) == replace(
        default_config((9, 0), problem=problem, sms=132, chunk_size=64, seqlen=4096 // b),
        fused_scan=FusedScanConfig())


@pytest.mark.parametrize("bh,taken", [(175, False), (176, True), (264, True), (265, False),
                                      (351, False), (352, True), (528, True), (529, False)])
def test_one_kernel_fill_bounds(bh, taken):
    """Two thirds of the resident slots (2 x 132) of one or two waves, no third wave."""
    from ssd.config import fused_scan_fills

    assert fused_scan_fills(FusedScanConfig(), (1, bh, 64, 128), 132) is taken
    assert not fused_scan_fills(FusedScanConfig(occupancy=None), (1, bh, 64, 128), 132)


def test_recordings_before_the_one_kernel_read_as_three_stages():
    from dataclasses import asdict

    record = asdict(SSDConfig())
    del record["fused_scan"]
    assert not SSDConfig.from_dict(record).fused_scan.enabled


def test_for_problem_clamps_the_one_kernel_channel_block():
    cfg = SSDConfig(fused_scan=FusedScanConfig(enabled=True, block_p=64))
    assert cfg.for_problem(64, 24, 128, 1).fused_scan.block_p == 32
    assert cfg.for_problem(64, 96, 128, 1).fused_scan.block_p == 64


@pytest.mark.parametrize("kwargs", [dict(block_p=48), dict(block_p=0), dict(occupancy=0)])
def test_state_update_config_rejects_bad_values(kwargs):
    from ssd.config import StateUpdateConfig

    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StateUpdateConfig(**kwargs)


def test_state_update_block_p_rule():
    """The decode step's slice: STATE_UPDATE_TILE_BYTES of state (16 channels of a 128-wide fp32
    state, 32 of bf16), clamped to the head dim; halved while the grid has fewer blocks than the
    hint's resident slots (2.7b's 80 heads at batch 1: 8 channels, 640 blocks on 132 SMs), never
    below STATE_UPDATE_MIN_BLOCK_P; a block_p given is only clamped."""
    from ssd.config import (STATE_UPDATE_MIN_BLOCK_P, STATE_UPDATE_TILE_BYTES,
                            StateUpdateConfig, state_update_config)

    rule = lambda problem, nbytes, sms=132, **kw: state_update_config(  # noqa: E731
        StateUpdateConfig(**kw), problem, nbytes, sms).block_p
    assert rule((64, 80, 64, 128), 4) * 128 * 4 == STATE_UPDATE_TILE_BYTES
    assert (rule((64, 80, 64, 128), 4), rule((64, 80, 64, 128), 2)) == (16, 32)
    assert rule((64, 80, 32, 16), 4) == 32                    # the whole head
    assert rule((1, 80, 64, 128), 4) == 8 and rule((8, 80, 64, 128), 4) == 16
    assert rule((1, 2, 64, 128), 2) == STATE_UPDATE_MIN_BLOCK_P
    assert rule((1, 80, 64, 128), 4, sms=None) == 16          # no GPU: no fill rule
    assert rule((1, 80, 48, 128), 4, block_p=256) == 64 and rule((1, 80, 64, 128), 4, block_p=4) == 4
