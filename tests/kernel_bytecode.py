"""Print {shape: {kernel signature and hints: sha256 of its TileIR bytecode}} for the forward's
kernels as the ``ssd`` package on the path builds them (run with PYTHONPATH at a tree of another
revision: tests/test_nbutil_kernels.py), a shape being the JSON of its dims (b, l, h, p, n, g). The
launches: the small default shapes with every feature set, both stage 2s and every chunk size; each
models and first-call shape's default at every chunk size; and every point of the layout study's
spaces (ssd.aot.resource_points, on the small default shapes). Only functions that the revisions
compared all have are used."""
import hashlib
import io
import json
import sys

from cuda.tile import compilation

from ssd import _launch, aot
from ssd.bench import FIRST_CALL_SHAPES, SUITES, shape_default

SMS = 132  # the H200's, where the study ran


def small(q):
    """aot.capture_forward's shape without ``dims``."""
    return (2, q + q // 2, 8, 64, 128, 2)


records = []  # (dims, launch)
for features in aot.FEATURES:
    for fused in (True, False):
        for q in (64, 128, 256):
            records += [(small(q), r) for r in aot.capture_forward("bfloat16", features, fused,
                                                                   chunk_size=q)]
for shape in (*SUITES["models"], *FIRST_CALL_SHAPES):
    for q in (64, 128, 256):
        config = shape_default(shape.dims, SMS, chunk_size=q)
        records += [(shape.dims, r) for r in aot.capture_forward(
            "bfloat16", "layer", config.state.fused, chunk_size=q, config=config, dims=shape.dims)]
for _, _, q, config in aot.resource_points(SMS):
    records += [(small(q), r) for r in aot.capture_forward(
        "bfloat16", "layer", config.state.fused, chunk_size=q, config=config)]
digests, shapes = {}, {}
for dims, record in records:
    signature = _launch.signature(record)
    name = record.kernel._pyfunc.__name__
    key = f"{signature.with_mangled_symbol(name).symbol} {record.kernel._compiler_options}"
    if key not in digests:
        buf = io.BytesIO()
        compilation.export_kernel(record.kernel, [signature], buf, output_format="tileir_bytecode",
                                  bytecode_version="13.3")
        digests[key] = hashlib.sha256(buf.getvalue()).hexdigest()
    shapes.setdefault(json.dumps(list(dims)), {})[key] = digests[key]
json.dump(shapes, sys.stdout)
