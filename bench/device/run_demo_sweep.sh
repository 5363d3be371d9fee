#!/usr/bin/env bash
# Carry .carry/w2, after `keep_carry.sh .carry/w1 .carry/w3`: install SmolLM2's package + gguf (+ pydantic), convert to
# float32, then the CPU-demo sizing sweep (bench.demo_sweep): VARIANTS (default: all of bench.demo_sweep.VARIANTS),
# RESULT (default demo_sweep), BUDGET_S (default 330).
set -u
. bench/device/install_target.sh float32
timeout $(( ${BUDGET_S:-330} + 70 )) python3 -m bench.demo_sweep --data ~/keep --budget-s "${BUDGET_S:-330}" \
  ${VARIANTS:+--variants "$VARIANTS"} --result "${RESULT:-demo_sweep}" 2>&1 | grep -v "Loading\|[Ww]arn" | tail -30
save
