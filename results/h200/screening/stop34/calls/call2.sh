set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] models"
python3 -m ssd.bench --suite models --reps 30 2>&1 | grep -v Warning | tail -n 12
echo "=== [$((SECONDS-t0))s] first call"
python3 -m ssd.bench --suite first-call 2>&1 | grep -v Warning | tail -n 8
echo "=== [$((SECONDS-t0))s] replay"
python3 -m ssd.bench --suite models --impl ssd --impl tilegym_tuned --quick --reps 30 --tilegym-replay results/h200/tilegym_tuned --out results/h200/tilegym_replayed.json 2>&1 | grep -v Warning | tail -n 8
echo "=== [$((SECONDS-t0))s] serving"
python3 -m ssd.bench --suite serving --reps 30 2>&1 | grep -v Warning | tail -n 6
cp results/h200/models.json results/h200/first-call.json results/h200/tilegym_replayed.json results/h200/serving.json $OUT/
echo "=== [$((SECONDS-t0))s] rule2"
python3 results/h200/screening/stop34/rule2.py $OUT/rule2.json 2>&1 | grep -v Warning | tail -n 8
echo "=== [$((SECONDS-t0))s] done"
