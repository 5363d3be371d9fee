#!/usr/bin/env bash
# The main job on the lent several-GPU node as two Ray "nodes" of one host, with a real MLflow server and
# autoscaled GPU Serve replicas (bench/multi_gpu.py, bench/serve_autoscale.py; the product's own commands).
#
#   up [GPUS_PER_NODE]     MLflow server + Ray head "a" (GPUs 0..g-1) + raylet "b" (GPUs g..2g-1), then submit
#                          the job (configs/smollm2-135m-4gpu.yaml with the carried prompt files) and follow it;
#                          NODES=1 up 4: one Ray node of 4 GPUs (GPU Serve replicas on a second raylet of the same
#                          host fail in vLLM's Ray executor: pipelines.serve.shared_host_raylets); with ALSO="CMD
#                          ARGS" that command first takes a GPU of its own (as in `roll`), the job the others;
#                          MODULE=ray_jobs.STAGE submits that stage alone (e.g. regenerate) instead of the pipeline
#   record [NOTE]          (NAME=multi_gpu_pipeline) the job's summary and stage records -> $OUT/r/NAME.json
#   wait [SECONDS]         follow the job (default: until 60 s before the call's end); "job ... SUCCEEDED" when done
#   load [LEVELS [FLAGS]]  the load ramp against the endpoint (bench.serve_autoscale) -> $OUT/r/serve_autoscale.json,
#                          its output -> $OUT/load.log, then what `logs` collects; default 1 -> 32 -> 64 clients,
#                          one replica SIGKILLed at 64 once 4 run, 45 s idle watch; ROLL_AT=C adds `roll`'s roll
#                          ROLL_AFTER_S (30) seconds into level C
#   roll [LEVEL]           a blue/green roll under load: C clients (default 8:360) while the champion's files are
#                          registered as a new champion and the serve stage is submitted alone (it rolls to it)
#                          -> $OUT/r/serve_rollout.json (output: $OUT/roll.log); with ALSO="CMD ARGS" that command
#                          runs beside it as a Ray job holding one GPU (`bench.multi_gpu gpu-run`; $OUT/also.log)
#   stage STAGE NAME [--set ...]  one stage alone on the job's run directory (ray_jobs.STAGE, the job's recipe and
#                          overrides, then these; e.g. `stage train multi_gpu_train_1 --set training.num_workers=1`),
#                          followed to its end and recorded -> $OUT/r/NAME.json
#   nodekill [FLAGS]       a stage alone (default train) while node b's raylet is SIGKILLed and joins again
#                          (bench.node_fault; e.g. --kill-at 40 --down-s 60 --set training.max_steps=150)
#                          -> $OUT/r/multi_gpu_node_fault.json, its output in $OUT/nodekill.log; with `--kill worker
#                          --name multi_gpu_worker_fault` one Ray Train worker of node b instead (the node stays;
#                          on a one-node cluster, NODES=1, add `--node a`: a worker of the head)
#   parts                  issue 42's regeneration across calls and leases (RECIPE, default
#                          configs/smollm2-135m-300k.yaml, its ShareGPT source read from the carried file): the
#                          cluster started if this machine has none, earlier machines' bundles (.carry/regen/*.tar
#                          carried with this call, ~/keep/regen/*.tar kept by earlier calls: `mkdir -p ~/keep/regen
#                          && cp .carry/regen/*/*.tar ~/keep/regen/` carrying .carry/regen/1, then .carry/regen/2
#                          ..., folders of <= 50 MiB) unpacked under the run's
#                          regenerate/, the regenerate stage submitted unless this
#                          machine's last job still runs (a new job resumes from the parts), followed until PACK_S
#                          (90) s before the call's end, then the parts no earlier call returned -> $OUT/parts
#                          (<= 8 bundles of <= 16 MiB: keep them here in a new folder .carry/regen/N for the next
#                          machine)
#   logs                   what a stuck or failed replica left: `ray status`, `serve status`, nvidia-smi's processes
#                          -> $OUT/state.txt; Serve's controller and replica logs, the workers' logs that name vLLM
#                          -> $OUT/logs.tar.xz
#   down                   stop Ray and the MLflow server
#
# Before it, on the same warm machine, one call each (a call carries <= 64 MiB with the ~11 MB tree; 2026-11-28):
# (1) `keep_carry.sh .carry/v1`, (2) `keep_carry.sh .carry/v2`, (3) `keep_carry.sh .carry/w1 .carry/v4` carrying
# .carry/w1/part00, .carry/w1/humaneval.jsonl.xz and .carry/v4, (4) `keep_carry.sh .carry/w1 .carry/w3;
# . bench/device/env.sh; . bench/device/install_mlflow.sh` carrying .carry/w1/sharegpt.jsonl.xz, .carry/w3 and
# .carry/mlflow, (5) `. bench/device/install_target.sh bfloat16` (carry .carry/w2), (6) `VLLM_CHECK=0
# . bench/device/install_vllm.sh` (carry .carry/v3); then (7) `GIT_SHA=... bash bench/device/run_multi_gpu.sh up`
# (carry .carry/ray), `wait` until it says SUCCEEDED, `record`, `load`, `roll`. GIT_SHA names the commit (the
# device's checkout copy has no .git).
set -u
T0=$SECONDS
CALL_S=${CALL_S:-600}  # the device call's limit (the run's timeout_s): every step's waits end before it
left() { echo $((CALL_S - $1 - (SECONDS - T0))); }  # seconds to the call's end less $1
STEP=${1:?usage: run_multi_gpu.sh up|wait|record|load|roll|stage|nodekill|parts|logs|down}
shift
. bench/device/env.sh
. bench/device/install_ray.sh
. bench/device/install_mlflow.sh
. bench/device/install_vllm.sh > /dev/null || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep multicast off
python3 -c "import datasets" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile --target \
  ~/keep/site .carry/ray/wheels/datasets-*.whl .carry/ray/wheels/dill-*.whl .carry/ray/wheels/multiprocess-*.whl
