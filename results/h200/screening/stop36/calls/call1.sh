# stop 36 call 1 (fresh machine): the layout study, then the layer's prefill grid if time allows.
# Every run here shares one compile cache (/tmp/kc; the records say "caller's"): these recordings
# time steady state only, and later calls on the same machine reuse the compiled kernels.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
export CUDA_TILE_CACHE_DIR=/tmp/kc/tile TRITON_CACHE_DIR=/tmp/kc/triton
mkdir -p $CUDA_TILE_CACHE_DIR $TRITON_CACHE_DIR
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] study"
python3 -m ssd.bench --suite study --reps 20 2>&1 | grep -v Warning | tail -n 14
cp results/h200/study.json $OUT/
if [ $((SECONDS-t0)) -lt 470 ]; then
  echo "=== [$((SECONDS-t0))s] layer: prefill"
  python3 -m ssd.endtoend --only prefill --quick --layers 8 --prefill-reps 5 --chunk-size cutile=64 2>&1 | grep -v Warning | tail -n 8
  cp results/h200/endtoend.json $OUT/
fi
echo "=== [$((SECONDS-t0))s] done"
