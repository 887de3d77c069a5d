"""Screen 4 of the entering term (argv[1] = out, argv[2] = shapes): chunk_scan adds the term after
its MMAs, its accumulator starting from zero (the first MMA waits on no load). Points: the
default, the term with the default's state widened, at the hint of 3 with 32-position K steps."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stop31"))  # screen.py
from screen import run  # noqa: E402
from term import space as term_space  # noqa: E402


def space(shape, sms):
    return [p for p in term_space(shape, sms) if p[0] in ("default", "term", "term o3 k32")]


if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
