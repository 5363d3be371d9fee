# Sourced by the scripts that carry .carry/ray (bench/device/prepare_ray.sh), after env.sh (its keep_install): Ray
# (2.58.0, the release paired with vLLM 0.26.0) unpacked into ~/keep/site (once per warm machine) and only the carried needs this image lacks or has too old
# (~/keep/rdeps: runtime, ray[default] for the dashboard and Jobs API, ray[serve], ray[llm]'s jsonref); both put on
# PYTHONPATH, and `ray` / `serve` commands in ~/keep/bin on PATH (the wheel's console scripts are not installed). A
# later call on the same warm machine needs no carry: pip finds everything in ~/keep.
# `ray start` turns token auth on unless RAY_AUTH_MODE is set (pipelines/local_ray.py).
mkdir -p ~/keep/site ~/keep/bin
[ -d ~/keep/site/ray ] || tar -C ~/keep/site -xJf .carry/ray/ray-*-cp312.tar.xz
RDEPS=$(python3 -c "import os, sysconfig; print(sysconfig.get_path('purelib', 'posix_prefix', {'base': os.path.expanduser('~/keep/rdeps'), 'platbase': os.path.expanduser('~/keep/rdeps')}))")
case ":${PYTHONPATH:-}:" in *":$RDEPS:"*) ;; *) export PYTHONPATH=$RDEPS${PYTHONPATH:+:$PYTHONPATH} ;; esac
case ":$PYTHONPATH:" in *":$HOME/keep/site:"*) ;; *) export PYTHONPATH=$HOME/keep/site:$PYTHONPATH ;; esac
keep_install ~/keep/rdeps .carry/ray/wheels click msgpack protobuf jsonschema pydantic aiohttp-cors colorful \
  opencensus-context googleapis-common-protos opentelemetry-sdk opentelemetry-proto opentelemetry-exporter-prometheus \
  smart-open py-spy fastapi starlette 'uvicorn[standard]' grpcio-reflection mmh3 jsonref
# opencensus's own needs (google-api-core, google-auth, cryptography) serve its trace exporters, never imported
python3 -c "import opencensus.stats" 2>/dev/null || python3 -m pip install -q --no-index --no-compile --no-deps \
  --find-links .carry/ray/wheels --prefix ~/keep/rdeps opencensus 2>&1 | grep -v -E "^\[notice\]|is ignored"
PY3=$(command -v python3)
printf '#!/bin/sh\nexec %s -m ray.scripts.scripts "$@"\n' "$PY3" > ~/keep/bin/ray
printf '#!/bin/sh\nexec %s -c "import sys; from ray.serve.scripts import cli; sys.argv[0] = \\"serve\\"; cli()" "$@"\n' \
  "$PY3" > ~/keep/bin/serve
chmod +x ~/keep/bin/ray ~/keep/bin/serve
case ":$PATH:" in *":$HOME/keep/bin:"*) ;; *) export PATH=~/keep/bin:~/keep/rdeps/bin:$PATH ;; esac
export RAY_USAGE_STATS_ENABLED=0
