#!/usr/bin/env bash
# Scaling table, lease 1, call 2 (carry .carry/w2, after keep_carry_w1.sh): install SmolLM2 (bf16) and datasketch,
# the target writes its self-instruct prompts (bench.scale prompts), returned as selfinstruct.jsonl.xz.
# Usage: bash bench/device/run_scale_data.sh NUM_PROMPTS
set -u
. bench/device/install_target.sh bfloat16
python3 -m pip install -q --no-index --no-deps --target ~/keep/site .carry/w2/datasketch-*.whl
timeout 330 python3 -m bench.scale prompts --num "${1:-34000}" 2>&1 | grep -v "Loading\|clean_up" | tail -2 | cut -c1-800
cp ~/keep/selfinstruct.jsonl.xz "$OUT/"  # returned: a lost machine does not cost the prompts again
save
