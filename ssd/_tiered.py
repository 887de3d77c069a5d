"""Quick first calls: a kernel whose compile is long runs a quick-compiling build of itself until
its tuned build, compiled in another process, is in cuTile's kernel cache.

Why: tileiras spends up to 13 s on ``chunk_scan``'s tuned build for some configurations (the
grouped walk with full chunks at 64: its search for a pipeline across tiles; the pipeline pays,
chapter 10), which is longer than a first call may take. Every cut of that search that stops
36-37 measured cost the forward 1.1-2.3x its time. So both builds exist: the tuned one for steady
state, and one with the occupancy hint at 1 (one block a SM; tileiras compiles it in 1-3 s) for
the calls before the tuned one is ready. cuTile compiles under one process-wide lock, so a thread
could not compile beside the launches; a child process can. It rebuilds the kernel
(:class:`Rebuild`), exports the cubin for the launch's signature (the one cuTile's launcher
derives, :func:`ssd._launch.signature`, carried as its mangled name) into cuTile's disk cache,
and exits; the first launch of the tuned kernel after that is a cache hit (cuTile's front end,
about 0.1 s). Both builds run the same tile code on the same tiles, so they compute the same
values; only the scheduling hint differs (the GPU tests compare them).

Without cuTile's disk cache (``CUDA_TILE_CACHE_DIR=off``) the child could hand nothing over, so
the tuned build compiles in the first call as before; ``SSD_QUICK_FIRST_CALL=0`` asks for that
too. A CUDA-graph capture waits for the tuned build, so a graph never holds the quick one.
"""
from __future__ import annotations

import importlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

log = logging.getLogger("ssd")


@dataclass(frozen=True)
class Rebuild:
    """How another process builds the same kernel: ``module.function(*args)`` (arguments that
    JSON can carry, cuTile dtypes among them)."""
    module: str
    function: str
    args: tuple = ()

    def encode(self) -> str:
        import cuda.tile as ct

        args = [{"dtype": a.name} if isinstance(a, ct.DType) else a for a in self.args]
        return json.dumps(dict(module=self.module, function=self.function, args=args))

    @staticmethod
    def decode(text: str):
        """The kernel that ``Rebuild.encode`` describes."""
        import cuda.tile as ct

        spec = json.loads(text)
        args = [getattr(ct, a["dtype"]) if isinstance(a, dict) else a for a in spec["args"]]
        return getattr(importlib.import_module(spec["module"]), spec["function"])(*args)


@dataclass(frozen=True)
class QuickFirst:
    """A launch's quick build and how a child process builds its tuned one."""
    quick: object  # cuda.tile kernel: the same tile code, compiled fast
    tuned: Rebuild


@dataclass
class _Build:
    name: str
    proc: subprocess.Popen
    stderr: object  # a temporary file: a pipe left unread could fill and stall the child
    started: float


_pending: dict = {}   # launch key -> the _Build of its tuned kernel
settled: set = set()  # launch keys whose tuned kernel launches as itself from now on


def launch_key(kernel, args) -> tuple:
    """What cuTile's launcher compiles ``kernel`` for with ``args``, nearly: the constants and
    scalars, and each array's dtype, shape and strides. (Not its base address: a view that is not
    16-byte aligned gets another signature, and its tuned build compiles at its first launch.) A
    shape never seen before gets its own background build even where the process has launched
    the kernel for other shapes."""
    return (kernel, *((a.dtype, a.shape, a.stride()) if hasattr(a, "stride") else a for a in args))


def cache_dir() -> str | None:
    """cuTile's kernel cache folder in this process (None: the cache is off). cuTile reads it
    from the environment once, at import; its inspector package has the same reader."""
    from cutile_cache._env import get_cache_dir_from_env

    return get_cache_dir_from_env()


def enabled() -> bool:
    return os.environ.get("SSD_QUICK_FIRST_CALL", "1") != "0" and cache_dir() is not None


def pick(key, quick: QuickFirst, record, arch: str, capturing: bool):
    """The kernel to launch for ``record`` (a :class:`ssd._launch.Launch` of a tuned kernel, whose
    :func:`launch_key` is ``key``, not yet settled): the quick build while the tuned build compiles
    in a child process (started here at the key's first launch), the tuned kernel once that is
    done. ``capturing``: a CUDA graph is being captured, which waits for the tuned build."""
    build = _pending.get(key)
    if build is None:
        if not enabled():
            settled.add(key)
            return record.kernel
        build = _pending[key] = start(record, quick.tuned, arch, cache_dir())
        log.info("%s: compiling its tuned build in the background (pid %d); a quick build "
                 "(occupancy 1) runs until it is in the kernel cache", build.name, build.proc.pid)
    if build.proc.poll() is None and not capturing:
        return quick.quick
    _finish(key)
    return record.kernel


def start(record, tuned: Rebuild, arch: str, cache: str) -> _Build:
    """Start a child process that compiles ``tuned`` for ``record``'s signature on ``arch``
    into the cuTile kernel cache at ``cache``."""
    from . import _launch

    name = record.kernel._pyfunc.__name__
    symbol = _launch.signature(record).with_mangled_symbol(name).symbol
    # The child imports what this process imports, from where it imports it.
    env = {**os.environ, "CUDA_TILE_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "ssd._tiered", arch, symbol, tuned.encode()],
                            env=env, stdout=subprocess.DEVNULL, stderr=err)
    return _Build(name.removesuffix("_kernel"), proc, err, time.perf_counter())


def _finish(key, timeout: float | None = None) -> None:
    build = _pending.pop(key)
    try:
        code = build.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        _pending[key] = build
        raise
    seconds = time.perf_counter() - build.started
    if code:
        build.stderr.seek(0)
        tail = build.stderr.read().decode(errors="replace")[-800:]
        log.warning("%s: the background build failed (exit %d); the tuned build compiles at its "
                    "next launch instead:\n%s", build.name, code, tail)
    else:
        log.info("%s: tuned build ready after %.1f s", build.name, seconds)
    build.stderr.close()
    settled.add(key)


def wait_tuned(timeout: float | None = None) -> int:
    """Wait until every tuned build compiling in the background is in the kernel cache, so that
    every later launch runs tuned kernels (benchmarks call this before timing). Returns how many
    builds it waited for; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds a build."""
    keys = list(_pending)
    for key in keys:
        _finish(key, timeout)
    return len(keys)


def main(argv=None) -> int:
    """The child: ``python -m ssd._tiered ARCH SYMBOL REBUILD``."""
    from cuda.tile import compilation

    arch, symbol, rebuild = argv if argv is not None else sys.argv[1:]
    kernel = Rebuild.decode(rebuild)
    name, signature = compilation.demangle_kernel_name(symbol)
    if name != kernel._pyfunc.__name__:
        raise SystemExit(f"ssd._tiered: {rebuild} builds {kernel._pyfunc.__name__}, not {name}")
    compilation.export_kernel(kernel, [signature], io.BytesIO(), gpu_code=arch,
                              output_format="cubin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
