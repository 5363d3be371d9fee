# Sourced by the scripts that carry .carry/mlflow (bench/device/prepare_mlflow_carry.sh), after env.sh (its
# keep_install) and, when both, install_ray.sh (pip then skips what ~/keep/rdeps has): MLflow 3.17.2 unpacked into
# ~/keep/mlflow-site (once per warm machine) and only the needs this image lacks or has too old (~/keep/mdeps); both
# put on PYTHONPATH, and an `mlflow` command in ~/keep/bin on PATH. No web UI (REST API and /health only). A later
# call on the same warm machine needs no carry.
#   mlflow server --backend-store-uri sqlite:///$HOME/keep/mlflow/mlflow.db \
#     --default-artifact-root $HOME/keep/mlflow/artifacts --host 127.0.0.1 --port 5000 &
mkdir -p ~/keep/mlflow-site ~/keep/bin
[ -f ~/keep/mlflow-site/mlflow/__init__.py ] || tar -C ~/keep/mlflow-site -xJf .carry/mlflow/mlflow-3.17.2.tar.xz
MDEPS=$(python3 -c "import os, sysconfig; print(sysconfig.get_path('purelib', 'posix_prefix', {'base': os.path.expanduser('~/keep/mdeps'), 'platbase': os.path.expanduser('~/keep/mdeps')}))")
case ":${PYTHONPATH:-}:" in *":$MDEPS:"*) ;; *) export PYTHONPATH=~/keep/mlflow-site:$MDEPS${PYTHONPATH:+:$PYTHONPATH} ;; esac
[ -f .carry/mlflow/requirements.txt ] && cp .carry/mlflow/requirements.txt ~/keep/mlflow-requirements.txt
keep_install ~/keep/mdeps .carry/mlflow/wheels -r ~/keep/mlflow-requirements.txt
printf '#!/bin/sh\nexec %s -m mlflow "$@"\n' "$(command -v python3)" > ~/keep/bin/mlflow
chmod +x ~/keep/bin/mlflow
case ":$PATH:" in *":$HOME/keep/bin:"*) ;; *) export PATH=~/keep/bin:$PATH ;; esac
