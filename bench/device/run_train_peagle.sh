#!/usr/bin/env bash
# After run_regenerate_and_capture.sh on the same warm machine: train the GPU recipe's P-EAGLE head
# (bench.gpu_recipe train --method peagle) into ~/keep/head-peagle.
set -u
. bench/device/env.sh
timeout 560 python3 -m bench.gpu_recipe train --method peagle --budget-s 450 --max-steps 1000 --calib-steps 2 > "$OUT/train_peagle.log" 2>&1
echo "rc=$?"; grep -v Loading "$OUT/train_peagle.log" | tail -4 | cut -c1-1500
save
