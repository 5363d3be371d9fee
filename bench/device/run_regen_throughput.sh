#!/usr/bin/env bash
# Carry .carry/w2, after keep_carry_w1.sh: install SmolLM2 (bf16), then regeneration throughput of the
# transformers backend, plain generate vs static cache + compiled decoding, same prompts (bench.regen_throughput).
set -u
. bench/device/install_target.sh bfloat16
timeout 500 python3 -m bench.regen_throughput --data ~/keep/sharegpt.jsonl.xz --prompts 2048 --batch-size 512 \
  --max-batch-tokens 524288 2>&1 | grep -v "Loading\|clean_up" | tail -5
save
