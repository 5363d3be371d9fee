#!/usr/bin/env bash
# Here (CPU box): build .carry/ray for run_ddp_scaling.sh and run_pipeline_ray.sh, so that the device's Python 3.12 can import
# ray, ray.train and ray.train.torch (Ray 2.60, the version of the project's venv).
#
#   .carry/ray/ray-2.60.0-cp312.tar.xz  the cp312 manylinux wheel, unpacked, minus ray/jars (Java
#                                       workers), ray/rllib and the dashboard's web build (ray.init
#                                       runs with include_dashboard=False), ELF files stripped of
#                                       their symbol tables (strip --strip-unneeded keeps the
#                                       dynamic symbols the loader needs)
#   .carry/ray/wheels/*.whl             ray's runtime needs the device image lacks or may lack:
#                                       jsonschema (+ referencing, rpds-py, attrs, specifications),
#                                       pydantic (+ core, annotated-types, typing-inspection,
#                                       typing-extensions; ray.train V2 imports it), click, msgpack,
#                                       protobuf. install_ray.sh lets pip install only the missing ones.
#                                       datasets, dill, multiprocess: the pipeline's prompt loading
#                                       (run_pipeline_ray.sh).
#
# Not carried: pandas and pyarrow (ray.train imports both; pyarrow alone is a 55 MB wheel). The
# device image lists both (.library/device/KINDS.md, read 2026-11-17); run_ddp_scaling.sh checks first and
# falls back to plain torch DDP if `import ray.train` fails there.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
W=/tmp/peagle-ray
rm -rf "$W" .carry/ray && mkdir -p "$W/tree" .carry/ray/wheels
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform any "$@" 2>&1 | grep -v "is ignored" || true
}
download -d "$W" ray==2.60.0
unzip -q "$W"/ray-2.60.0-cp312-*.whl -d "$W/tree"
rm -rf "$W/tree/ray/jars" "$W/tree/ray/rllib" "$W/tree/ray/dashboard/client/build"
find "$W/tree" -type f \( -name '*.so' -o -name '*.so.*' -o -perm -u+x \) -size +1M -print0 |
  while IFS= read -r -d '' f; do
    if file -b "$f" | grep -q '^ELF'; then strip --strip-unneeded "$f"; fi
  done
tar -C "$W/tree" -cf - . | xz -T2 -6 > .carry/ray/ray-2.60.0-cp312.tar.xz
download -d .carry/ray/wheels click==8.5.1 msgpack==1.2.4 protobuf==7.36.2 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0 \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0
# the pipeline's own needs the image lacks (run_pipeline_ray.sh installs them with --no-deps)
download -d .carry/ray/wheels datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls -la .carry/ray .carry/ray/wheels
du -sh .carry/ray
