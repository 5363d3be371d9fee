#!/usr/bin/env bash
# Scaling table, lease 1, next calls (no carry, same warm machine): regenerate the next chunks of the mixed
# order for BUDGET_S seconds (a chunk started before the budget ends is finished); once every chunk of SIZE
# is done, return the regenerated set as .jsonl.xz parts < 16 MiB (bench.scale pack-data).
# The chunks written by this call come back too; carrying them (and selfinstruct.jsonl.xz) as .carry/scale-data
# restores a lost machine's progress.
# Usage: bash bench/device/run_scale_regen.sh SIZE BUDGET_S
set -u
. bench/device/env.sh
if [ -d .carry/scale-data ]; then cp -n .carry/scale-data/* ~/keep/ 2>/dev/null; mkdir -p ~/keep/regen; mv -n ~/keep/chunk-*.jsonl.xz ~/keep/regen/ 2>/dev/null; fi
touch "$OUT/.start"
timeout 570 python3 -m bench.scale regenerate --size "${1:-30000}" --budget-s "${2:-420}" 2>&1 | grep "^chunk\|^{" | cut -c1-600
python3 - "${1:-30000}" <<'PY' && python3 -m bench.scale pack-data --out "$OUT"
import json, os, sys
calls = json.load(open(os.path.expanduser("~/keep/scale_regenerate.json")))["calls"]
sys.exit(0 if calls[-1]["chunks_done"] == calls[-1]["chunks_total"] else 1)
PY
[ -n "$(ls "$OUT"/regenerated.jsonl.xz.part* 2>/dev/null)" ] || \
  find ~/keep/regen -name "chunk-*" -newer "$OUT/.start" -exec cp {} "$OUT/" \;  # this call's chunks come back
rm -f "$OUT/.start"
save
