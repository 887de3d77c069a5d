"""Screen, on branch next/carry (carry.diff: ScanConfig.carry): chunk_scan tiles that carry each
head's state across ``carry`` chunks on chip, so that stage 2 stores every carry-th entering state
only, against each shape's shipped default at chunk 64 (argv[1] = out, argv[2] = comma-separated
shape names, argv[3] = the run: "first" for carry.json, "xw" for carry-xw.json, the branch's
second state update). Small states also with the hint of 2 and at chunk 128."""
import sys

from screen import run, shipped


def space(shape, sms):
    at = lambda q, **scan: (q, shipped(shape, sms, q, **scan))  # noqa: E731
    points = [("default", *at(64))] + [(f"carry {k}", *at(64, carry=k)) for k in (2, 4, 8)]
    if shape.dims[4] <= 64 and RUN == "first":  # small states: their tile at 64 takes the hint of 3
        points += [("carry 4 o2", *at(64, carry=4, occupancy=2)), ("q128", *at(128)),
                   ("q128 carry 2", *at(128, carry=2)), ("q128 carry 2 o2", *at(128, carry=2, occupancy=2))]
    elif shape.dims[4] <= 64:
        points += [("carry 4 o2", *at(64, carry=4, occupancy=2)), ("carry 8 o2", *at(64, carry=8, occupancy=2)),
                   ("q128 o2", *at(128, occupancy=2)), ("q128 carry 2 o2", *at(128, carry=2, occupancy=2))]
    return points


RUN = sys.argv[3]
run(sys.argv[2].split(","), space, sys.argv[1])
