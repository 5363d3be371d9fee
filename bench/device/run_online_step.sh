#!/usr/bin/env bash
# Carry .carry/w2, after `keep_carry.sh .carry/w1 .carry/w3`: install SmolLM2 (bf16), then the online (capture in the step) vs
# offline (materialized samples) P-EAGLE training step at N=8192 (bench.online_step).
set -u
. bench/device/install_target.sh bfloat16
timeout 400 python3 -m bench.online_step --data ~/keep/sharegpt.jsonl.xz 2>&1 | grep -v "Loading\|clean_up" | tail -6
save
