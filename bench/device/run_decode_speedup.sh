#!/usr/bin/env bash
# Carry .carry/heads (the GPU recipe's head-peagle/ and head-eagle3/), after setup_target.sh bfloat16 float32: the
# decoding speed-up grid with the reference decoder, a profile of one step per method and the
# float32 losslessness check (bench.decode_speedup; it rewrites its JSON after every row).
set -u
. bench/device/env.sh
cp -r .carry/heads/head-* ~/keep/
uptime
timeout 545 python3 -m bench.decode_speedup --heads ~/keep --data ~/keep/humaneval.jsonl.xz --fp32-check --profile \
  --budget-s 470 > "$OUT/decode.log" 2>&1; echo "decode rc=$?"
grep -v "Loading\|[Ww]arn" "$OUT/decode.log" | grep "^[12] \|fp32\|wrote\|^none\|^eagle3\|^peagle\|Error" | cut -c1-300
save; ls -la "$OUT/r"
