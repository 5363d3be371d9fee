#!/usr/bin/env bash
# Issue 25 item 5a: the serving table of SmolLM2 with trained heads in GPU vLLM, through the evaluate stage's engine
# worker (bench.eval_gpu_heads --engine gpu): none, then each head in ~/keep (head-peagle-*, head-eagle3-*, as
# `run_scale.sh train` leaves them; head-spec-*, speculators' as `run_speculators.sh train` leaves them) at every K
# and concurrency, with each step split (--step-costs). Rows go to
# ~/keep/gpu_vllm_serving.json (seeded from bench/results on a new machine) and come back after every call; a
# second call resumes where the first stopped. Needs install_vllm.sh and install_target.sh on this warm machine.
# Usage: [EVAL_FLAGS=...] bash bench/device/run_gpu_serving.sh SETS [K_SWEEP [NUM_PROMPTS [MAX_TOKENS]]]
#   EVAL_FLAGS: more bench.eval_gpu_heads flags, e.g. --new-session on a machine of another GPU the same day
#   e.g. run_gpu_serving.sh humaneval:1,4,16,64 3,5,7,11 64 256
set -u
T0=$SECONDS
. bench/device/env.sh
. bench/device/install_vllm.sh > /dev/null || exit 1
NAME=gpu_vllm_serving
[ -f ~/keep/$NAME.json ] || cp bench/results/$NAME.json ~/keep/ 2>/dev/null || true
HEADS=$(for d in ~/keep/head-peagle-* ~/keep/head-eagle3-* ~/keep/head-spec-*; do
  [ -f "$d/config.json" ] && echo "--head $(basename "$d" | sed 's/^head-//')=$d"; done)
SETS=$(for s in ${1//;/ }; do echo "--set $s"; done)
timeout $((580 - (SECONDS - T0))) python3 -m bench.eval_gpu_heads --engine gpu --step-costs $HEADS $SETS \
  --k "${2:-3,5,7,11}" --num-prompts "${3:-64}" --max-tokens "${4:-256}" --name $NAME --results-dir ~/keep \
  --out ~/keep/gpu-eval ${EVAL_FLAGS:-} 2>&1 | grep -E '^\{|Error|error' | cut -c1-400
echo "rc=$? after $((SECONDS - T0)) s"
save
