"""The cost model of ssd.cost, against counts worked out by hand."""

import pytest

from ssd.cost import STAGES, floor_ms, quadratic_flops, recurrence_flops, ssd_costs
from ssd.problem import MODEL_SHAPES


def test_tiny_problem_by_hand():
    # b=1 l=4 h=2 p=3 n=5 g=1, q=2 -> c=2, padded length 4. Element counts:
    # x, y: 24; B, C: 20; dt: 8; dt_out, dA_cumsum: 8; states: 60; final_states: 30.
    costs = ssd_costs((1, 4, 2, 3, 5, 1), 2, dtype_bytes=2, state_bytes=4)
    expected = {
        #                flops  read                     written
        "chunk_cumsum": (16, 8 * 2, 2 * 8 * 4),
        "chunk_state": (240, (24 + 20) * 2 + 2 * 8 * 4, 60 * 4),
        "state_passing": (120, (60 + 4) * 4, (60 + 30) * 4),
        # C B^T 2*c*q^2*n*h = 160, diagonal 2*c*h*q^2*p = 96, off-diagonal 2*h*4*n*p = 240
        "chunk_scan": (160 + 96 + 240, (24 + 2 * 20) * 2 + (2 * 8 + 60) * 4, 24 * 2),
    }
    for stage, (flops, read, written) in expected.items():
        got = costs[stage]
        assert (got["flops"], got["bytes_read"], got["bytes_written"]) == (flops, read, written), stage
        assert got["bytes"] == read + written
    assert costs["total"]["flops"] == 16 + 240 + 120 + 496
    assert costs["total"]["bytes"] == sum(costs[s]["bytes"] for s in STAGES)


def test_tail_chunk_is_padded():
    # l=5, q=2: c=3 chunks, padded length 6; dt is read at its real length 5.
    costs = ssd_costs((1, 5, 2, 3, 5, 1), 2)
    assert costs["chunk_cumsum"]["flops"] == 2 * 2 * 6
    assert costs["chunk_cumsum"]["bytes_read"] == 5 * 2 * 2
    assert costs["chunk_cumsum"]["bytes_written"] == 2 * (2 * 3 * 2) * 4


def test_options_z_and_cb_per_group():
    dims = (1, 4, 4, 3, 5, 2)  # two heads per group
    base = ssd_costs(dims, 2)["chunk_scan"]
    gated = ssd_costs(dims, 2, has_z=True)["chunk_scan"]
    assert gated["bytes_read"] - base["bytes_read"] == 1 * 4 * 4 * 3 * 2  # z, bf16
    shared = ssd_costs(dims, 2, cb_per_group=True)["chunk_scan"]
    cb_per_head = 2 * 2 * 2**2 * 5 * 4  # 2 c q^2 n h
    assert base["flops"] - shared["flops"] == cb_per_head // 2


def test_model_shape_2p7b_at_q256():
    # b4 l4096 h80 p64 n128 g1, q=256: c=16
    costs = ssd_costs(MODEL_SHAPES["2.7b"], 256)
    assert costs["chunk_state"]["flops"] == 2 * 4 * 80 * 4096 * 64 * 128 == 21_474_836_480
    assert costs["chunk_state"]["bytes_written"] == 4 * 16 * 80 * 64 * 128 * 4 == 167_772_160
    # diagonal block 2*b*c*h*q^2*p + C B^T per head 2*b*c*q^2*n*h + off-diagonal 2*b*h*l*n*p
    assert costs["chunk_scan"]["flops"] == (2 * 4 * 16 * 80 * 256**2 * 64
                                            + 2 * 4 * 16 * 256**2 * 128 * 80
                                            + 2 * 4 * 80 * 4096 * 128 * 64)


def test_states_traffic_falls_and_flops_rise_with_chunk_size():
    small, large = (ssd_costs(MODEL_SHAPES["2.7b"], q) for q in (32, 512))
    assert small["state_passing"]["bytes"] == 16 * large["state_passing"]["bytes"] - 15 * (
        4 * 80 * 64 * 128 * 4)  # final_states does not scale with c
    assert small["total"]["flops"] < large["total"]["flops"]


def test_floor_ms():
    stage = {"flops": 1e12, "bytes": 2e9}
    assert floor_ms(stage, 1e12, 1e15) == pytest.approx(2.0)  # memory bound: 2e9 B / 1e12 B/s
    assert floor_ms(stage, 1e13, 1e14) == pytest.approx(10.0)  # compute bound: 1e12 / 1e14
    costs = ssd_costs((1, 4, 2, 3, 5, 1), 2)
    assert floor_ms(costs, 1.0, 1e9) == pytest.approx(
        1e3 * sum(costs[s]["bytes"] for s in STAGES))


def test_recurrence_and_quadratic_flops():
    assert recurrence_flops(10, 2, 3) == 5 * 10 * 2 * 3
    assert quadratic_flops(10, 2, 3) == 100 * (6 + 4 + 1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_chunk_size(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_costs((1, 4, 2, 3, 5, 1), bad)


def test_bad_dims():
    with pytest.raises(ValueError, match="dims"):
        ssd_costs((1, 4, 3, 3, 5, 2), 2)


def test_entering_state_bytes():
    # prev_states (b, c, h, p, n) is written by state_passing and read by chunk_scan; only
    # those two terms change with the entering states' dtype, and None means state_bytes.
    dims, q = (2, 10, 4, 3, 5, 2), 4  # c = 3
    prev = 2 * 3 * 4 * 3 * 5
    fp32 = ssd_costs(dims, q)
    assert ssd_costs(dims, q, entering_state_bytes=4) == fp32
    bf16 = ssd_costs(dims, q, entering_state_bytes=2)
    assert fp32["state_passing"]["bytes_written"] - bf16["state_passing"]["bytes_written"] == 2 * prev
    assert fp32["chunk_scan"]["bytes_read"] - bf16["chunk_scan"]["bytes_read"] == 2 * prev
    for stage in ("chunk_cumsum", "chunk_state"):
        assert bf16[stage] == fp32[stage]
    assert bf16["state_passing"]["bytes_read"] == fp32["state_passing"]["bytes_read"]
    assert fp32["total"]["bytes"] - bf16["total"]["bytes"] == 4 * prev
