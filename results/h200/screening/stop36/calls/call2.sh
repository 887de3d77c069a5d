# stop 36 call 2 (warm machine of call 1): the seqlen sweep and the layer's shared-weights runs
# (what call 1 left), on the shared cache; then, if time allows, the models run with the fresh
# caches python -m ssd.bench makes by default (honest first calls).
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu/xd .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu/xd
t0=$SECONDS
echo "sent: $(cat .revision)"
step() { # name, max start time, command...
  local name=$1 latest=$2; shift 2
  if [ $((SECONDS-t0)) -ge $latest ]; then echo "=== [$((SECONDS-t0))s] SKIP $name"; return; fi
  echo "=== [$((SECONDS-t0))s] $name"
  "$@" 2>&1 | grep -v Warning | tail -n 12
}
( export CUDA_TILE_CACHE_DIR=/tmp/kc/tile TRITON_CACHE_DIR=/tmp/kc/triton
  for s in ${STEPS:-seqlen share}; do
    case $s in
      seqlen) step seqlen 200 python3 -m ssd.bench --suite seqlen --reps 30 --quick; cp results/h200/seqlen.json $OUT/ ;;
      share) step "layer: share" 470 python3 -m ssd.endtoend --only share --reps 10 --chunk-size cutile=64; cp results/h200/endtoend.json $OUT/ ;;
      prefill) step "layer: prefill" 490 python3 -m ssd.endtoend --only prefill --quick --layers 8 --prefill-reps 5 --chunk-size cutile=64; cp results/h200/endtoend.json $OUT/ ;;
    esac
  done )
if [ -n "${MODELS:-}" ]; then
  step models $MODELS python3 -m ssd.bench --suite models --reps 30
  cp results/h200/models.json $OUT/ 2>/dev/null
fi
echo "=== [$((SECONDS-t0))s] done"
