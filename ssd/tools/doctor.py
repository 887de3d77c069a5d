"""`python -m ssd doctor`: what this machine can run, and what to fix.

The doctor gathers facts (versions, paths, the GPU) without importing anything that needs a
GPU, then judges each fact with a small pure function, so every verdict can be tested with
made-up facts. Each check belongs to a part of the book:

- ``cpu``: the Derivation chapters (NumPy only);
- ``gpu``: the cuTile port, Performance and The complete job; the exit code is 0 iff none of
  these fails;
- ``peers``: what the Performance chapters compare against (a missing peer is a warning).

How cuTile finds its compiler, mirrored here (cuda-tile 1.7, ``cuda/tile/_compile.py``, and
what ``tileiras`` itself opens, seen with strace):

1. the pip wheels ``nvidia-cuda-tileiras``, ``nvidia-cuda-nvcc`` (ptxas) and ``nvidia-nvvm``
   (libnvvm) under ``site-packages/nvidia/cu13``, used only when all three are installed and
   of one major.minor (otherwise cuTile warns and falls back); CUDA_HOME is then hidden
   from tileiras;
2. ``tileiras`` on PATH, then ``$CUDA_HOME/bin``, then ``/usr/local/cuda*/bin``.

``tileiras`` runs the ``ptxas`` beside it, else the first on PATH; it loads libnvvm from
``<root>/nvvm/lib64/libnvvm.so`` or ``<root>/lib/libnvvm.so.4``, where root is CUDA_HOME
when tileiras sees it and tileiras's own install prefix otherwise. A missing ptxas or
libnvvm, or one of another release, surfaces in cuTile only as "Return code 5 / failed to
compile Tile IR program".
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"

# Compute capability major -> oldest tileiras (major, minor) that targets it. cuTile supports
# 8.x, 9.x, 10.x and 12.x; Blackwell came first (13.1), Ampere with 13.2, Hopper with 13.3.
MIN_TILEIRAS = {8: (13, 2), 9: (13, 3), 10: (13, 1), 12: (13, 1)}
TRIO = "13.4"  # the compiler release the book is tested with (tileiras, ptxas, libnvvm)
MIN_DRIVER = 580
MIN_CUDA_TILE = (1, 7)
PIP_TOOLCHAIN = ("nvidia-cuda-tileiras", "nvidia-cuda-nvcc", "nvidia-nvvm")
RC5 = "Return code 5 / failed to compile Tile IR program"

CPU_PART = "CPU chapters (Derivation)"
GPU_PART = "GPU chapters (cuTile port, Performance, The complete job)"


# ----------------------------------------------------------------------------- facts

@dataclass
class Tool:
    """One piece of the compiler toolchain: where it is and which release it belongs to."""
    path: str | None = None
    version: str | None = None  # "13.4.92" or "13.4"; None when unknown


@dataclass
class Toolchain:
    source: str | None = None  # how cuTile finds tileiras; None when it doesn't
    tileiras: Tool = field(default_factory=Tool)
    ptxas: Tool = field(default_factory=Tool)
    libnvvm: Tool = field(default_factory=Tool)
    cuda_home: str | None = None  # CUDA_HOME as tileiras sees it: its libnvvm root then
    searched_libnvvm: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class CompileResult:
    target: str                 # e.g. "sm_90"
    ok: bool
    seconds: float = 0.0
    error: str | None = None


@dataclass
class Facts:
    python: tuple[int, int, int]
    numpy: str | None = None
    matplotlib: str | None = None
    torch: str | None = None
    torch_cuda: str | None = None           # torch.version.cuda; None for a CPU build
    torch_error: str | None = None
    gpu_name: str | None = None
    gpu_cc: tuple[int, int] | None = None
    gpu_count: int = 0
    driver: str | None = None
    cuda_tile: str | None = None
    toolchain: Toolchain = field(default_factory=Toolchain)
    compile: CompileResult | None = None    # None: not tried, for the reason below
    compile_skipped: str = "needs cuda-tile and tileiras"
    mamba_ssm_ssd: str | None = None        # path of mamba_ssm/ops/triton/ssd_combined.py
    triton: str | None = None
    tilegym: str | None = None


@dataclass
class Check:
    name: str
    part: str                   # "cpu" | "gpu" | "peers"
    status: str                 # OK | WARN | FAIL
    detail: str
    remedy: str = ""


def major_minor(version: str | None) -> tuple[int, int] | None:
    """Leading major.minor of a version string: "13.4.92" -> (13, 4), "2.3.2.post1" -> (2, 3)."""
    if not version:
        return None
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", version)
    if not m:
        return None
    return int(m.group(1)), int(m.group(2) or 0)


def _mm_str(mm: tuple[int, int]) -> str:
    return f"{mm[0]}.{mm[1]}"


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout if res.returncode == 0 else None


def tool_version(path: str) -> str | None:
    """Release of an NVIDIA compiler from its --version: "... release 13.4, V13.4.92" -> "13.4.92"."""
    out = _run([path, "--version"])
    if out is None:
        return None
    if m := re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", out):
        return m.group(1)
    if m := re.search(r"release (\d+\.\d+)", out):
        return m.group(1)
    return None


def _cu13_root() -> Path | None:
    """site-packages/nvidia/cu13, where the CUDA 13 pip wheels install (not imported)."""
    try:
        spec = importlib.util.find_spec("nvidia.cu13")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _default_cuda_roots() -> list[Path]:
    """/usr/local/cuda, then /usr/local/cuda-X.Y newest first (cuTile's last resort)."""
    base = Path("/usr/local")
    roots = [base / "cuda"]
    try:
        versioned = [p for p in base.iterdir() if re.fullmatch(r"cuda-\d+(\.\d+)?", p.name)]
    except OSError:
        versioned = []
    versioned.sort(key=lambda p: major_minor(p.name[5:]) or (0, 0), reverse=True)
    return roots + versioned


def _libnvvm_version(lib: Path, cu13: Path | None) -> str | None:
    """Release of a libnvvm: its pip wheel, the toolkit's version.json or dist-info, or the
    toolkit folder's name (cuda-13.4)."""
    if cu13 is not None and cu13 in lib.resolve().parents:
        if v := _dist_version("nvidia-nvvm"):
            return v
    root = lib.parent.parent if lib.parent.name == "lib" else lib.parent.parent.parent
    vj = root / "version.json"
    if vj.is_file():
        try:
            data = json.loads(vj.read_text())
            for key, val in data.items():
                if "nvvm" in key and isinstance(val, dict) and val.get("version"):
                    return str(val["version"])
        except (OSError, ValueError):
            pass
    for info in sorted((root / "dist-info").glob("nvidia_nvvm-*.dist-info")):
        return info.name[len("nvidia_nvvm-"):-len(".dist-info")]
    if m := re.fullmatch(r"cuda-(\d+\.\d+)", root.resolve().name):
        return m.group(1)
    return None


def locate_toolchain(environ: dict[str, str] | None = None) -> Toolchain:
    """Find tileiras, ptxas and libnvvm the way cuTile and tileiras do (see module docstring)."""
    env = os.environ if environ is None else environ
    tc = Toolchain()
    path_var = env.get("PATH", "")
    cuda_home_seen: str | None = None  # CUDA_HOME as tileiras will see it
    cu13 = _cu13_root()

    versions = {pkg: _dist_version(pkg) for pkg in PIP_TOOLCHAIN}
    tileiras: str | None = None
    if all(versions.values()):
        listed = ", ".join(f"{p} {v}" for p, v in versions.items())
        pip_bin = cu13 / "bin" / "tileiras" if cu13 else None
        if len({major_minor(v) for v in versions.values()}) != 1:
            tc.notes.append(f"pip wheels of different releases ({listed}): cuTile ignores "
                            "them and falls back to PATH, CUDA_HOME, /usr/local/cuda")
        elif pip_bin is not None and pip_bin.is_file():
            tileiras, tc.source = str(pip_bin), "pip wheels"
    elif any(versions.values()):
        missing = ", ".join(p for p, v in versions.items() if not v)
        tc.notes.append(f"pip wheels incomplete (missing {missing}): cuTile ignores them")

    if tileiras is None:
        cuda_home = env.get("CUDA_HOME")
        if found := shutil.which("tileiras", path=path_var):
            tileiras, tc.source, cuda_home_seen = found, "PATH", cuda_home
        elif cuda_home and (found := shutil.which("tileiras", path=os.path.join(cuda_home, "bin"))):
            tileiras, tc.source, cuda_home_seen = found, "CUDA_HOME", cuda_home
            path_var = path_var + os.pathsep + os.path.join(cuda_home, "bin")
        else:
            for root in _default_cuda_roots():
                cand = root / "bin" / "tileiras"
                if cand.is_file() and os.access(cand, os.X_OK):
                    tileiras, tc.source, path_var = str(cand), str(root), str(root / "bin")
                    break
    if tileiras is None:
        return tc

    bin_dir = Path(tileiras).parent
    tc.tileiras = Tool(tileiras, tool_version(tileiras) or (
        versions["nvidia-cuda-tileiras"] if tc.source == "pip wheels" else None))

    ptxas = bin_dir / "ptxas"
    ptxas_path = str(ptxas) if ptxas.is_file() else shutil.which("ptxas", path=path_var)
    if ptxas_path:
        tc.ptxas = Tool(ptxas_path, tool_version(ptxas_path))

    tc.cuda_home = cuda_home_seen
    root = Path(cuda_home_seen) if cuda_home_seen else bin_dir.parent
    candidates = [root / "nvvm" / "lib64" / "libnvvm.so", root / "lib" / "libnvvm.so.4"]
    tc.searched_libnvvm = [str(c) for c in candidates]
    for cand in candidates:
        if cand.is_file():
            tc.libnvvm = Tool(str(cand), _libnvvm_version(cand, cu13))
            break
    return tc


def _probe_torch(facts: Facts) -> None:
    if importlib.util.find_spec("torch") is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
        facts.torch = str(torch.__version__)
        facts.torch_cuda = torch.version.cuda
        if torch.cuda.is_available():
            facts.gpu_count = torch.cuda.device_count()
            facts.gpu_name = torch.cuda.get_device_name(0)
            facts.gpu_cc = tuple(torch.cuda.get_device_capability(0))
    except Exception as exc:  # a broken install is a finding, not a crash
        facts.torch_error = f"{type(exc).__name__}: {exc}"


def _probe_nvidia_smi(facts: Facts) -> None:
    """GPU and driver from nvidia-smi (a GPU that a CPU build of torch cannot see)."""
    if not shutil.which("nvidia-smi"):
        return
    out = _run(["nvidia-smi", "--query-gpu=name,compute_cap,driver_version",
                "--format=csv,noheader"])
    if not out or not out.strip():
        return
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    parts = [p.strip() for p in lines[0].split(",")]
    if len(parts) >= 3:
        facts.gpu_count = facts.gpu_count or len(lines)
        facts.gpu_name = facts.gpu_name or parts[0]
        facts.gpu_cc = facts.gpu_cc or major_minor(parts[1])
        facts.driver = facts.driver or parts[2]


def _probe_driver(facts: Facts) -> None:
    if facts.driver:
        return
    try:
        import pynvml  # nvidia-ml-py, when installed
        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        facts.driver = v.decode() if isinstance(v, bytes) else str(v)
        return
    except Exception:
        pass
    try:  # NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05  ...
        text = Path("/proc/driver/nvidia/version").read_text()
        if m := re.search(r"Kernel Module\s+(\d+\.\d+(?:\.\d+)?)", text):
            facts.driver = m.group(1)
    except OSError:
        pass


def _find_mamba_ssm_ssd() -> str | None:
    """Path of mamba_ssm's Triton SSD, found without importing mamba_ssm: its package
    __init__ imports a CUDA extension and fails where that is missing."""
    try:
        spec = importlib.util.find_spec("mamba_ssm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        f = Path(loc) / "ops" / "triton" / "ssd_combined.py"
        if f.is_file():
            return str(f)
    return None


def compile_probe(target: str) -> CompileResult:
    """Compile a tiny cuTile kernel to a cubin for `target` (no GPU needed)."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cuda.tile as ct
            from cuda.tile.compilation import (ArrayConstraint, CallingConvention,
                                               KernelSignature, export_kernel)
            from ssd.tools import doctor_kernel

            arr = ArrayConstraint(dtype=ct.float32, ndim=1, index_dtype=ct.int32,
                                  stride_lower_bound_incl=0, alias_groups=(),
                                  may_alias_internally=False)
            sig = KernelSignature([arr, arr], CallingConvention.cutile_python_v1())
            export_kernel(doctor_kernel.scale_exp2, [sig], io.BytesIO(), gpu_code=target,
                          output_format="cubin")
    except Exception as exc:
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        return CompileResult(target, False, time.perf_counter() - t0, msg)
    return CompileResult(target, True, time.perf_counter() - t0)


def gather(compile: bool = True) -> Facts:
    """Collect every fact the checks judge; never raises."""
    facts = Facts(python=tuple(sys.version_info[:3]))
    facts.numpy = _dist_version("numpy")
    facts.matplotlib = _dist_version("matplotlib")
    _probe_torch(facts)
    _probe_nvidia_smi(facts)
    _probe_driver(facts)
    facts.cuda_tile = _dist_version("cuda-tile")
    facts.toolchain = locate_toolchain()
    if not compile:
        facts.compile_skipped = "skipped (--no-compile)"
    elif facts.cuda_tile and facts.toolchain.tileiras.path:
        cc = facts.gpu_cc
        target = f"sm_{cc[0]}{cc[1]}" if cc and cc[0] in MIN_TILEIRAS else "sm_120"
        facts.compile = compile_probe(target)
    facts.mamba_ssm_ssd = _find_mamba_ssm_ssd()
    facts.triton = _dist_version("triton")
    facts.tilegym = _dist_version("tilegym") or (
        "installed" if importlib.util.find_spec("tilegym") else None)
    return facts


# ----------------------------------------------------------------------------- checks

def check_python(version: tuple[int, ...]) -> Check:
    v = ".".join(map(str, version))
    if tuple(version[:2]) < (3, 10):
        return Check("python", "cpu", FAIL, v, "the package needs Python 3.10 or newer")
    return Check("python", "cpu", OK, v)


def check_package(name: str, version: str | None, part: str = "cpu") -> Check:
    if version is None:
        return Check(name, part, FAIL, "not installed", "pip install -e .")
    return Check(name, part, OK, version)


def check_torch(version: str | None, cuda: str | None, error: str | None = None) -> Check:
    if error:
        return Check("torch", "gpu", FAIL, f"import failed: {error}",
                     "reinstall torch: pip install -e '.[gpu]'")
    if version is None:
        return Check("torch", "gpu", FAIL, "not installed",
                     "the GPU chapters launch kernels on torch tensors: pip install -e '.[gpu]'")
    if cuda is None:
        return Check("torch", "gpu", FAIL, f"{version}, a CPU build",
                     "install a CUDA build of torch (on Linux x86_64, PyPI's default `pip install torch`)")
    return Check("torch", "gpu", OK, f"{version} (CUDA {cuda})")


def check_gpu(name: str | None, cc: tuple[int, int] | None,
              tileiras_version: str | None) -> Check:
    if cc is None:
        return Check("gpu", "gpu", FAIL, "no NVIDIA GPU visible",
                     "the GPU chapters need an NVIDIA GPU with compute capability 8.x, 9.x, "
                     "10.x or 12.x; the CPU chapters run anywhere")
    label = f"{name or 'NVIDIA GPU'}, compute capability {cc[0]}.{cc[1]} (sm_{cc[0]}{cc[1]})"
    need = MIN_TILEIRAS.get(cc[0])
    if need is None:
        return Check("gpu", "gpu", FAIL, f"{label}: not supported by cuTile",
                     "cuTile supports compute capability 8.x, 9.x, 10.x and 12.x")
    have = major_minor(tileiras_version)
    if have is None:
        return Check("gpu", "gpu", WARN, f"{label}: needs tileiras {_mm_str(need)} or newer, "
                     "and no tileiras version is known", "see the toolchain line")
    if have < need:
        return Check("gpu", "gpu", FAIL,
                     f"{label}: needs tileiras {_mm_str(need)} or newer, found {tileiras_version}",
                     f"pip install -U 'cuda-tile[tileiras]'. Where torch pins older CUDA "
                     f"toolkit wheels (torch 2.15 pins 13.2), put one newer compiler trio beside "
                     f"them: pip install --no-deps 'nvidia-cuda-tileiras=={TRIO}.*' "
                     f"'nvidia-cuda-nvcc=={TRIO}.*' 'nvidia-nvvm=={TRIO}.*'")
    return Check("gpu", "gpu", OK, label)


def check_driver(version: str | None) -> Check:
    if version is None:
        return Check("driver", "gpu", FAIL, "no NVIDIA driver found",
                     f"install NVIDIA driver r{MIN_DRIVER} or newer")
    mm = major_minor(version)
    if mm is None or mm[0] < MIN_DRIVER:
        return Check("driver", "gpu", FAIL, f"{version}: older than r{MIN_DRIVER}",
                     f"Tile IR kernels need NVIDIA driver r{MIN_DRIVER} or newer")
    return Check("driver", "gpu", OK, version)


def check_cuda_tile(version: str | None) -> Check:
    if version is None:
        return Check("cuda-tile", "gpu", FAIL, "not installed",
                     "pip install 'cuda-tile[tileiras]>=1.7'")
    mm = major_minor(version)
    if mm is None or mm < MIN_CUDA_TILE:
        return Check("cuda-tile", "gpu", FAIL, f"{version}: the book needs 1.7 or newer",
                     "pip install -U 'cuda-tile[tileiras]>=1.7'")
    return Check("cuda-tile", "gpu", OK, version)


def check_toolchain(tc: Toolchain) -> Check:
    fix = ("pip install -U 'cuda-tile[tileiras]' (tileiras, ptxas and libnvvm of one release: "
           "nvidia-cuda-tileiras, nvidia-cuda-nvcc, nvidia-nvvm)")
    if tc.tileiras.path is None:
        return Check("toolchain", "gpu", FAIL, "\n".join(
            ["tileiras not found (pip wheels, PATH, CUDA_HOME, /usr/local/cuda*)", *tc.notes]), fix)
    t = major_minor(tc.tileiras.version)
    tools = {"tileiras": tc.tileiras, "ptxas": tc.ptxas, "libnvvm": tc.libnvvm}
    paths = [f"{n:<8} {tool.version or '?':<8} {tool.path or 'not found'}"
             for n, tool in tools.items()]
    if tc.libnvvm.path is None:
        root = f"CUDA_HOME={tc.cuda_home}" if tc.cuda_home else "tileiras's install prefix"
        paths.append(f"(libnvvm looked for under {root}: " + ", ".join(tc.searched_libnvvm) + ")")
    body = [f"(tileiras found via {tc.source})", *paths, *tc.notes]

    def result(status: str, headline: str, remedy: str = "") -> Check:
        return Check("toolchain", "gpu", status, "\n".join([headline, *body]), remedy)

    missing = [n for n in ("ptxas", "libnvvm") if tools[n].path is None]
    if missing:
        return result(FAIL, f"{' and '.join(missing)} not found: cuTile reports this only as "
                       f"\"{RC5}\"", fix + ("; or point CUDA_HOME at a toolkit of the same "
                                             "release, or unset it" if tc.cuda_home else ""))
    wrong = [f"{n} {tools[n].version}" for n in ("ptxas", "libnvvm")
             if t and major_minor(tools[n].version) not in (None, t)]
    if wrong:
        return result(FAIL, f"tileiras {tc.tileiras.version} with {' and '.join(wrong)} of "
                       f"another release: cuTile reports this only as \"{RC5}\"",
                       f"use ptxas and libnvvm of release {_mm_str(t)}: {fix}; or a CUDA "
                       f"Toolkit {_mm_str(t)} first on PATH / in CUDA_HOME")
    if t is None or t < (13, 1):
        return result(FAIL, f"tileiras {tc.tileiras.version or 'of unknown release'}: cuTile "
                       "needs 13.1 or newer", fix)
    unknown = [n for n, tool in tools.items() if major_minor(tool.version) is None]
    if unknown:
        return result(WARN, f"release of {' and '.join(unknown)} unknown; tileiras is "
                       f"{tc.tileiras.version}", f"make sure all three are of release "
                       f"{_mm_str(t)}, or: {fix}")
    return result(OK, f"tileiras, ptxas and libnvvm of release {_mm_str(t)}")


def check_compile(result: CompileResult | None, skipped: str = "needs cuda-tile and tileiras") -> Check:
    if result is None:
        return Check("compile", "gpu", WARN, f"no test kernel compiled: {skipped}",
                     "fix the cuda-tile and toolchain lines first" if "needs" in skipped else "")
    if result.ok:
        return Check("compile", "gpu", OK,
                     f"compiled a test kernel for {result.target} in {result.seconds:.1f} s")
    detail = f"test kernel for {result.target} failed: {result.error}"
    if "Return code 5" in (result.error or ""):
        detail += (" (tileiras exit code 5: ptxas or libnvvm missing or of another release "
                   "than tileiras; see the toolchain line)")
    return Check("compile", "gpu", FAIL, detail,
                 "fix the toolchain line; then `python -m ssd doctor` again")


def check_mamba_ssm(ssd_path: str | None, triton: str | None) -> Check:
    if ssd_path is None:
        return Check("mamba_ssm", "peers", WARN, "Triton SSD (mamba_ssm/ops/triton/ssd_combined.py) "
                     "not found", "the Performance chapters compare against it: pip install mamba-ssm")
    if triton is None:
        return Check("mamba_ssm", "peers", WARN, f"{ssd_path} found, but triton is not installed",
                     "pip install triton")
    return Check("mamba_ssm", "peers", OK, f"Triton SSD at {ssd_path} (triton {triton}; "
                 "found, not imported: the package's __init__ needs its CUDA extension)")


def check_tilegym(version: str | None) -> Check:
    if version is None:
        return Check("tilegym", "peers", WARN, "not installed",
                     "the Performance chapters compare against TileGym's cuTile Mamba-2: "
                     "install TileGym (github.com/NVIDIA/TileGym)")
    return Check("tilegym", "peers", OK, version)


def run_checks(facts: Facts) -> list[Check]:
    tc = facts.toolchain
    return [
        check_python(facts.python),
        check_package("numpy", facts.numpy),
        check_package("matplotlib", facts.matplotlib),
        check_torch(facts.torch, facts.torch_cuda, facts.torch_error),
        check_gpu(facts.gpu_name, facts.gpu_cc, tc.tileiras.version),
        check_driver(facts.driver),
        check_cuda_tile(facts.cuda_tile),
        check_toolchain(tc),
        check_compile(facts.compile, facts.compile_skipped),
        check_mamba_ssm(facts.mamba_ssm_ssd, facts.triton),
        check_tilegym(facts.tilegym),
    ]


# ----------------------------------------------------------------------------- report

def verdict(checks: list[Check]) -> dict:
    """Which parts can run; exit code 0 iff the GPU chapters can."""
    cpu = not any(c.status == FAIL for c in checks if c.part == "cpu")
    gpu = cpu and not any(c.status == FAIL for c in checks if c.part == "gpu")
    peers_missing = [c.name for c in checks if c.part == "peers" and c.status != OK]
    if gpu:
        line = f"{CPU_PART} and {GPU_PART} can run"
        if peers_missing:
            line += (f"; the peer comparisons in Performance need {', '.join(peers_missing)}")
    elif cpu:
        line = f"{CPU_PART} can run; {GPU_PART} cannot: fix the FAIL lines above"
    else:
        line = "nothing can run yet: fix the FAIL lines above"
    return {"cpu_chapters": cpu, "gpu_chapters": gpu, "summary": line,
            "exit_code": 0 if gpu else 1}


def format_table(checks: list[Check], summary: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["ssd doctor: what this machine can run", ""]
    indent = " " * (4 + 2 + width + 2)
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  " + c.detail.replace("\n", "\n" + indent))
        if c.status != OK and c.remedy:
            lines.append(f"{indent}-> {c.remedy}")
    lines += ["", summary]
    return "\n".join(lines)


def main(as_json: bool = False, compile: bool = True, out=None) -> int:
    out = sys.stdout if out is None else out
    facts = gather(compile=compile)
    checks = run_checks(facts)
    v = verdict(checks)
    if as_json:
        json.dump({"checks": [dataclasses.asdict(c) for c in checks],
                   "facts": dataclasses.asdict(facts), **v}, out, indent=2, default=str)
        out.write("\n")
    else:
        out.write(format_table(checks, v["summary"]) + "\n")
    return v["exit_code"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `doctor` subcommand to `python -m ssd`."""
    p = subparsers.add_parser(
        "doctor", help="check what this machine can run (exit code 0 iff the GPU chapters can)",
        description="Check Python, NumPy, torch, the GPU and driver, cuda-tile and its "
                    "compiler toolchain, and the peers; exit code 0 iff the GPU chapters can run.")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--no-compile", action="store_true",
                   help="skip compiling a test kernel with cuTile")
    p.set_defaults(func=lambda args: main(as_json=args.json, compile=not args.no_compile))
