"""Tile configuration objects: validation, clamping to the problem, the dtype of the entering
states (CPU only)."""
import pytest

from ssd.config import ScanConfig, SSDConfig, StateConfig, default_config


@pytest.mark.parametrize("kwargs", [dict(block_p=48), dict(block_n=0), dict(block_k=3),
                                    dict(occupancy=0), dict(occupancy=33),
                                    dict(state_dtype="float64")])
def test_state_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        StateConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(block_h=3), dict(block_m=96), dict(occupancy=-1),
                                    dict(block_m=32, block_s=64)])
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
    from ssd import _launch, state_passing

    states = torch.zeros(1, 2, 2, 64, 128)
    dA = torch.zeros(1, 2, 2, 64)
    with _launch.capture() as records:
        with pytest.raises(ValueError, match="state_dtype"):
            state_passing.state_passing(states, dA, config=StateConfig(fused=False))
        state_passing.state_passing(states, dA, config=StateConfig(fused=False, state_dtype="float32"))
    assert len(records) == 1


def test_unmeasured_architectures_fall_back_to_the_sm90_default():
    assert default_config((8, 0)) == default_config((10, 0)) == default_config((9, 0))
