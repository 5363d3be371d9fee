#!/usr/bin/env bash
# No carry: drafting cost vs K, eager and CUDA graphs (bench.drafting_cost).
set -u
. bench/device/env.sh
timeout 540 python3 -m bench.drafting_cost > "$OUT/drafting_cost.log" 2>&1; echo "drafting_cost rc=$?"
grep -v "^{'target'" "$OUT/drafting_cost.log" | tail -20 | cut -c1-400
save
