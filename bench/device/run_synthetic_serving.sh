#!/usr/bin/env bash
# Issue 25 item 5b: parallel drafting's mechanics at real model sizes with synthetic acceptance
# (bench.synthetic_serving; random-weight targets, nothing carried but vLLM). Rows go to
# ~/keep/gpu_synthetic_serving.json (seeded from bench/results on a new machine) and come back after every call;
# repeat the call until it prints no new cell. Needs install_vllm.sh on this warm machine (or carry .carry/v3
# after keep_carry.sh .carry/v1, .carry/v2 and .carry/v4: it installs then).
# Usage: bash bench/device/run_synthetic_serving.sh [bench.synthetic_serving flags...]
set -u
T0=$SECONDS
. bench/device/install_vllm.sh || exit 1
NAME=${NAME:-gpu_synthetic_serving}  # NAME=gpu_synthetic_load: issue 41's rows (engine settings, step profiles)
[ -f ~/keep/$NAME.json ] || cp bench/results/$NAME.json ~/keep/ 2>/dev/null || true
timeout $((585 - (SECONDS - T0))) python3 -m bench.synthetic_serving --out ~/keep/$NAME.json \
  --budget-s $((470 - (SECONDS - T0))) "$@" 2>&1 | grep -E '^\{|^cell|^budget|Error|error' | cut -c1-500
echo "rc=$? after $((SECONDS - T0)) s"
save
