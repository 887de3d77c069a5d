# stop 36 call 5: chapters 10, 09, 11 (and 05 if time allows) on the H200, each written back to
# $OUT as soon as it ran. previous/ and screening/ travel as one tar.xz.
set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
tar -xJf .scratch/s36/res.tar.xz
done_nb=""
chapter() {
  if [ $((SECONDS-t0)) -ge $2 ]; then echo "   SKIP chapter $1"; return; fi
  python3 -m ssd.notebooks "${1}_*.ipynb" 2>&1 | tail -n 3
  done_nb="$done_nb $(ls notebooks/${1}_*.ipynb)"
  tar -czf $OUT/notebooks.tgz $done_nb
  echo "   [$((SECONDS-t0))s] chapter $1"
}
chapter 10 100; chapter 09 160; chapter 11 200; chapter 05 200
echo "=== [$((SECONDS-t0))s] done"
