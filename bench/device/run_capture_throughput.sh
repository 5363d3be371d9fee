#!/usr/bin/env bash
# Capture throughput (bench.capture_throughput): the capture stage's model step against a plain forward, on the
# carried ShareGPT conversations (or DATA). Needs SmolLM2 on this warm machine (`. install_target.sh bfloat16`, carry
# .carry/w2 after `keep_carry.sh .carry/w1 .carry/w3`); with --vllm also install_vllm.sh. Writes capture_throughput.json
# (capture_throughput_vllm.json with --vllm).
# Usage: bash bench/device/run_capture_throughput.sh [bench.capture_throughput flags...]
#   e.g. run_capture_throughput.sh --num-conversations 512 --batch-sizes 32 --vllm
set -u
[ -d ~/keep/peagle/targets ] && . bench/device/env.sh || . bench/device/install_target.sh bfloat16
case " $* " in *" --vllm "*) . bench/device/install_vllm.sh || exit 1 ;; esac
timeout 540 python3 -m bench.capture_throughput --data ~/keep/sharegpt.jsonl.xz "$@" 2>&1 | grep -v Loading | tail -8
save
