#!/usr/bin/env bash
# Here (CPU box): build .carry/spec for bench/speculators_side.py on the lent GPU (Python 3.12, torch 2.11+cu130,
# transformers 5.17, no registry there): speculators 0.9.0 and the wheels it imports that the device image lacks
# (/work/.library/device/KINDS.md's package list; the image's pyarrow 25.0.1 is in bench/results/pipeline_device.json).
# speculators' metadata also requires torchvision and torchaudio (never imported; the image has 0.26.0 / 2.11.0) and
# pins torch <= 2.14.1, transformers <= 5.19.0, numpy <= 2.5.4, datasets <= 5.1.0: the image's torch, transformers
# and numpy fit, datasets is carried at 5.1.0 (the Ray carry's 5.2.0 is over the pin). No vLLM: the trainer is fed by
# peagle's capture (bench.speculators_data.CaptureTransfer), not by a vLLM server.
#
#   .carry/spec/*.whl   installed there with `pip install --no-index --no-deps --target ~/keep/spec-site`
#                       (bench/device/run_speculators.sh install), pydantic's five only where ~/keep/site has none
#
# Versions are fixed so that a rebuilt carry is the one measured (those of the throwaway venv the CPU checks ran in,
# /tmp/specvenv, 2026-11-25). Pure-Python wheels except pydantic-core, jiter, multiprocess (cp312 manylinux).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .carry/spec && mkdir -p .carry/spec
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any -d .carry/spec "$@" 2>&1 | grep -v "is ignored" || true
}
download speculators==0.9.0 hs-connectors==0.9.0 \
  datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 fsspec==2026.7.0 \
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 \
  idna==3.20 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
want=22; got=$(ls .carry/spec/*.whl | wc -l)
[ "$got" -eq "$want" ] || { echo "only $got of $want wheels downloaded"; ls .carry/spec; exit 1; }
ls -la .carry/spec && du -sh .carry/spec
