"""Compile every cuTile kernel ahead of time, without a GPU: ``python -m ssd.aot``.

The stage launchers run on CPU tensors inside :func:`ssd._launch.capture`, which records each
launch instead of queuing it; every record is then exported as a cubin with
:func:`cuda.tile.compilation.export_kernel` for each target architecture. This exercises
exactly the kernels, argument types and compile-time constants the GPU path would use, so a
kernel that stops compiling fails CI (``tests/test_aot.py``) long before anyone runs it.
"""
from __future__ import annotations

import argparse
import io
import time
from dataclasses import dataclass

from . import _launch

ARCHS = ("sm_80", "sm_90", "sm_100")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class Compiled:
    kernel: str
    arch: str
    variant: str
    cubin_bytes: int
    seconds: float


def capture_forward(dtype: str, features: bool, fused: bool, chunk_size: int = 256):
    """Run the forward's launchers on small CPU tensors and return the recorded launches."""
    import torch

    from .api import forward_stages
    from .config import SSDConfig, StateConfig, default_config

    t = getattr(torch, dtype)
    # Two heads per group at least, so chunk_scan's head block (block_h) is compiled as shipped.
    b, l, h, p, n, g = 2, chunk_size + chunk_size // 2, 8, 64, 128, 2
    x = torch.randn(b, l, h, p, dtype=t)
    B, C = torch.randn(b, l, g, n, dtype=t), torch.randn(b, l, g, n, dtype=t)
    dt, A = torch.rand(b, l, h, dtype=t), -torch.rand(h)
    extra = {}
    if features:
        extra = dict(D=torch.randn(h, p), z=torch.randn(b, l, h, p, dtype=t),
                     dt_bias=torch.randn(h), initial_states=torch.randn(b, h, p, n),
                     seq_idx=torch.zeros(b, l, dtype=torch.int32), dt_softplus=True,
                     dt_limit=(0.001, 0.1))
    base = default_config((9, 0))
    config = SSDConfig(cumsum=base.cumsum, state=StateConfig(**{**base.state.__dict__, "fused": fused}),
                       scan=base.scan)
    with _launch.capture() as records:
        forward_stages(x, dt, A, B, C, chunk_size, config=config, **extra)
    return records


def compile_all(archs=ARCHS, dtypes=DTYPES, progress=print) -> list[Compiled]:
    """Export every distinct (kernel, signature) of the forward for each arch."""
    from cuda.tile import compilation

    done, seen = [], set()
    for dtype in dtypes:
        for features in (False, True):
            for fused in (True, False):
                for record in capture_forward(dtype, features, fused):
                    sig = _launch.signature(record)
                    key = (record.kernel, repr(sig))
                    if key in seen:
                        continue
                    seen.add(key)
                    for arch in archs:
                        start = time.perf_counter()
                        buf = io.BytesIO()
                        compilation.export_kernel(record.kernel, [sig], buf, gpu_code=arch,
                                                  output_format="cubin")
                        item = Compiled(record.kernel._pyfunc.__name__, arch,
                                        f"{dtype}{'+features' if features else ''}",
                                        len(buf.getvalue()), time.perf_counter() - start)
                        done.append(item)
                        progress(f"[aot] {item.kernel:28s} {item.arch:7s} {item.variant:18s} "
                                 f"{item.cubin_bytes / 1024:7.0f} KiB {item.seconds:5.1f} s")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable)")
    parser.add_argument("--dtype", action="append", choices=DTYPES, help="input dtype (repeatable)")
    args = parser.parse_args(argv)
    done = compile_all(tuple(args.arch or ARCHS), tuple(args.dtype or DTYPES))
    print(f"[aot] {len(done)} cubins, {sum(d.seconds for d in done):.0f} s of compilation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
