#!/usr/bin/env bash
set -u
. bench/device/env.sh
timeout 520 python3 -m bench.decode_speedup --heads ~/keep --data ~/keep/humaneval.jsonl.xz --fp32-check \
  > "$OUT/decode.log" 2>&1; echo "rc=$?"; grep -v Loading "$OUT/decode.log" | tail -40 | cut -c1-400
save
