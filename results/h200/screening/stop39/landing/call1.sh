# device call 1 of the landing: the full GPU tests; only if they pass, first calls and the replay
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] GPU tests, all"
python3 -m pytest -m gpu tests/ -n 16 -q -p no:cacheprovider 2>&1 | grep -v "^SKIPPED" | tail -n 12
rc=${PIPESTATUS[0]}
cp results/h200/gpu_tests.json results/h200/gpu_mixer_tests.json $OUT/
[ "$rc" = 0 ] || { echo "GPU tests failed: rc $rc"; exit 1; }
echo "=== [$((SECONDS-t0))s] first call"
python3 -m ssd.bench --suite first-call 2>&1 | grep -v Warning | tail -n 8
cp results/h200/first-call.json $OUT/
echo "=== [$((SECONDS-t0))s] replay"
python3 -m ssd.bench --suite models --impl ssd --impl tilegym_tuned --quick --reps 30 --tilegym-replay results/h200/tilegym_tuned --out results/h200/tilegym_replayed.json 2>&1 | grep -v Warning | tail -n 8
cp results/h200/tilegym_replayed.json $OUT/
echo "=== [$((SECONDS-t0))s] done"
