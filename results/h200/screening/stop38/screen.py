"""stop 38 screen: first calls in fresh processes with fresh cuTile caches, with chunk_scan's quick
first call (SSD_QUICK_FIRST_CALL=1) and without (0) on long-16k at 64, then the first-call suite."""
import json, os, sys
from ssd import bench
from ssd.env import environment, write_json
rows = []
long16 = next(s for s in bench.SUITES["models"] if s.name == "long-16k")
for quick in ("1", "0"):
    os.environ["SSD_QUICK_FIRST_CALL"] = quick
    rows.append(dict(bench.first_call_seconds(long16, 64), quick=quick))
    print(json.dumps(rows[-1]), flush=True)
os.environ["SSD_QUICK_FIRST_CALL"] = "1"
for s in bench.FIRST_CALL_SHAPES:
    rows.append(dict(bench.first_call_seconds(s), quick="1"))
    print(json.dumps(rows[-1]), flush=True)
write_json(sys.argv[1], dict(rows=rows, environment=environment()))
