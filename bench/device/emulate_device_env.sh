#!/usr/bin/env bash
# Here (CPU box) only: a rehearsal of the device image and of our carries, for import and startup checks before a
# lease. Not a device script: it builds a Python 3.12 venv shaped like the image's python3 (the packages of
# .library/device/KINDS.md that Ray, vLLM, MLflow and peagle import, at the image's versions where a device run
# recorded them: torch 2.11.0, transformers 5.17.0, numpy 2.5.2, pandas 3.0.6, pyarrow 25.0.1, ...; the others at
# the project venv's), then installs everything else only from the carries, with the device's own install scripts,
# under a fake $HOME (its ~/keep) and $OUT.
#
#   bash bench/device/emulate_device_env.sh base      # the image: /tmp/devenv (torch from PyPI: the same CUDA
#                                                     # build as the device's, it imports without a GPU; ~4 GB)
#   bash bench/device/emulate_device_env.sh carries   # ~/keep from .carry/ray, .carry/mlflow, vLLM (unpacked tree
#                                                     # of prepare_vllm_carry.sh) + .carry/v3, as the device would
#   bash bench/device/emulate_device_env.sh check     # the import/startup checks (ray serve/llm, dashboard + Jobs
#                                                     # API, a second raylet, mlflow server + client)
#   bash bench/device/emulate_device_env.sh shell CMD # CMD in the emulated env (PYTHONPATH as the scripts set it)
#
# Needs the carries built first: prepare_ray.sh, prepare_mlflow_carry.sh, prepare_vllm_carry.sh (`v3` alone will
# do where its unpacked vLLM, VLLM_TREE below, is still there). Differences from the device: Python 3.12.1 (there 3.12.3), no GPU, and the image's other
# packages (jax, onnx, lightning, ...) are not installed.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
REPO=$PWD
VENV=${DEVENV:-/tmp/devenv}
PY312=${PY312:-$HOME/.pyenv/versions/3.12.1/bin/python}
FAKE_HOME=${DEVHOME:-/tmp/devhome}                      # the device's $HOME (~/keep lives there)
VLLM_TREE=${VLLM_TREE:-/tmp/peagle-vllm/tree}           # prepare_vllm_carry.sh's unpacked, trimmed wheel

# The image's packages that matter here. Versions: KINDS.md's pip list and our device records (bench/results:
# pipeline_device.json) where known, else those of the project venv (constraints.txt) of 2026-11.
IMAGE_PACKAGES=(
  torch==2.11.0 torchvision==0.26.0 triton==3.6.0
  numpy==2.5.2 pandas==3.0.6 pyarrow==25.0.1 scipy==1.17.1 scikit-learn==1.9.1 matplotlib==3.11.2
  transformers==5.17.0 tokenizers==0.23.2 huggingface-hub==1.33.0 safetensors==0.8.0 accelerate==1.15.0
  tiktoken==0.14.0 sentencepiece==0.2.2 regex==2026.11.15 numba einops==0.8.2 py-cpuinfo==9.0.0
  nvidia-ml-py opencv-python-headless==5.0.0.93 pillow==13.0.0
  aiohttp==3.14.5 aiosignal==1.4.0 aiohappyeyeballs==2.7.1 frozenlist==1.8.0 multidict==6.7.1 yarl==1.25.1
  propcache==0.5.4 attrs==26.1.0 grpcio==1.85.1 protobuf==7.36.2 prometheus-client==0.26.0
  requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.18 charset-normalizer==3.5.2
  pyyaml==6.0.3 psutil==7.2.2 rich==15.0.0 typer==0.28.0 click==8.5.1 msgpack==1.2.4 cloudpickle==3.1.2
  filelock==4.2.11 fsspec==2026.9.0 packaging==26.3 jinja2==3.1.6 markupsafe==3.0.4 werkzeug==3.1.9
  httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 uvloop==0.23.0 tqdm==4.70.1
  typing-extensions==4.16.0 python-dateutil==2.9.0.post0 six==1.17.0 pygments==2.21.0 markdown-it-py==4.3.0
  mdurl==0.1.2 shellingham==1.5.4 markdown xxhash==4.1.0 wrapt==2.5.2 zipp==4.1.2 joblib==1.6.0
  threadpoolctl==3.8.0 hf-xet==1.8.0 annotated-doc==0.0.7 aiofiles tabulate colorama simplejson
  sortedcontainers ninja pybind11 meson
)

