"""Screen 2 of the entering term (argv[1] = out, argv[2] = shapes): the walk's state untransposed,
[p, n], so that the term's MMA, (state . C_kᵀ)ᵀ, takes the state as its register operand instead
of a shared-memory one, at the occupancy hint of 3 with 32-position K steps (64 channels a block:
128 registers; 32 channels: 80, no spill on sm_90); and the transposed term again."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run, shipped  # noqa: E402
from term import term  # noqa: E402


def space(shape, sms):
    return [("default", 64, shipped(shape, sms, 64)),
            ("term", 64, term(shape, sms, 64)),
            ("term nt o3 k32", 64, term(shape, sms, 64, transposed=False, occupancy=3, block_k=32)),
            ("term nt o3 k32 p32", 64, term(shape, sms, 64, transposed=False, occupancy=3,
                                             block_k=32, block_p=32))]


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
