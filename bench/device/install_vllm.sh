# Sourced with .carry/v3 carried, on a machine where keep_carry.sh kept .carry/v1, .carry/v2 and .carry/v4
# (bench/device/prepare_vllm_carry.sh): CUDA vLLM 0.26.0 unpacked into ~/keep/vllm-site with the carried
# wheels it imports at start (once per warm machine), put on PYTHONPATH; after a fresh install (unless VLLM_CHECK=0)
# bench/device/vllm_check.py prints vLLM's version and generates a few tokens.
. bench/device/env.sh
if [ ! -f ~/keep/vllm-site/vllm/__init__.py ]; then
  t0=$(date +%s); mkdir -p ~/keep/vllm-site
  cat ~/keep/vllm.tar.xz.part0* | xz -d -T0 | tar -C ~/keep/vllm-site -xf - || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target ~/keep/vllm-site \
    .carry/v3/*.whl 2>&1 | grep -v -E "^\[notice\]|WARNING: Target directory" || true
  rm -f ~/keep/vllm.tar.xz.part0*
  echo "vLLM installed in $(( $(date +%s) - t0 )) s"
  CHECK=1
fi
case ":${PYTHONPATH:-}:" in *":$HOME/keep/vllm-site:"*) ;; *) export PYTHONPATH=~/keep/vllm-site${PYTHONPATH:+:$PYTHONPATH} ;; esac
# FlashInfer's sampler JIT-compiles kernels on first use (its cubins are not carried): PyTorch's sampler instead.
# A caller that touched CUDA before the engine (the target conversion) cannot fork its engine core: spawn it.
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_WORKER_MULTIPROC_METHOD=spawn
if [ -n "${CHECK:-}" ] && [ "${VLLM_CHECK:-1}" != 0 ]; then python3 bench/device/vllm_check.py 2>&1 | grep -E "^vllm |^generated|Error" || return 1; fi
unset CHECK
