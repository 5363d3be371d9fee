#!/usr/bin/env bash
# Carry .carry/w2, after keep_carry_w1.sh: install SmolLM2 + gguf (+ pydantic if missing), convert it to float32
# and bfloat16, regenerate the GPU recipe's data (bench.gpu_recipe regenerate), time the capture step.
set -u
. bench/device/install_target.sh float32 bfloat16
timeout 300 python3 -m bench.gpu_recipe regenerate --data ~/keep --budget-s 250 2>&1 | grep -v Loading | tail -3
timeout 150 python3 -m bench.capture_throughput --data ~/keep/train.jsonl.xz 2>&1 | grep -v Loading | tail -6
save