for f in sharegpt humaneval; do [ -f ~/keep/$f.jsonl ] || xz -dc ~/keep/$f.jsonl.xz > ~/keep/$f.jsonl; done
RUN=${RUN:-~/keep/peagle/runs/smollm2-135m-4gpu}  # the run directory of `record` and `stage` (another recipe: its name)
TEMP=/tmp/peagle-ray
M="python3 -m bench.multi_gpu --temp-dir $TEMP"
cluster_env() {  # the ray CLI's address and token, and GCS: the cluster's GCS address (clients of its Serve)
  eval "$(python3 -m pipelines.local_ray env --temp-dir $TEMP)"
  GCS=$(python3 -c "import json; print(json.load(open('$TEMP/multi_gpu.json'))['gcs_address'])")
}
# the roll: the champion's files registered as a new champion, then the serve stage alone (it rolls the gateway)
ROLL_CMD="$M new-champion --run-dir $RUN && $M submit --module ray_jobs.serve --id roll-\$(date +%s) --git-sha \
${GIT_SHA:-unknown} && $M wait --timeout-s 400"
also() {  # ALSO="CMD ARGS": a one-GPU command as a Ray job holding a GPU nothing else may take, in the background
  [ -n "${ALSO:-}" ] || return 0
  $M gpu-run --timeout-s $(left 40) -- $ALSO > "$OUT/also.log" 2>&1 &
  sleep 5
}
logs() {  # what a stuck or failed replica left -> $OUT/state.txt, $OUT/logs.tar.xz
  cluster_env
  { ray status --address "$GCS"; serve status; nvidia-smi; } > "$OUT/state.txt" 2>&1
  # every node's logs: the head's under $TEMP/session_latest, a joined raylet's under $TEMP/node-NAME/session_*
  local ERRS
  ERRS=$(cd "$TEMP" && ls -t session_latest/logs/worker-*.[eo]?? node-*/session_*/logs/worker-*.[eo]?? 2>/dev/null |
    head -400 | xargs -r grep -l -i "vllm\|LLMServer\|EngineCore" | head -60)  # the newest first
  tar -C "$TEMP" -cJf "$OUT/logs.tar.xz" session_latest/logs/serve $ERRS
}
case "$STEP" in
  up)
    G=${1:-2}
    nvidia-smi -L
    setsid -w $M up --nodes "${NODES:-2}" --gpus-per-node "$G" --cpus-per-node 24 \
      || exit 1
    also  # before the job: the command's GPU is taken first (the job's recipe must then leave one GPU free)
    $M submit --config configs/smollm2-135m-4gpu.yaml --id peagle-4gpu --module "${MODULE:-ray_jobs.pipeline}" \
      --git-sha "${GIT_SHA:-unknown}" \
      --set "data.sources=[{kind: openai_jsonl, path: $HOME/keep/sharegpt.jsonl}]" \
      --set "evaluation.sources=[{kind: openai_jsonl, path: $HOME/keep/humaneval.jsonl}]" "${@:2}" || exit 1
    $M wait --timeout-s $(left 40)
    [ -f "$OUT/also.log" ] && tail -30 "$OUT/also.log"
    ;;
  wait)
    $M wait --timeout-s "${1:-$(left 60)}"
    ;;
  record)
    $M record --run-dir $RUN --name "${NAME:-multi_gpu_pipeline}" --note "${1:-}" && save
    ls -la "$OUT/r"
    ;;
  load|roll)
    cluster_env
    if [ "$STEP" = load ]; then
      ARGS=(--levels "${1:-1:20,32:150,64:120}" --idle-s 45 --kill-replica-at 64 "${@:2}")
      # ROLL_AT=C: the blue/green roll of `roll` during level C of this ramp (one call for both)
      [ -n "${ROLL_AT:-}" ] && ARGS+=(--roll-at "$ROLL_AT" --roll-cmd "$ROLL_CMD" --roll-after-s "${ROLL_AFTER_S:-30}")
    else
      L=${1:-8:360}
      ARGS=(--levels "$L" --idle-s 5 --name serve_rollout --roll-at "${L%%:*}" --roll-cmd "$ROLL_CMD" "${@:2}")
      also
    fi
    RAY_ADDRESS=$GCS timeout $(left 30) python3 -m bench.serve_autoscale --url http://127.0.0.1:8000 \
      --model smollm2-135m-instruct --max-replicas 4 "${ARGS[@]}" > "$OUT/$STEP.log" 2>&1
    tail -40 "$OUT/$STEP.log"
    [ "$STEP" = load ] && logs
    wait
    [ -f "$OUT/also.log" ] && tail -30 "$OUT/also.log"
    save
    ;;
  stage)
    S=${1:?stage}; NAME=${2:?result name}; shift 2
    $M submit --module "ray_jobs.$S" --id "$S-$(date +%s)" --git-sha "${GIT_SHA:-unknown}" "$@" || exit 1
    $M wait --timeout-s $(left 60) > "$OUT/$NAME.log" 2>&1; RC=$?
    tail -25 "$OUT/$NAME.log"
    [ $RC = 3 ] && echo "still running at the call's end: the next call \`wait\` then \`NAME=$NAME record\`"
    [ $RC = 0 ] && $M record --run-dir $RUN --name "$NAME" --note "ray_jobs.$S $*" && save
    ;;
  nodekill)
    python3 -m bench.node_fault --temp-dir $TEMP --git-sha "${GIT_SHA:-unknown}" --timeout-s ${TIMEOUT_S:-$(left 40)} \
      --name multi_gpu_node_fault "$@" > "$OUT/nodekill.log" 2>&1
    grep -v "^\s" "$OUT/nodekill.log" | tail -30
    save
    ;;
  parts)
    RECIPE=${RECIPE:-configs/smollm2-135m-300k.yaml}
    REGEN=$(python3 -c "from pipelines import settings; from pipelines.recipe import load_recipe
print(settings.run_dir(load_recipe('$RECIPE').name) / 'regenerate')") || exit 1
    if [ ! -f $TEMP/multi_gpu.json ]; then
      nvidia-smi -L
      setsid -w $M up --nodes "${NODES:-2}" --gpus-per-node "${GPUS_PER_NODE:-2}" --cpus-per-node 24 || exit 1
    fi
    BUNDLES=$(ls .carry/regen/*.tar .carry/regen/*/*.tar ~/keep/regen/*.tar 2> /dev/null)  # this call's, earlier calls' kept ones
    if [ -n "$BUNDLES" ]; then
      python3 -m bench.parts_carry unpack $BUNDLES --regenerate-dir "$REGEN" --sent ~/keep/parts_sent.txt || exit 1
    fi
    $M wait --timeout-s 0 > /dev/null 2>&1; RC=$?  # 3: this machine's last job still runs
    if [ $RC != 3 ]; then
      $M submit --config "$RECIPE" --module ray_jobs.regenerate --id "regenerate-$(date +%s)" \
        --git-sha "${GIT_SHA:-unknown}" --set data.sources.0.kind=openai_jsonl \
        --set "data.sources.0.path=$HOME/keep/sharegpt.jsonl" "$@" || exit 1
    fi
    $M wait --timeout-s $(left "${PACK_S:-90}"); RC=$?
    python3 -m bench.parts_carry pack --regenerate-dir "$REGEN" "$OUT/parts" --sent ~/keep/parts_sent.txt
    ls -la "$OUT/parts"; du -sh "$REGEN"
    [ $RC = 0 ] && echo "regenerate SUCCEEDED: every part is written"
    ;;
  logs)
    logs
    tail -60 "$OUT/state.txt"; ls -la "$OUT"
    ;;
  down)
    $M down
    ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
echo "run_multi_gpu.sh $STEP: $((SECONDS - T0)) s"
