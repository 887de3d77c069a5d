"""What the sm_90 compile makes of chunk_scan with and without the carried state (on a CPU, on
branch next/carry's tree: ``PYTHONPATH=<that tree> python carry_sass.py <out>``): registers, shared
memory and instruction counts of the SASS, on 2.7b's tile (chunk 64, p 64, n 128, bf16, the
layer's features), carry 1 (what ships) and 4."""
import collections
import json
import re
import sys
from dataclasses import replace

from ssd import aot
from ssd.config import default_config
from ssd.env import environment

OPS = ("HGMMA", "UTMALDG", "LDS", "STS", "LDSM", "STSM", "BAR", "SYNCS", "WARPGROUP", "PRMT", "F2FP")
DIMS = (2, 512, 4, 64, 128, 1)  # (b, l, h, p, n, g): full chunks of 64, one group


def counts(cubin):
    ops = collections.Counter()
    for line in aot.sass(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return dict(instructions=sum(ops.values()), **{k: ops.get(k, 0) for k in OPS})


rows = []
for carry in (1, 4):
    b, l, h, p, n, g = DIMS
    d = default_config((9, 0), problem=(b, h, p, n), sms=132, chunk_size=64)
    cfg = replace(d, scan=replace(d.scan, carry=carry))
    recs = aot.capture_forward("bfloat16", "layer", True, chunk_size=64, config=cfg, dims=DIMS)
    scan = next(r for r in recs if r.kernel._pyfunc.__name__ == "chunk_scan_kernel")
    cubin = aot.export_cubin(scan, "sm_90")
    rows.append(dict(carry=carry, **aot.resource_usage(cubin), **counts(cubin)))
    print(rows[-1])
json.dump(dict(dims=DIMS, chunk_size=64, arch="sm_90", rows=rows, environment=environment()),
          open(sys.argv[1], "w"), indent=1)
