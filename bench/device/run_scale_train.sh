#!/usr/bin/env bash
# Scaling table, lease 2 (no carry, same warm machine, data restored): train METHOD on the first SIZE
# conversations for TRAIN_S GPU seconds in total (warm-up excluded); this call stops at a checkpoint after
# BOX_S post-warm-up seconds, the next call with the same arguments resumes. The finished head comes back as
# head-<method>-<size>.tar.part* (< 16 MiB each).
# Usage: bash bench/device/run_scale_train.sh METHOD SIZE TRAIN_S [BOX_S [bench.scale train flags...]]
# e.g. a variant: run_scale_train.sh peagle 29905 600 400 --variant 600s
set -u
. bench/device/env.sh
timeout 580 python3 -m bench.scale train --method "$1" --size "$2" --train-s "$3" --box-s "${4:-420}" --out "$OUT" "${@:5}" \
  > "$OUT/train.log" 2>&1
echo "rc=$?"; grep -v Loading "$OUT/train.log" | grep -v '^{"step"' | tail -4 | cut -c1-1200
grep '^{"step"' "$OUT/train.log" | python3 -c "
import json, sys
for l in sys.stdin:
    m = json.loads(l); print(int(m['step']), round(m['loss'], 3), 'acc', [round(m.get(f'acc_d{i}', 0), 3) for i in range(8)], round(m.get('tokens_per_s', 0)))"
rm -f "$OUT/train.log"
save
