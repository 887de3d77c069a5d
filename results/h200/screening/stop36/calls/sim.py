"""sim.py on|off [met]: in the current git tree, fake the recordings a landing of kernel code
would re-record (stamped at HEAD), keeping the replaced ones under previous/ as the landing would;
'met' also fakes the first calls the fix should give. off: git checkout results/."""
import json, subprocess, sys
from pathlib import Path
R = Path("results/h200")
if sys.argv[1] == "off":
    subprocess.run(["git", "checkout", "--", "results"], check=True)
    subprocess.run(["git", "clean", "-fq", "results"], check=True)
    sys.exit()
head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
for name in ("models", "first-call", "gpu_tests", "gpu_mixer_tests", "tilegym_replayed", "serving"):
    d = json.loads((R / f"{name}.json").read_text())
    rev = d["environment"]["git_revision"][:7]
    prev = R / "previous" / f"{name}-{rev}.json"
    if not prev.exists():
        prev.write_text((R / f"{name}.json").read_text())
    d["environment"]["git_revision"] = head
    if name == "first-call" and "met" in sys.argv:
        for r in d["rows"]:
            if r["shape"] == "unseen-1x12288-grouped-full":
                r["first_s"], r["compile_s"]["chunk_scan"] = 4.0, 1.4
    if name == "models" and "met" in sys.argv:
        for r in d["records"]:
            if r["shape"] == "long-16k" and r["impl"] == "ssd" and r["chunk_size"] == 64:
                r["first_call_s"] = 4.1
    (R / f"{name}.json").write_text(json.dumps(d, indent=1) + "\n")
print("faked at", head)
