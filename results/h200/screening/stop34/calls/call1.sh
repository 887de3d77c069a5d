set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] rule screen"
python3 results/h200/screening/stop34/rule.py $OUT/rule.json 2>&1 | grep -v Warning | tail -n 20
echo "=== [$((SECONDS-t0))s] GPU tests, all"
python3 -m pytest -m gpu tests/ -n 16 -q -p no:cacheprovider 2>&1 | grep -v "^SKIPPED" | tail -n 25
cp results/h200/gpu_tests.json results/h200/gpu_mixer_tests.json $OUT/
echo "=== [$((SECONDS-t0))s] done"
