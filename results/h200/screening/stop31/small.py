"""Screen: small states at chunk 128 and 256, on small-state, against the default at 64 (argv[1]
= out). In a1ae9ed's models run ours' first call took 15.2 s at 128 and 13.2 s at 256, and 256
ran 0.290 ms against c754dc3's 0.201 ms (whole-chunk tiles that reloaded per row block): the
rule SMALL_STATE_SCAN was screened at 64 and 128 only. Points: 128 and 256 as shipped and at the
occupancy hint of 2; at 256 also c754dc3's whole-chunk tiles that reload (not shared) and
64-row tiles (neither)."""
import sys

from screen import run, shipped


def space(shape, sms):
    at = lambda q, **scan: (q, shipped(shape, sms, q, **scan))  # noqa: E731
    return [("default", *at(64)), ("q128 shipped", *at(128)), ("q128 sh h1 o2", *at(128, occupancy=2)),
            ("q256 shipped", *at(256)), ("q256 sh h1 o2", *at(256, occupancy=2)),
            ("q256 wc h1 o3", *at(256, shared=False)),
            ("q256 rows h1 o3", *at(256, shared=False, whole_chunk=False))]


run(["small-state"], space, sys.argv[1])
