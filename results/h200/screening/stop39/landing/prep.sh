# CPU, before the landing's device calls (see README.md)
set -eu
git rev-parse --short=12 HEAD > .revision
.venv/bin/python -m ssd.nbutil "$(cat .revision)"
mkdir -p .scratch/landing
tar -cJf .scratch/landing/res.tar.xz results/h200/previous results/h200/screening
git status --short | grep -v '^??' && { echo "commit the digests first (python -m ssd.nbutil changed them)"; exit 1; }
bash results/h200/screening/stop35/calls/slim.sh away
