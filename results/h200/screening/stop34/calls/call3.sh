# Stop 34's third and fourth calls, as one script: the full GPU test suite (the recording
# results/h200/gpu_tests.json), then the chapters on the H200. The results folders the chapters
# read (previous/, screening/) travel as one tar.xz (0.4 MB instead of 6.8 MB) so that the call
# fits the 64 MiB carry with the toolchain and the peers. In stop 34 the chapters ran in a call of
# their own because `slim.sh away` had untracked notebooks/ (put them back first).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
t0=$SECONDS
echo "sent: $(cat .revision)"
python3 -m pytest -m gpu tests/ -n 16 -q -p no:cacheprovider 2>&1 | grep -v "^SKIPPED" | tail -n 8
cp results/h200/gpu_tests.json results/h200/gpu_mixer_tests.json $OUT/
tar -xJf .scratch/s34/res.tar.xz
done_nb=""
for nb in 10 09 06 07 08; do   # each chapter written back to $OUT as soon as it ran
  python3 -m ssd.notebooks "${nb}_*.ipynb" 2>&1 | tail -n 3
  done_nb="$done_nb $(ls notebooks/${nb}_*.ipynb)"
  tar -czf $OUT/notebooks.tgz $done_nb results/h200/stage2_chunk_state.json results/h200/stage3_chunk_scan.json
  echo "   [$((SECONDS-t0))s]"
done
