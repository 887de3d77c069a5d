# CPU, after device calls 1 and 2: bash after.sh DIR1 DIR2 (the calls' files_at)
set -eu
bash results/h200/screening/stop35/calls/slim.sh back
old() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['environment']['git_revision'][:7])" "$1"; }
for f in "$1"/gpu_tests.json "$1"/gpu_mixer_tests.json "$1"/first-call.json "$1"/tilegym_replayed.json "$2"/models.json; do
  name=$(basename "$f" .json)
  prev=results/h200/previous/$name-$(old results/h200/$name.json).json
  [ -e "$prev" ] || git mv results/h200/$name.json "$prev"
  cp "$f" results/h200/$name.json
done
.venv/bin/python -m ssd.nbutil
git status --short
