#!/usr/bin/env bash
# speculators 0.9 side by side with peagle (issue 26 item 5, bench/speculators_side.py), one step per call, state in
# ~/keep (a machine idle for ~30 s goes back with it):
#   install                    carry .carry/spec (bench/device/prepare_speculators_carry.sh): its wheels into
#                              ~/keep/spec-site, pydantic's only where ~/keep/site has none; prints the versions
#   data SIZE                  after `run_scale.sh restore` (~/keep/regen): the first SIZE conversations tokenized as
#                              peagle's capture does, peagle's plan's d2t/t2d -> ~/keep/spec-data (no target forward)
#   train METHOD TRAIN_S [FLAGS]   speculators' trainer (peagle | eagle3) for TRAIN_S GPU-seconds after warm-up, fed
#                              online by peagle's capture in its data-loader workers; FLAGS go to
#                              `bench.speculators_side train` (--calib-only first: the calibration alone; --resume
#                              after a call that stopped at a checkpoint; --recipe best: speculators' best settings,
#                              state in ~/keep/spec-METHOD-best; `-- FLAG...` for speculators itself). Returns
#                              r/spec_train_<tag>.json (tokens/s, peak memory) when the run is done, the head as
#                              spec-<tag>.tar.partNN (< 16 MiB each: the peagle head directory of `check`, speculators'
#                              own config.json beside it), r/spec_state_<METHOD>[-best].json (every call's timing) and
#                              r/spec_gpu_<METHOD>[-best].jsonl (per call: GPU busy share, peak memory of all its processes);
#                              here: python -m bench.speculators_side record r/spec_train_<tag>.json --gpu r/spec_gpu_<M>.jsonl
# Usage: bash bench/device/run_speculators.sh STEP [ARGS...]
set -u
STEP=${1:-}; shift
. bench/device/env.sh
case ":${PYTHONPATH:-}:" in *":$HOME/keep/spec-site:"*) ;; *) export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$HOME/keep/spec-site ;; esac
case "$STEP" in
  install)
    W=$(ls .carry/spec/*.whl | grep -v -E "/(pydantic|pydantic_core|annotated_types|typing_inspection|typing_extensions)-")
    python3 -c "import pydantic" 2>/dev/null || W=.carry/spec/*.whl
    python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/spec-site $W 2>&1 \
      | grep -v -E "^\[notice\]|WARNING: Target directory|running pip as the 'root'" || true
    python3 -c "
import importlib.metadata as md, speculators.train.cli, hs_connectors, datasets, openai
print({p: md.version(p) for p in ('speculators', 'hs-connectors', 'torch', 'transformers', 'datasets', 'pydantic', 'numpy', 'triton')})" ;;
  data)
    python3 -m bench.speculators_side data --keep ~/keep --size "${1:-99000}" --out ~/keep/spec-data 2>&1 \
      | grep -v -E "Loading|Saving the dataset" | tail -3 ;;
  train)
    M=$1; S=$2; shift 2
    D=$M  # the arm: spec-<D> is bench.speculators_side's run directory, <D> names the returned files
    case " $* " in *" --recipe best "*) D=$M-best ;; esac
    touch "$OUT/.start"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -l 2 > ~/keep/spec_smi.csv &
    SMI=$!
    timeout 570 python3 -m bench.speculators_side train --method "$M" --data ~/keep/spec-data --train-s "$S" \
      --out ~/keep "$@" > ~/keep/spec_train.log 2>&1
    echo "rc=$?"
    kill $SMI
    # every process on the GPU (the trainer and its capture workers, CUDA contexts included)
    R=defaults; [ "$D" = "$M" ] || R=best
    awk -F', ' -v m="$M" -v r="$R" '{u += $1; n++; if ($2 > p) p = $2} END {printf "{\"method\": \"%s\", \"recipe\": \"%s\", \"gpu_busy_avg_pct\": %.1f, \"samples\": %d, \"mem_used_peak_mib\": %d}\n", m, r, u / n, n, p}' \
      ~/keep/spec_smi.csv | tee -a ~/keep/spec_gpu_"$D".jsonl
    cp ~/keep/spec_gpu_"$D".jsonl "$OUT/r/"
    grep -E "^\{|Error|error:" ~/keep/spec_train.log | tail -4 | cut -c1-1500
    cp ~/keep/spec-"$D"/state.json "$OUT/r/spec_state_$D.json" 2>/dev/null
    if [ -d ~/keep/spec-"$D"/final ] && [ ~/keep/spec-"$D"/final -nt "$OUT/.start" ]; then
      TAG=$(python3 -c "import json; print(json.load(open('$HOME/keep/spec-$D/state.json'))['tag'])")
      H=~/keep/head-$TAG
      python3 -m bench.speculators_side check ~/keep/spec-"$D"/final --out "$H" 2>&1 | tail -1 | cut -c1-600
      cp ~/keep/spec-"$D"/final/config.json "$H/speculators_config.json"
      (cd ~/keep && tar -cf - "head-$TAG") | split -b 15M -d - "$OUT/$TAG.tar.part"
    fi
    rm -f "$OUT/.start"
    save ;;
  *) echo "usage: bash bench/device/run_speculators.sh install | data SIZE | train METHOD TRAIN_S [FLAGS]"; exit 2 ;;
esac
