"""Screen, on branch next/carry (carry.diff: ScanConfig.carry): chunk_scan tiles that carry each
head's state across ``carry`` chunks on chip, so that stage 2 stores every carry-th entering state
only, against each shape's shipped default at chunk 64 (argv[1] = out, argv[2] = comma-separated
shape names, argv[3] = the run: "first" for carry.json, "xw" for carry-xw.json, the branch's
second state update). Small states also with the hint of 2 and at chunk 128."""
import sys
from dataclasses import replace

from screen import run
from ssd.config import default_config


def space(shape, sms):
    b, l, h, p, n, g = shape.dims
    shipped = lambda q: default_config((9, 0), problem=(b, h, p, n), sms=sms, chunk_size=q)  # noqa: E731
    sc = lambda q, **kw: replace(shipped(q), scan=replace(shipped(q).scan, **kw))  # noqa: E731
    points = [("default", 64, shipped(64))] + [(f"carry {k}", 64, sc(64, carry=k)) for k in (2, 4, 8)]
    if n <= 64 and RUN == "first":  # small states: their tile at 64 takes the hint of 3; chunk 128
        points += [("carry 4 o2", 64, sc(64, carry=4, occupancy=2)), ("q128", 128, shipped(128)),
                   ("q128 carry 2", 128, sc(128, carry=2)),
                   ("q128 carry 2 o2", 128, sc(128, carry=2, occupancy=2))]
    elif n <= 64:
        points += [("carry 4 o2", 64, sc(64, carry=4, occupancy=2)),
                   ("carry 8 o2", 64, sc(64, carry=8, occupancy=2)), ("q128 o2", 128, sc(128, occupancy=2)),
                   ("q128 carry 2 o2", 128, sc(128, carry=2, occupancy=2))]
    return points


RUN = sys.argv[3]
run(sys.argv[2].split(","), space, sys.argv[1])
