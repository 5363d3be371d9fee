#!/usr/bin/env bash
# Scaling table, lease 2, after keep_carry_w1.sh and `. install_target.sh bfloat16` in the same call: restore
# the regenerated set in ~/keep/regen (no regeneration on this lease) from the parts pack-data returned:
# .carry/scale-data when carried, else the committed copy bench/data/scale (travels with the working tree).
set -u
. bench/device/env.sh
python3 -m bench.scale unpack-data "$( [ -d .carry/scale-data ] && echo .carry/scale-data || echo bench/data/scale )"
