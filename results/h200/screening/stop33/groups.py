"""Screen of the chunk-group walk (argv[1] = out, argv[2] = shapes): stage 2's chunks cut into
G groups walked at once from a zero state (``StateConfig.groups``), a second small kernel
carrying the state from group to group, chunk_scan completing each chunk's entering state with
its group's, decayed. At chunk 64, against the shipped default in the same process: G = 2, 4, 8
with whole 128-wide states (the one-wave walk's ONE_WAVE_STATE) and G = 2, 4 with each shape's
shipped state slices."""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run, shipped  # noqa: E402

from ssd.config import ONE_WAVE_STATE  # noqa: E402


def space(shape, sms):
    d = shipped(shape, sms, 64)
    pts = [("default", 64, d)]
    pts += [(f"g{g} whole", 64, replace(d, state=replace(d.state, **ONE_WAVE_STATE, groups=g)))
            for g in (2, 4, 8)]
    pts += [(f"g{g} shipped state", 64, replace(d, state=replace(d.state, groups=g))) for g in (2, 4)]
    return pts


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
