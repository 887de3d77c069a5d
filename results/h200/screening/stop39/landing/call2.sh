# device call 2 of the landing: the models run (the suite starts from fresh kernel caches)
set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
python3 -m ssd.bench --suite models --reps 30 2>&1 | grep -v Warning | tail -n 20
cp results/h200/models.json $OUT/
echo "=== [$((SECONDS-t0))s] done"
