"""Screen: stage 1's heads per block (CumsumConfig.block_h, 8 since it was written, never in the
layout study) at 16, 32 and 64 on the five models shapes at chunk 64, each against the default
(argv[1] = out). Stage 1 takes 7-16 us of the forward; its [64, 8] loads of bf16 dt (b, l, h)
read 16 B of each 32 B sector."""
import sys
from dataclasses import replace

from screen import run, shipped
from ssd import bench
from ssd.config import CumsumConfig


def space(shape, sms):
    d = shipped(shape, sms, 64)
    return [("default", 64, d)] + [(f"cumsum block_h={v}", 64, replace(d, cumsum=CumsumConfig(block_h=v)))
                                   for v in (16, 32, 64)]


run([s.name for s in bench.SUITES["models"]], space, sys.argv[1])
