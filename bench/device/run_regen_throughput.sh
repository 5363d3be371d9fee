#!/usr/bin/env bash
# Regeneration throughput of the regenerate stage's engines on the same prompts (bench.regen_throughput).
# Usage: bash bench/device/run_regen_throughput.sh [ENGINES [NAME [PROMPTS [bench.regen_throughput flags...]]]]
#   ENGINES plain,static (default; issue 14: transformers plain vs static cache, carry .carry/w2 after `keep_carry.sh .carry/w1 .carry/w3`)
#   ENGINES vllm,static NAME regen_throughput_vllm (issue 25 item 4: vLLM after install_vllm.sh on this warm machine)
#   ENGINES vllm NAME regen_sweep_vllm 4096 --vllm-sweep 256:8192,512:32768,1024:32768 (issue 40 item 3: the
#     scheduler settings, one engine each, ~2 min an engine on an H100)
# SmolLM2 (bf16) is installed first when this warm machine lacks it (carry .carry/w2 then).
set -u
ENGINES=${1:-plain,static}
[ -d ~/keep/peagle/targets ] && . bench/device/env.sh || . bench/device/install_target.sh bfloat16
case "$ENGINES" in *vllm*) . bench/device/install_vllm.sh || exit 1 ;; esac
timeout 500 python3 -m bench.regen_throughput --data ~/keep/sharegpt.jsonl.xz --prompts "${3:-2048}" --batch-size 512 \
  --max-batch-tokens 524288 --engines "$ENGINES" --name "${2:-regen_throughput}" "${@:4}" 2>&1 | grep -v "Loading\|clean_up" | grep -v "^(EngineCore\|^INFO\|^WARNING" | tail -8
save
