#!/usr/bin/env bash
# Carry .carry/w1. Keep the wheel half and the data, then the kernel/step benchmarks.
set -u
mkdir -p ~/keep && cp .carry/w1/* ~/keep/
. bench/device/env.sh
nvidia-smi -L; python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
python3 -c "import pydantic; print('pydantic', pydantic.__version__)" || echo "no pydantic"
timeout 200 python3 -m bench.drafting_cost > "$OUT/drafting_cost.log" 2>&1; echo "drafting_cost rc=$?"
tail -14 "$OUT/drafting_cost.log"
timeout 230 python3 -m bench.train_step > "$OUT/train_step.log" 2>&1; echo "train_step rc=$?"
tail -22 "$OUT/train_step.log"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/unit/test_loss.py tests/unit/test_objective.py \
  > "$OUT/gpu_unit.log" 2>&1; echo "gpu unit tests rc=$?"; tail -6 "$OUT/gpu_unit.log"
save
