#!/usr/bin/env bash
# The GPU recipe of issue 7 (bench.gpu_recipe: configs/smollm2-135m-gpu.yaml through the product, no Ray), one step per
# call on the same warm machine, state in ~/keep:
#   regenerate [BUDGET_S]             carry .carry/w2 after `keep_carry.sh .carry/w1 .carry/w3`: installs SmolLM2 (float32 and
#                                     bfloat16), regenerates first assistant turns -> ~/keep/train.jsonl.xz, regenerate.json
#   train METHOD [BUDGET_S [MAX_STEPS [CALIB_STEPS]]]   no carry: one head (peagle | eagle3) -> ~/keep/head-METHOD/,
#                                     ~/keep/train-METHOD.json (e.g. train peagle 450 1000; train eagle3 330 700)
#   return                            no carry: both heads, regenerate.json and train-*.json as heads.tar.partNN
#                                     (< 16 MiB parts; a call returns at most 8 files)
# Usage: bash bench/device/run_gpu_recipe.sh STEP [ARGS...]
set -u
. bench/device/env.sh
case "${1:-}" in
  regenerate)
    . bench/device/install_target.sh float32 bfloat16
    timeout 300 python3 -m bench.gpu_recipe regenerate --data ~/keep --budget-s "${2:-250}" 2>&1 | grep -v Loading | tail -3
    save ;;
  train)
    timeout 560 python3 -m bench.gpu_recipe train --method "$2" --budget-s "${3:-450}" --max-steps "${4:-0}" \
      --calib-steps "${5:-2}" > "$OUT/train_$2.log" 2>&1
    echo "rc=$?"; grep -v Loading "$OUT/train_$2.log" | tail -3 | cut -c1-1500
    save ;;
  return)
    rm -rf "$OUT"/*.log "$OUT/r"  # the return holds at most 8 files: only the tar parts
    tar -C ~/keep -cf - head-peagle head-eagle3 regenerate.json train-peagle.json train-eagle3.json \
      | split -b 15000000 -d - "$OUT/heads.tar.part"
    ls -la "$OUT" ;;
  *) echo "usage: bash bench/device/run_gpu_recipe.sh regenerate [BUDGET_S] | train METHOD [BUDGET_S [MAX_STEPS [CALIB_STEPS]]] | return"; exit 2 ;;
esac
