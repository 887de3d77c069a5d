"""chunk_scan's backward in cuTile, on the CPU: input validation, the tile configuration and the
default split of a group's heads.

The kernels need a GPU (tests/test_gpu_chunk_scan_backward.py checks them there; CI compiles them,
tests/test_aot.py; tests/test_kernels_emulated.py runs their tile code on the CPU).
"""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.tile")

from ssd.backward import chunk_scan_backward_cutile  # noqa: E402
from ssd.config import BACKWARD_BLOCKS_PER_SM, ScanBackwardConfig, head_splits  # noqa: E402


# ---- input validation -----------------------------------------------------------------------


def cpu_args(b=2, l=40, h=4, p=8, n=16, g=2, q=16, dtype=torch.float32, **extra):
    c = math.ceil(l / q)
    args = dict(dy=torch.zeros(b, l, h, p, dtype=dtype), B=torch.zeros(b, l, g, n, dtype=dtype),
                C=torch.zeros(b, l, g, n, dtype=dtype), x=torch.zeros(b, l, h, p, dtype=dtype),
                dt_out=torch.zeros(b, h, c, q), dA_cumsum=torch.zeros(b, h, c, q),
                prev_states=torch.zeros(b, c, h, p, n, dtype=dtype), D=None, z=None, seq_idx=None)
    args.update(extra)
    return args


@pytest.mark.parametrize("change, match", [
    (dict(dy=torch.zeros(2, 40, 4, 9)), r"^dy: expected x's shape"),
    (dict(dy=None), r"^dy: expected a torch.Tensor"),
    (dict(x=np.zeros((2, 40, 4, 8))), r"^x: expected a torch.Tensor"),
    (dict(B=torch.zeros(2, 40, 3, 16), C=torch.zeros(2, 40, 3, 16)), r"^B: .*not divisible"),
    (dict(C=torch.zeros(2, 40, 2, 8)), r"^C: "),                   # n differs from B's
    (dict(dt_out=torch.zeros(2, 4, 2, 16)), r"^dt_out: "),         # c = 2, ceil(40 / 16) = 3
    (dict(dA_cumsum=torch.zeros(2, 4, 2, 24)), r"^dA_cumsum: .*power of two"),
    (dict(dA_cumsum=torch.zeros(2, 4, 3, 16, dtype=torch.float16)), r"^dA_cumsum: dtype"),
    (dict(prev_states=torch.zeros(2, 3, 4, 8, 12)), r"^prev_states: "),
    (dict(D=torch.zeros(5)), r"^D: "),
    (dict(D=torch.zeros(4, 8, 1)), r"^D: "),
    (dict(z=torch.zeros(2, 40, 4, 7)), r"^z: "),
    (dict(seq_idx=torch.zeros(2, 41, dtype=torch.int32)), r"^seq_idx: "),
    (dict(seq_idx=torch.zeros(2, 40)), r"^seq_idx: dtype"),
    (dict(x=torch.zeros(2, 40, 4, 8, dtype=torch.float64)), r"^x: dtype .*float64 is the PyTorch"),
    (dict(x=torch.zeros(2, 40, 4, 512), dy=torch.zeros(2, 40, 4, 512),
          prev_states=torch.zeros(2, 3, 4, 512, 16)), r"^x: headdim p=512"),
    ({}, r"^x: must be a CUDA tensor"),                            # valid, but on the CPU
])
def test_bad_input_is_refused_by_name(change, match):
    with pytest.raises(ValueError, match=match):
        chunk_scan_backward_cutile(**cpu_args(**change))


@pytest.mark.parametrize("kwargs", [dict(block_q=48), dict(block_k=0), dict(block_n=3),
                                    dict(occupancy=0), dict(warps=6), dict(rows_block_q=24),
                                    dict(head_splits=0)])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        ScanBackwardConfig(**kwargs)


@pytest.mark.parametrize("q, n, dtype, tiles", [(16, 24, "bfloat16", (16, 16, 32)),
                                                (256, 128, "bfloat16", (64, 64, 64)),
                                                (256, 128, torch.float32, (32, 32, 32)),
                                                (16, 8, "float32", (16, 16, 8))])
def test_config_is_fitted_to_the_problem(q, n, dtype, tiles):
    config = ScanBackwardConfig().for_problem(q, n, dtype)
    assert (config.block_q, config.block_k, config.block_n) == tiles


@pytest.mark.parametrize("blocks, heads, sms, splits", [
    (256, 80, 132, 4),    # 2.7b at chunk 64: 2 x 256 blocks fall short of 4 a SM, 4 x 256 do not
    (256, 24, 132, 3),    # 130m: 3 divides 24, and 768 blocks reach 528
    (2048, 16, 132, 1),   # codestral-7b: eight groups give blocks enough
    (4, 6, 132, 6),       # too few blocks for any split: one head a block
    (256, 7, 132, 7),     # a prime number of heads: its only splits are 1 and 7
])
def test_head_splits_rule(blocks, heads, sms, splits):
    assert head_splits(blocks, heads, sms) == splits
    assert heads % splits == 0
    smaller = [s for s in range(1, splits) if heads % s == 0]
    assert all(blocks * s < BACKWARD_BLOCKS_PER_SM * sms for s in smaller)
