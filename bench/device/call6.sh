#!/usr/bin/env bash
# Last call on a machine near its 30-minute hold: a shorter EAGLE-3 run (TTT-7 is ~0.5 s/step at
# 16k tokens), the decode speed-up on a reduced grid, and the return of the EAGLE-3 head.
set -u
. bench/device/env.sh
timeout 270 python3 -m bench.gpu_recipe train --method eagle3 --budget-s 240 --max-steps 380 --calib-steps 2 \
  > "$OUT/train_eagle3.log" 2>&1; echo "train rc=$?"; grep -v Loading "$OUT/train_eagle3.log" | tail -1 | cut -c1-900
timeout 270 python3 -m bench.decode_speedup --heads ~/keep --data ~/keep/humaneval.jsonl.xz --concurrency 1 16 64 \
  --max-new-tokens 96 > "$OUT/decode.log" 2>&1; echo "decode rc=$?"; grep -v Loading "$OUT/decode.log" | tail -22 | cut -c1-330
mkdir -p "$OUT/r"; cp bench/results/decode_speedup.json ~/keep/*.json "$OUT/r/" 2>/dev/null
rm -f "$OUT/r/train_step_cpu.json" "$OUT/r/regenerate.json" "$OUT/r/train-peagle.json"
tar -C ~/keep -cf - head-eagle3 | split -b 15000000 -d - "$OUT/eagle3.tar.part"; ls -la "$OUT" "$OUT/r"
