#!/usr/bin/env bash
# The data-scaling table of issue 14 (bench.scale), one step per call, state in ~/keep (a machine idle for ~30 s goes
# back with it: every call returns what a new machine needs to continue):
#   prompts NUM [FLAGS]        carry .carry/w2 after `keep_carry.sh .carry/w1 .carry/w3`: installs SmolLM2 (bf16) and datasketch;
#                              the target writes NUM self-instruct prompts -> selfinstruct.jsonl.xz (returned);
#                              FLAGS go to bench.scale prompts (`--engine vllm --max-num-seqs 1024` after install_vllm.sh)
#   regenerate SIZE BUDGET_S [FLAGS]   no carry, or .carry/scale-data (returned files) on a new machine after
#                              `. install_target.sh bfloat16`: the next chunks for BUDGET_S seconds; this call's chunks
#                              come back as chunks-<time>.tar.partNN (keep them all in .carry/scale-data); FLAGS go to
#                              bench.scale regenerate (e.g. --engine vllm --max-model-len 8192 --max-turns 4); PROCS=N
#                              runs N engines on the GPU, each its share of the chunks (--shard i/N)
#   restore                    after `. install_target.sh bfloat16` in the same call (carry .carry/w2): the set into
#                              ~/keep/regen from .carry/scale-data when carried (returned chunk tars or
#                              regenerated.jsonl.xz.part*), else the committed bench/data/scale
#   train METHOD SIZE TRAIN_S [BOX_S [bench.scale train flags...]]   after restore: one head for TRAIN_S GPU
#                              seconds in total, this call stopping at a checkpoint after BOX_S post-warm-up seconds;
#                              repeat until it returns head-<tag>.tar.part* and scale_train_<tag>.json (then here:
#                              python -m bench.scale record DIR/scale_train_<tag>.json --data-build N)
#                              e.g. train peagle 29905 600 380 --variant 600s; train peagle 29905 150 --variant lr12e-4
#                              --set training.lr=1.2e-3; a repeat of a recipe: ... --run 2
#                              No carry on the same warm machine. A call that stops at a checkpoint also returns it,
#                              compact (bench.scale_train.DEFAULT_FORM; bench/results/resume_state.json), as
#                              ckpt-<name>.tar.partNN beside r/scale_train_<name>.json: keep them all in .carry/scale-ckpt.
#                              Parts over one call's return (8 files, 64 MiB together; a P-EAGLE checkpoint is
#                              ~80 MiB) stay in ~/keep/return-rest: the next call, at once, is `run_scale.sh rest`.
#                              A new machine (the last one went back) resumes from them, sample-exactly:
#                                keep_carry.sh .carry/w1; `. install_target.sh bfloat16; run_scale.sh restore` (carry
#                                .carry/w2); then the same train call with carry .carry/scale-ckpt. More than 3 parts
#                                (P-EAGLE: 6) are more than one carry: parts 00-02 go first in .carry/scale-ckpt-a with
#                                `keep_carry.sh .carry/scale-ckpt-a`, the rest and the json in .carry/scale-ckpt.
#   detach train METHOD SIZE TRAIN_S BOX_S [flags...]   the same training in its own process session, running on
#                              past the call (one start per machine: BOX_S up to what the machine has left)
#   wait [SECONDS]             follow the detached run; at its end return what `train` returns (then `rest`)
#   return NAME                the latest checkpoint of run NAME in ~/keep returned as a stopped call returns it, without
#                              training (a train call that ran into its timeout past a checkpoint); then `rest`
#   rest                       the next share of the parts the last call held back (repeat while it says more)
# Usage: bash bench/device/run_scale.sh STEP [ARGS...]
set -u
STEP=${1:-}; shift
# every chunks-*.tar.part* returned by earlier regenerate calls and carried in .carry/scale-data -> ~/keep/regen
untar_chunks() {
  mkdir -p ~/keep/regen
  for t in $(ls .carry/scale-data/chunks-*.tar.part00 2>/dev/null); do cat "${t%.part00}".part* | tar -C ~/keep/regen -xf -; done
}
# the training log's step lines (stdin) as step, loss, accuracy per depth, tokens/s
steps() {
  python3 -c "
import json, sys
for l in sys.stdin:
    m = json.loads(l); print(int(m['step']), round(m['loss'], 3), 'acc', [round(m.get(f'acc_d{i}', 0), 3) for i in range(8)], round(m.get('tokens_per_s', 0)))"
}
case "$STEP" in
  prompts)
    . bench/device/install_target.sh bfloat16
    [ -f ~/keep/vllm-site/vllm/__init__.py ] && . bench/device/install_vllm.sh  # for --engine vllm
    python3 -m pip install -q --no-index --no-deps --target ~/keep/site .carry/w2/datasketch-*.whl
    timeout 540 python3 -m bench.scale prompts --num "${1:-34000}" "${@:2}" 2>&1 | grep -v "Loading\|clean_up" | tail -2 | cut -c1-800
    cp ~/keep/selfinstruct.jsonl.xz "$OUT/"  # returned: a lost machine does not cost the prompts again
    save ;;
  regenerate)
    . bench/device/env.sh
    [ -f ~/keep/vllm-site/vllm/__init__.py ] && . bench/device/install_vllm.sh  # for --engine vllm
    mkdir -p ~/keep/regen
    if [ -d .carry/scale-data ]; then  # a new machine: the prompts and every chunk returned so far
      cp -n .carry/scale-data/*.jsonl.xz ~/keep/ 2>/dev/null; mv -n ~/keep/chunk-*.jsonl.xz ~/keep/regen/ 2>/dev/null
      untar_chunks
    fi
    touch "$OUT/.start"
    # PROCS=N engines share the GPU (--shard i/N; each a fixed 60/N GiB KV cache, 0.85/N of the memory and its own
    # compile cache: vLLM's memory profile would count the other engines' memory): a 135M target's step is
    # overhead-bound, so one engine may leave the GPU idle; nvidia-smi samples how busy it was (engine start included)
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -l 5 > ~/keep/gpu_util.csv &
    SMI=$!
    P=${PROCS:-1}; PIDS=()
    for i in $(seq 0 $((P - 1))); do
      VLLM_CACHE_ROOT=~/.cache/vllm-shard$i timeout 570 python3 -m bench.scale regenerate --size "${1:-30000}" --budget-s "${2:-420}" --shard "$i/$P" \
        $([ "$P" -gt 1 ] && echo --kv-cache-gib $((60 / P)) --gpu-memory-utilization 0.$((85 / P))) "${@:3}" 2>&1 | grep "^chunk\|^{" | cut -c1-600 &
      PIDS+=($!)
    done
    wait "${PIDS[@]}"
    kill $SMI
    awk -F', ' '{u += $1; n++; if ($2 > m) m = $2} END {printf "GPU busy %.0f%% on average over %d samples, peak %d MiB\n", u / n, n, m}' ~/keep/gpu_util.csv
    # this call's chunks come back as one tar in parts < 16 MiB (a call returns at most 8 files)
    NEW=$(cd ~/keep/regen && find . -name "chunk-*" -newer "$OUT/.start" | sort)
    [ -n "$NEW" ] && (cd ~/keep/regen && tar -cf - $NEW) | split -b 15M -d - "$OUT/chunks-$(date +%s).tar.part"
    rm -f "$OUT/.start"
    save ;;
  restore)
    . bench/device/env.sh
    if ls .carry/scale-data/chunks-*.tar.part00 >/dev/null 2>&1; then
      untar_chunks
      echo "$(ls ~/keep/regen | wc -l) chunks restored from .carry/scale-data"
    else
      python3 -m bench.scale unpack-data "$( [ -d .carry/scale-data ] && echo .carry/scale-data || echo bench/data/scale )"
    fi ;;
  train)
    . bench/device/env.sh
    FROM=(--from-parts ~/keep); [ -d .carry/scale-ckpt ] && FROM+=(--from-parts .carry/scale-ckpt)  # a new machine
    timeout 580 python3 -m bench.scale train --method "$1" --size "$2" --train-s "$3" --box-s "${4:-420}" --out "$OUT" \
      "${FROM[@]}" "${@:5}" > "$OUT/train.log" 2>&1
    echo "rc=$?"; grep -v Loading "$OUT/train.log" | grep -v '^{"step"' | tail -4 | cut -c1-1200
    grep '^{"step"' "$OUT/train.log" | steps
    rm -f "$OUT/train.log"
    save ;;
  detach)  # train METHOD SIZE TRAIN_S BOX_S [flags...]: the same train, in its own process session (setsid), so it runs
           # on past this call until it ends or the machine goes back; follow it with `wait`. The call's overhead (99k:
           # ~250-320 s of tokenizing, planning, loading and compiling) is then paid once per machine, and BOX_S is
           # what this machine has left (30 minutes held, less setup and ~5 minutes of overhead), not the 580 s of a call.
           # It runs from a copy of the tree in ~/keep/src (later calls replace the checkout) and resumes from the
           # parts carried in .carry/scale-ckpt, copied to ~/keep/from-parts first.
    [ "${1:-}" = train ] || { echo "usage: run_scale.sh detach train METHOD SIZE TRAIN_S BOX_S [flags...]"; exit 2; }
    shift
    . bench/device/env.sh
    D=~/keep/detached; [ -f $D/pid ] && kill -0 "$(cat $D/pid)" 2>/dev/null && { echo "a detached run is on"; exit 1; }
    rm -rf $D ~/keep/src ~/keep/from-parts; mkdir -p $D/out ~/keep/src ~/keep/from-parts
    tar --exclude=./.carry --exclude=./.git --exclude=./outputs -cf - . | tar -C ~/keep/src -xf -
    [ -d .carry/scale-ckpt ] && cp .carry/scale-ckpt/* ~/keep/from-parts/
    # the session leader writes its own pid (setsid forks when its caller leads a process group); the subshell's own
    # output goes to the log too: one left on this call's stdout kept a caller's pipe open until the run ended
    (cd ~/keep/src && exec setsid bash -c 'echo $$ > "$0/pid"; exec python3 -m bench.scale train "$@"' $D --method "$1" \
      --size "$2" --train-s "$3" --box-s "$4" --out $D/out --from-parts ~/keep --from-parts ~/keep/from-parts "${@:5}") \
      > $D/train.log 2>&1 < /dev/null &
    sleep "${DETACH_SLEEP:-20}"; tail -3 $D/train.log | cut -c1-600; echo "detached run pid $(cat $D/pid)" ;;
  wait)  # [SECONDS]: follow the detached run for SECONDS (default 540) or until it ends; every call prints its progress
         # (one line per 100 steps) and, once it has ended, returns what it made (`train`'s files: the head, or the
         # checkpoint's first parts: then `rest` at once) and its record. Calls back to back: 30 s idle loses the machine.
    . bench/device/env.sh
    D=~/keep/detached; PID=$(cat $D/pid 2>/dev/null) || { echo "no detached run"; exit 1; }
    END=$((SECONDS + ${1:-540}))
    while kill -0 "$PID" 2>/dev/null && [ $SECONDS -lt $END ]; do sleep 5; done
    grep '^{"step"' $D/train.log | tail -"${WAIT_LINES:-12}" | steps
    if kill -0 "$PID" 2>/dev/null; then echo "running"; else
      echo "ended"; grep -v Loading $D/train.log | grep -v '^{"step"' | tail -6 | cut -c1-1500
      mv $D/out/* "$OUT/" 2>/dev/null; find ~/keep -maxdepth 1 -name 'scale_train_*.json' -newer $D/pid -exec cp {} "$OUT/r/" \;
      ls "$OUT" "$OUT/r"
    fi ;;
  return)  # NAME (e.g. peagle-99k-600s-run2): its latest checkpoint in ~/keep, packed without training (after a
           # train call that ran into its timeout past a checkpoint); then `rest` at once
    . bench/device/env.sh
    python3 -c "
import sys; from pathlib import Path; from bench.scale_train import hold_back, return_checkpoint
k = Path.home() / 'keep'; print(len(hold_back(return_checkpoint(k / f'ckpt-{sys.argv[1]}', Path(sys.argv[2]), sys.argv[1]), k)), 'parts held back')" "$1" "$OUT"
    ls "$OUT" ;;
  rest)  # the next call's share of the parts the last train/return call held back (one call: 8 files, 64 MiB)
    D=$(ls ~/keep/return-rest 2>/dev/null | sort -n | head -1)
    [ -n "$D" ] || { echo "nothing held back in ~/keep/return-rest"; exit 1; }
    mv ~/keep/return-rest/"$D"/* "$OUT/" && rmdir ~/keep/return-rest/"$D" && ls "$OUT"
    echo "$(ls ~/keep/return-rest | wc -l) more rest call(s)" ;;
  *) echo "usage: bash bench/device/run_scale.sh prompts NUM | regenerate SIZE BUDGET_S | restore | train METHOD SIZE TRAIN_S [BOX_S [flags...]] | detach train ... | wait [SECONDS] | return NAME | rest"; exit 2 ;;
esac
