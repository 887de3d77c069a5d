# device call 3 of the landing: chapters 08-11 executed on the H200 against the new recordings
set -u
t0=$SECONDS
echo "sent: $(cat .revision)"
tar -xJf .scratch/landing/res.tar.xz
python3 -m ssd.notebooks "08_*.ipynb" "09_*.ipynb" "10_*.ipynb" "11_*.ipynb" 2>&1 | tail -n 6
tar -czf $OUT/notebooks.tgz notebooks/08_validation.ipynb notebooks/09_layout_tiling.ipynb notebooks/10_peers.ipynb notebooks/11_complete_job.ipynb
echo "=== [$((SECONDS-t0))s] done"
