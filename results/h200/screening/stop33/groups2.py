"""Screen 2 of the chunk-group walk (argv[1] = out, argv[2] = shapes): as groups.py's whole-state
points at G = 4 and 8, at a later revision where chunk_scan skips the first group's chunks when
there are no initial states (that group enters from zero), with the group's part of the entering
state added to the stored state (as in groups.py) or by an MMA of its own (ScanConfig.group_mma).
Each point against the shipped default at chunk 64 in the same process."""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run, shipped  # noqa: E402

from ssd.config import ONE_WAVE_STATE  # noqa: E402


def space(shape, sms):
    d = shipped(shape, sms, 64)
    pts = [("default", 64, d)]
    for g in (4, 8):
        for mma in (False, True):
            pts.append((f"g{g} whole{' mma' if mma else ''}", 64,
                        replace(d, state=replace(d.state, **ONE_WAVE_STATE, groups=g),
                                scan=replace(d.scan, group_mma=mma))))
    return pts


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
