#!/usr/bin/env bash
# Scaling table, lease 2 (carry .carry/scale-data: the parts pack-data returned), after keep_carry_w1.sh and
# setup_target.sh bfloat16: restore the regenerated set in ~/keep/regen (no regeneration on this lease).
set -u
. bench/device/env.sh
python3 -m bench.scale unpack-data .carry/scale-data
