# stop 35 call 1: the cheaper completion (branch next/decay-row): its GPU tests, then its screen
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] GPU tests, grouped configs"
SSD_TEST_CONFIGS=GROUPS,GROUPS64,GROUPS_NT,GROUPS64M,GROUPS_NTM python3 -m pytest -m gpu tests/test_gpu_kernels.py -n 16 -q -p no:cacheprovider 2>&1 | grep -v "^SKIPPED" | tail -n 15
cp results/h200/gpu_tests.json $OUT/gpu_tests_groups.json 2>/dev/null
echo "=== [$((SECONDS-t0))s] completion screen"
python3 results/h200/screening/stop34/completion.py $OUT/completion.json 2>&1 | grep -v Warning | tail -n 25
echo "=== [$((SECONDS-t0))s] done"
