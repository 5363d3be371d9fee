#!/usr/bin/env bash
# Issue 14 item 5: the product's main job (python -m ray_jobs.pipeline, i.e. `peagle run`) on the lent GPU
# through Ray, with the committed GPU recipe configs/smollm2-135m-gpu.yaml and these overrides only: the
# prompts are the packaged ShareGPT file as carried (~/keep/sharegpt.jsonl.xz, openai_jsonl), NUM_SAMPLES
# conversations, the transformers engine with the static cache (no vLLM here), <= 2 turns of <= 256 tokens,
# 2 epochs. evaluate and serve need vLLM and register MLflow, none of which is on the machine: the pipeline
# says so and runs regenerate, capture and train (Ray Data actors on the GPU, then Ray Train). The run
# directory stays in ~/keep: a second call on the same warm machine resumes (finished stages are skipped).
# Carry .carry/ray (prepare_ray.sh), after `keep_carry.sh .carry/w1` and `. install_target.sh bfloat16` (carry
# .carry/w2) on the same warm machine. Usage: bash bench/device/run_pipeline_ray.sh [NUM_SAMPLES]
set -u
T0=$SECONDS
. bench/device/env.sh
. bench/device/install_ray.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/site .carry/ray/wheels/datasets-*.whl \
  .carry/ray/wheels/dill-*.whl .carry/ray/wheels/multiprocess-*.whl 2>&1 | grep -v "^\[notice\]"
[ -f ~/keep/sharegpt.jsonl ] || xz -dc ~/keep/sharegpt.jsonl.xz > ~/keep/sharegpt.jsonl
RUN=~/keep/runs/device
CONFIG=configs/smollm2-135m-gpu.yaml
SETS=("data.sources=[{kind: openai_jsonl, path: $HOME/keep/sharegpt.jsonl}]" "data.num_samples=${1:-1000}"
  regenerate.backend=transformers regenerate.static_cache=true regenerate.max_tokens_per_turn=256
  regenerate.max_turns=2 training.num_epochs=2 training.warmup_steps=10)
ARGS=(); for s in "${SETS[@]}"; do ARGS+=(--set "$s"); done
set -o pipefail
timeout $((560 - (SECONDS - T0))) python3 -m ray_jobs.pipeline --config $CONFIG --run-dir $RUN "${ARGS[@]}" 2>&1 |
  tee "$OUT/pipeline.log" | grep -v "^\s*$" | tail -40 | cut -c1-400
echo "pipeline rc=$? after $((SECONDS - T0)) s"
python3 - "$RUN" "$CONFIG" "${SETS[@]}" <<'PY'
import json, sys
from pathlib import Path
from bench.common import write_result
from pipelines.recipe import load_recipe
run, config, sets = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
recipe = load_recipe(config, sets)
summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
stages = {p.parent.name: json.loads(p.read_text()) for p in run.glob("*/stage.json")}
import datasets, pandas, pyarrow, ray
versions = {"ray": ray.__version__, "datasets": datasets.__version__, "pyarrow": pyarrow.__version__,
            "pandas": pandas.__version__}
write_result("pipeline_device", {"benchmark": "pipeline_device", "command": "bash bench/device/run_pipeline_ray.sh",
                                 "versions": versions, "overrides": sets, "num_samples": recipe.data.num_samples,
                                 "regenerate_batch_size": recipe.regenerate.batch_size,
                                 "summary": summary, "stage_records": {n: {k: v for k, v in s.items() if k != "outputs"}
                                                                      | {"outputs": {k: v for k, v in s["outputs"].items()
                                                                                     if k not in ("history",)}}
                                                                      for n, s in stages.items()}})
PY
save
