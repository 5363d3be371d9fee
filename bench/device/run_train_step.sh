#!/usr/bin/env bash
# Carry .carry/w1: keep the wheel half + data (as `keep_carry.sh .carry/w1`); the training-step grid
# (bench.train_step), the CUDA/Triton unit tests of the loss, objective and partitions, and the phase
# breakdown of one step (bench.step_breakdown).
set -u
mkdir -p ~/keep && cp .carry/w1/* ~/keep/
. bench/device/env.sh
nvidia-smi -L
timeout 400 python3 -m bench.train_step > "$OUT/train_step.log" 2>&1; echo "train_step rc=$?"
tail -16 "$OUT/train_step.log"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_loss.py tests/unit/test_objective.py tests/unit/test_partition.py \
  > "$OUT/gpu_unit.log" 2>&1; echo "gpu unit tests rc=$?"; tail -3 "$OUT/gpu_unit.log"
timeout 300 python3 -m bench.step_breakdown > "$OUT/step_breakdown.log" 2>&1; echo "step_breakdown rc=$?"; tail -3 "$OUT/step_breakdown.log"
save
