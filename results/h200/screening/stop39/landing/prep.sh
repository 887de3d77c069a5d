# CPU, before the landing's device calls (see README.md)
set -eu
git rev-parse --short=12 HEAD > .revision
.venv/bin/python -m ssd.nbutil "$(cat .revision)"
mkdir -p .scratch/landing
tar -cJf .scratch/landing/res.tar.xz results/h200/previous results/h200/screening
# The digests stay uncommitted through the calls (the device gets the working tree, so the
# chapters there can answer same_code for .revision); commit them with the recordings.
bash results/h200/screening/stop35/calls/slim.sh away
