"""Screen: stage 2 stores the entering states' term of y (StateConfig.entering="term") instead
of the states, and chunk_scan adds it in place of its C . state MMA (argv[1] = out). At chunk 64
an entering state (p x n = 64 x 128) is twice a chunk's x (q x p): the term halves stage 2's
stores and chunk_scan's reads for it, and moves one MMA from chunk_scan to stage 2. The term
needs the whole state n in one block, so stage 2's parallelism comes from channel slices
(block_p) instead of state slices. Points: the shipped default at 64; the term with the shipped
state config (block_n widened to the state), at the one-wave walk's occupancy hint of 3 and
32-position K steps (80 registers: the whole state spills at the default's 4), with 32- and
16-channel slices; the term with 32-channel slices at chunk 128."""
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run, shipped  # noqa: E402


def term(shape, sms, q, **state):
    """What the API ships for ``shape`` at ``q`` with stage 2 storing the term (and ``state``'s
    other StateConfig fields changed)."""
    d = shipped(shape, sms, q)
    return replace(d, state=replace(d.state, entering="term", **state))


def space(shape, sms):
    return [("default", 64, shipped(shape, sms, 64)),
            ("term", 64, term(shape, sms, 64)),
            ("term o3 k32", 64, term(shape, sms, 64, occupancy=3, block_k=32)),
            ("term p32", 64, term(shape, sms, 64, block_p=32)),
            ("term p16", 64, term(shape, sms, 64, block_p=16)),
            ("q128 term p32", 128, term(shape, sms, 128, block_p=32))]


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
