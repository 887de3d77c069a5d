# stop 36 call 4: the first-call suite with the grouped full-chunk shape (fresh process and empty
# cuTile cache per shape, as always)
set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
python3 -m ssd.bench --suite first-call 2>&1 | grep -v Warning | tail -n 10
cp results/h200/first-call.json $OUT/
echo "=== [$((SECONDS-t0))s] done"
