#!/usr/bin/env bash
# Here (CPU box): build the three carries of CUDA vLLM 0.26.0 for the lent GPU (Python 3.12, torch 2.11+cu130,
# no registry there). vLLM 0.26.0 is the newest release pinned to torch 2.11.0; its PyPI wheel is a CUDA 13.0
# build with parallel drafting. install_vllm.sh installs them there.
#
#   .carry/v1/vllm.tar.xz.part00, .carry/v2/vllm.tar.xz.part01, .carry/v4/vllm.tar.xz.part02
#       the wheel unpacked minus what a Hopper GPU and peagle never load: FlashAttention-2's kernels
#       (vllm_flash_attn/_vllm_fa2_C, 305 MB; FA3 serves Hopper), the vllm-rs binary, DeepGEMM's and
#       fmha_sm100's C++ headers (JIT sources for FP8 / Blackwell kernels) and DeepGEMM's builds for other
#       Pythons; tar | xz -9e (317 MB -> ~111 MB), cut at 56 MB so a carry leaves room for the ~8 MB tree
#   .carry/v3/*.whl
#       what vLLM imports at start that the image lacks (API server, tokenizer/structured-output backends,
#       engine-core imports); versions fixed so a rebuilt carry is the one measured; those .carry/ray and
#       .carry/mlflow carry too are at the same versions (pydantic 2.14.4, fastapi, starlette, uvicorn,
#       jsonschema, dill; cachetools 7.3.2: MLflow wants < 8, vLLM any). The OpenAI server a Serve LLM replica
#       imports also needs python-multipart (Ray's ingress declares a form route) and
#       model-hosting-container-standards (+ jmespath, supervisor): vllm.entrypoints.openai.api_server imports its
#       SageMaker router at module level (missing, the first GPU replica failed to start on 2026-11-27)
#
#   bash bench/device/prepare_vllm_carry.sh        # all three
#   bash bench/device/prepare_vllm_carry.sh v3     # .carry/v3 only (v1, v2 and /tmp/peagle-vllm untouched)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VLLM_VERSION=0.26.0
W=/tmp/peagle-vllm
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    --platform manylinux_2_35_x86_64 --platform any "$@" 2>&1 | grep -v "is ignored" || true
}
rm -rf .carry/v3 && mkdir -p .carry/v3
if [ "${1:-}" != v3 ]; then
  rm -rf "$W/tree" .carry/v1 .carry/v2 .carry/v4 && mkdir -p "$W/tree" .carry/v1 .carry/v2 .carry/v4
  [ -f "$W/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl" ] || download -d "$W" "vllm==$VLLM_VERSION"
  unzip -q "$W/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl" -d "$W/tree"
  rm -rf "$W/tree/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$W/tree/vllm/vllm-rs" \
    "$W/tree/vllm/third_party/deep_gemm/include" "$W/tree/vllm/third_party/fmha_sm100/cutlass"
  find "$W/tree/vllm/third_party/deep_gemm" -name '_C.cpython-3*.so' ! -name '*cpython-312*' -delete
  tar -C "$W/tree" -cf - . | xz -T2 -9e > "$W/vllm.tar.xz"
  # <= 50 MB a part: a call carries <= 64 MiB with the ~11 MB working tree (parts of 56 MB stopped fitting on
  # 2026-11-28); the third part (~11 MB) rides with another carry (bench/device/README.md, the setup calls)
  split -b 50000000 -d "$W/vllm.tar.xz" "$W/vllm.tar.xz.part"
  mv "$W/vllm.tar.xz.part00" .carry/v1/ && mv "$W/vllm.tar.xz.part01" .carry/v2/
  mv "$W"/vllm.tar.xz.part0[2-9] .carry/v4/
fi
download -d .carry/v3 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 cachetools==7.3.2 blake3==1.0.11 setproctitle==1.3.8 \
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  openai-harmony==0.0.8 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 ijson==3.6.0 \
  fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 watchfiles==1.3.0 python-json-logger==4.2.0 \
  prometheus-fastapi-instrumentator==8.1.0 loguru==0.7.3 depyf==0.20.0 astor==0.8.1 dill==0.4.1 \
  llguidance==1.7.6 xgrammar==0.2.6 outlines-core==0.2.14 lm-format-enforcer==0.11.3 interegular==0.3.3 \
  lark==1.2.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  compressed-tensors==0.17.0 nvtx==0.2.15 flashinfer-python==0.6.14 apache-tvm-ffi==0.1.10 \
  cuda-tile==1.4.0 nvidia-cudnn-frontend==1.22.0 python-multipart==0.0.34 \
  model-hosting-container-standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0
ls -la .carry/v* && du -sh .carry/v*