device_env() {  # what a device call's shell has: python3 = the image's, $HOME, $OUT
  export PATH=$VENV/bin:$PATH HOME=$FAKE_HOME OUT=$FAKE_HOME/out
  mkdir -p "$OUT" "$HOME/keep"
}

case "${1:-}" in
base)
  [ -x "$VENV/bin/python" ] || "$PY312" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip==26.3
  # no global constraints here beyond the box's (torch <= 2.14.1): the pins above are the image
  "$VENV/bin/python" -m pip install -q "${IMAGE_PACKAGES[@]}" 2>&1 | grep -v "is ignored" || true
  ln -sf python "$VENV/bin/python3"
  # the image has no pydantic (typer 0.28, the newest without it): what needs it must get it from a carry
  "$VENV/bin/python" -c "import torch, transformers, pandas, pyarrow, grpc, aiohttp" || exit 1
  if "$VENV/bin/python" -c "import pydantic" 2>/dev/null; then echo "pydantic in the image venv"; exit 1; fi
  "$VENV/bin/python" -m pip list --format=freeze > "$VENV/image-freeze.txt"
  echo "image: $(wc -l < "$VENV/image-freeze.txt") packages in $VENV"
  ;;
carries)
  device_env
  rm -rf "$HOME/keep" && mkdir -p "$HOME/keep"
  for c in .carry/ray .carry/mlflow .carry/v3 "$VLLM_TREE/vllm"; do [ -d "$c" ] || { echo "missing $c"; exit 1; }; done
  # one version of each package across the carries (the same package in two carries: the same wheel)
  python3 - .carry/ray/wheels .carry/mlflow/wheels .carry/v3 <<'PY' || exit 1
import collections, pathlib, re, sys
seen = collections.defaultdict(set)
for d in sys.argv[1:]:
    for w in pathlib.Path(d).glob("*.whl"):
        name, version = w.name.split("-")[:2]
        seen[re.sub(r"[-_.]+", "-", name).lower()].add(version)
clash = {n: sorted(v) for n, v in seen.items() if len(v) > 1}
print("carried packages:", len(seen), "with two versions:", clash or "none")
sys.exit(1 if clash else 0)
PY
  # install_vllm.sh unpacks ~/keep/vllm.tar.xz.part0* (kept by keep_carry.sh); here the same tree, unpacked,
  # then the same pip call, so that sourcing install_vllm.sh finds vLLM installed (its GPU check is not run)
  mkdir -p "$HOME/keep/vllm-site" && cp -a "$VLLM_TREE"/. "$HOME/keep/vllm-site/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$HOME/keep/vllm-site" \
    .carry/v3/*.whl 2>&1 | grep -v -E "^\[notice\]|WARNING: Target directory" || true
  bash -c '. bench/device/env.sh && . bench/device/install_ray.sh && . bench/device/install_mlflow.sh &&
    . bench/device/install_vllm.sh && echo "PYTHONPATH=$PYTHONPATH"'
  du -sh "$HOME/keep"/*
  ;;
shell)
  shift; device_env
  set +e +o pipefail  # as the device scripts run them (set -u at most): a quiet pip | grep -v is no failure
  . bench/device/env.sh; . bench/device/install_ray.sh; . bench/device/install_mlflow.sh; . bench/device/install_vllm.sh
  eval "$@"
  ;;
check)
  exec bash "$0" shell "bash $REPO/bench/device/emulate_checks.sh"
  ;;
*) sed -n '2,20p' "$0"; exit 2 ;;
esac
