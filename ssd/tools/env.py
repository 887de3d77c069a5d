"""The environment record stored with every GPU result (tests, benchmarks, notebooks).

A number is only reproducible with the machine and software that produced it, so every JSON
file under ``results/`` carries :func:`environment`: GPU, SM count, clocks, driver, CUDA and
tileiras, cuda-tile, torch, triton, mamba_ssm and tilegym versions, git revision and date.
A recording of thousands of rows (the GPU tests') is stored gzipped, ``<name>.json.gz``: the
repository travels to the GPU machine within a few MB (:func:`write_json`, :func:`read_json`).
"""
from __future__ import annotations

import datetime
import gzip
import json
import platform
import subprocess
from pathlib import Path

from . import doctor

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
BOOK_GPU = "h200"  # the GPU whose recordings the book ships (results/h200/)


def _git_revision() -> str | None:
    """Short git revision (+"-dirty"), or the file ``.revision`` when it exists.

    The file wins because the GPU machine gets a copy of the working tree whose ``.git`` (when
    it has one at all) is not the sender's, and a stale one there would name an old commit. The sender writes ``.revision`` right after committing
    (``git rev-parse --short=12 HEAD > .revision``); it is git-ignored.
    """
    stamp = ROOT / ".revision"
    sent = stamp.read_text().strip() if stamp.is_file() else ""
    if sent:
        return sent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, text=True,
                             capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) if rev else None


def _nvidia_smi(fields: str) -> list[str] | None:
    out = doctor._run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"])
    return [v.strip() for v in out.splitlines()[0].split(",")] if out else None


def environment() -> dict:
    """Everything that identifies where and with what a result was measured."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "cuda_tile": doctor._dist_version("cuda-tile"),
        "tileiras": doctor.locate_toolchain().tileiras.version,
        "mamba_ssm": _mamba_ssm_version(),
        "tilegym": doctor._dist_version("tilegym"),
    }
    try:
        import torch
        import triton

        env.update(torch=torch.__version__, torch_cuda=torch.version.cuda, triton=triton.__version__)
        if torch.cuda.is_available():
            prop = torch.cuda.get_device_properties(0)
            env.update(gpu=prop.name, sm_count=prop.multi_processor_count,
                       compute_capability=f"{prop.major}.{prop.minor}")
    except ImportError:
        pass
    smi = _nvidia_smi("driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.limit")
    if smi:
        keys = ("driver", "sm_clock_mhz", "sm_clock_max_mhz", "mem_clock_mhz", "mem_clock_max_mhz",
                "power_limit_w")
        env.update(dict(zip(keys, smi)))
    return env


def _mamba_ssm_version() -> str | None:
    from .peers import mamba_ssm_version

    return mamba_ssm_version()


def gpu_slug(env: dict) -> str:
    """The results/ subfolder for a GPU: 'NVIDIA H200' -> 'h200', 'NVIDIA A100-SXM4-80GB' ->
    'a100', 'NVIDIA GeForce RTX 5090' -> '5090'; 'cpu' without a GPU."""
    words = [w for w in (env.get("gpu") or "cpu").lower().replace("-", " ").split()
             if w not in ("nvidia", "geforce", "rtx", "tesla")]
    return words[0] if words else "gpu"


def write_json(path: Path | str, payload) -> Path:
    """Write ``payload`` as JSON, one record to a line (see :func:`dumps`); gzipped where the
    name ends in ``.gz`` (no timestamp in the header: the same payload, the same bytes)."""
    path = Path(path)  # --out arguments arrive as strings
    path.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(payload) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)
    return path


def read_json(path: Path | str):
    """The JSON at ``path``, gunzipped where the name ends in ``.gz``."""
    path = Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def recording_name(path: Path) -> str:
    """A recording's name: its file name without ``.json`` or ``.json.gz``."""
    return path.name.removesuffix(".gz").removesuffix(".json")


def pack_rows(rows: list[dict], digits: int = 4) -> list[dict]:
    """Rows of dicts as tables, one per set of keys: ``[{"columns": [...], "values": [[...],
    ...]}, ...]``, floats to ``digits`` significant digits, so that thousands of check rows
    take a few hundred KB instead of a few MB (each key is written once a table).
    :func:`unpack_rows` restores the dicts, grouped by their keys."""
    cell = lambda v: float(f"{v:.{digits}g}") if isinstance(v, float) else v  # noqa: E731
    tables: dict[tuple, list] = {}
    for row in rows:
        tables.setdefault(tuple(row), []).append([cell(v) for v in row.values()])
    return [{"columns": list(columns), "values": values} for columns, values in tables.items()]


def unpack_rows(tables: list[dict]) -> list[dict]:
    """The rows :func:`pack_rows` packed."""
    return [dict(zip(t["columns"], values, strict=True)) for t in tables for values in t["values"]]


def is_packed(value) -> bool:
    """Whether ``value`` is what :func:`pack_rows` returns."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, dict) and set(t) == {"columns", "values"} for t in value)


def dumps(obj, depth: int = 0) -> str:
    """JSON with nesting indented one space a level, except that a dict or list holding only
    scalars (or lists of scalars) takes one line: a recording's records, rows and settings read
    one to a line, and the files stay small (the GPU machine's carried tree is capped)."""
    flat = lambda v: not isinstance(v, (dict, list)) or (  # noqa: E731
        isinstance(v, list) and not any(isinstance(x, (dict, list)) for x in v))
    pad = " " * (depth + 1)
    if isinstance(obj, dict) and not all(flat(v) for v in obj.values()):
        items = (f"{pad}{json.dumps(k)}: {dumps(v, depth + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + "\n" + " " * depth + "}"
    if isinstance(obj, list) and not all(flat(v) for v in obj):
        return "[\n" + ",\n".join(pad + dumps(v, depth + 1) for v in obj) + "\n" + " " * depth + "]"
    return json.dumps(obj)


def main(argv=None) -> int:
    """``python -m ssd.tools.env``: this machine's environment record as JSON; ``--slug``: only
    the folder name its GPU's recordings go to (results/<slug>/)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ssd.tools.env", description=main.__doc__)
    parser.add_argument("--slug", action="store_true", help="print results/<slug>'s slug only")
    env = environment()
    print(gpu_slug(env) if parser.parse_args(argv).slug else dumps(env))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
