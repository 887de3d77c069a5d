"""Screen 5 of the entering term (argv[1] = out, argv[2] = shapes): term3.py's points at chunk 64
with y_enter loaded by chunk_scan without TMA (``allow_tma=False``), which cuts the term's
chunk_scan compile from 5.5-6.7 s to about 1.1 s on a CPU. Compare with ../stop32/term3.json
(the TMA load), each point as a multiple of the shipped default in its own process."""
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "stop31"), str(HERE.parent / "stop32")]  # screen.py, term3.py
from screen import run  # noqa: E402
from term3 import space  # noqa: E402

if __name__ == "__main__":
    run(sys.argv[2].split(","), space, sys.argv[1])
