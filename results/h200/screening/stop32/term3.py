"""Screen 3 of the entering term (argv[1] = out, argv[2] = shapes): its MMAs over 64 rows of the
chunk each (ROWS = min(q, 64)) instead of the walk's K step (32 positions where the walk takes
32-position K steps: the one-wave walk of 2.7b and the hint-3 points), as stop 26's term in y
had them. Points as term.py's at chunk 64."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run  # noqa: E402
from term import space as term_space  # noqa: E402


def space(shape, sms):
    return [p for p in term_space(shape, sms) if p[1] == 64]


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
