#!/usr/bin/env bash
# Here (CPU box): build .carry/mlflow, MLflow 3.17.2 (constraints.txt) for the device's Python 3.12, so that
# `mlflow server` (SQLite backend store, local artifact root) and the pipeline's MLflow client (register stage,
# pipelines/registry) run there. install_mlflow.sh installs it; emulate_device_env.sh rehearses it here.
#
#   .carry/mlflow/mlflow-3.17.2.tar.xz  the mlflow, mlflow-skinny and mlflow-tracing wheels unpacked into one
#                                       tree (as pip lays them out, with their .dist-info), minus the web UI's
#                                       build (mlflow/server/js/build, 27 of the tree's 50 MB: the server
#                                       answers / with "landing page not found", its REST API and /health
#                                       are whole)
#   .carry/mlflow/requirements.txt      the three wheels' Requires-Dist (extras left out), for pip
#   .carry/mlflow/wheels/*.whl          what those need that the image lacks or may have too old: the server
#                                       (Flask, flask-cors, gunicorn, SQLAlchemy, alembic, graphene, huey,
#                                       ...), the client (databricks-sdk, google-auth, cryptography, GitPython,
#                                       opentelemetry, sqlparse, ...) and the ones .carry/ray carries too, at
#                                       the same versions (pydantic 2.14.4, fastapi, starlette, uvicorn,
#                                       opentelemetry, protobuf, click, python-dotenv): this carry installs
#                                       without .carry/ray. cachetools 7.3.2 (mlflow wants < 8; .carry/v3
#                                       carries the same). Versions: constraints.txt's.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
MLFLOW_VERSION=3.17.2
W=/tmp/peagle-mlflow
rm -rf "$W" .carry/mlflow && mkdir -p "$W/tree" .carry/mlflow/wheels
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_34_x86_64 --platform any "$@" 2>&1 | grep -v "is ignored" || true
}
download -d "$W" "mlflow==$MLFLOW_VERSION" "mlflow-skinny==$MLFLOW_VERSION" "mlflow-tracing==$MLFLOW_VERSION"
for w in "$W"/mlflow_tracing-*.whl "$W"/mlflow_skinny-*.whl "$W/mlflow-$MLFLOW_VERSION-py3-none-any.whl"; do
  unzip -o -q "$w" -d "$W/tree"
done
rm -rf "$W/tree/mlflow/server/js/build"
python3 - "$W"/mlflow*.whl > .carry/mlflow/requirements.txt <<'EOF'
import re, sys, zipfile
reqs = set()
for whl in sys.argv[1:]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist: ") and "extra ==" not in line:
                req = line.removeprefix("Requires-Dist: ")
                if not re.match(r"mlflow(-skinny|-tracing)?\b", req):
                    reqs.add(req)
print("\n".join(sorted(reqs, key=str.lower)))
EOF
tar -C "$W/tree" -cf - . | xz -T2 -9e > ".carry/mlflow/mlflow-$MLFLOW_VERSION.tar.xz"
# the server
download -d .carry/mlflow/wheels flask==3.1.3 flask-cors==6.0.5 werkzeug==3.1.9 blinker==1.9.0 itsdangerous==2.2.0 \
  gunicorn==26.2.0 sqlalchemy==2.1.9 alembic==1.20.1 mako==1.4.3 graphene==3.4.3 graphql-core==3.2.14 \
  graphql-relay==3.2.0 huey==3.5.4 docker==7.2.0 skops==0.16.0 prettytable==3.18.0 wcwidth==0.9.4
# the client (mlflow-skinny, mlflow-tracing)
download -d .carry/mlflow/wheels databricks-sdk==0.156.0 google-auth==2.62.2 pyasn1-modules==0.4.2 pyasn1==0.6.5 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 sqlparse==0.6.1 \
  cachetools==7.3.2 importlib-metadata==9.1.0 anyio==4.16.0
# shared with .carry/ray (same versions)
download -d .carry/mlflow/wheels opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 \
  python-dotenv==1.2.4 protobuf==7.36.2 click==8.5.1
ls -la .carry/mlflow .carry/mlflow/wheels
du -sh .carry/mlflow
