# stop 35 call 3: the models recording, then chapters 10, 09 and 06-08;
# each chapter written back to $OUT as soon as it ran. previous/ and screening/ travel as one tar.xz.
set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
echo "=== [$((SECONDS-t0))s] models"
python3 -m ssd.bench --suite models --reps 30 2>&1 | grep -v Warning | tail -n 12
cp results/h200/models.json $OUT/
tar -xJf .scratch/s35/res.tar.xz
done_nb=""
chapter() {
  python3 -m ssd.notebooks "${1}_*.ipynb" 2>&1 | tail -n 3
  done_nb="$done_nb $(ls notebooks/${1}_*.ipynb)"
  tar -czf $OUT/notebooks.tgz $done_nb results/h200/stage2_chunk_state.json results/h200/stage3_chunk_scan.json
  echo "   [$((SECONDS-t0))s] chapter $1"
}
chapter 10
chapter 09
for nb in 06 07 08; do chapter $nb; done
echo "=== [$((SECONDS-t0))s] done"
