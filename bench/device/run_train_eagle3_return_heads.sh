#!/usr/bin/env bash
# After run_train_peagle.sh: train EAGLE-3 TTT-7, then return both heads (tar split in < 16 MiB parts, <= 8 files).
set -u
. bench/device/env.sh
timeout 420 python3 -m bench.gpu_recipe train --method eagle3 --budget-s 330 --max-steps 700 --calib-steps 2 > "$OUT/train_eagle3.log" 2>&1
echo "rc=$?"; grep -v Loading "$OUT/train_eagle3.log" | tail -3 | cut -c1-1500
rm -rf "$OUT"/*.log "$OUT/r"  # the return holds at most 8 files: only the tar parts
tar -C ~/keep -cf - head-peagle head-eagle3 regenerate.json train-peagle.json train-eagle3.json \
  | split -b 15000000 -d - "$OUT/heads.tar.part"
ls -la "$OUT"
