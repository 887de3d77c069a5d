"""Execute the book's notebooks in place: ``python -m ssd.book.run [PATTERN ...]``.

On a GPU machine this is how the GPU chapters get their stored outputs (and their
``results/<gpu>/*.json`` recordings, written by ``ssd.book.recordings.live_or_recorded``); on a CPU
machine the same chapters replay those recordings. Uses nbclient directly, so it needs only
nbclient, nbformat and ipykernel (no Jupyter server, no Sphinx).
"""
from __future__ import annotations

import argparse
import sys
import time

from ..tools.env import ROOT


def execute(path, timeout=900) -> float:
    """Run every cell of one notebook (cwd = its folder) and write the outputs back."""
    import nbclient
    import nbformat

    start = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.book.run", description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", default=["*.ipynb"],
                        help="glob patterns under notebooks/ (default: all)")
    args = parser.parse_args(argv)
    paths = sorted({p for pat in args.patterns for p in (ROOT / "notebooks").glob(pat)})
    if not paths:
        print(f"no notebooks match {args.patterns}", file=sys.stderr)
        return 2
    failed = []
    for i, path in enumerate(paths, 1):
        print(f"[{i}/{len(paths)}] {path.name} ...", end=" ", flush=True)
        try:
            print(f"{execute(path):.1f} s", flush=True)
        except Exception as exc:  # report every notebook, then fail
            failed.append(path.name)
            print(f"FAILED: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
