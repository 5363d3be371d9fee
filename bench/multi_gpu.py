"""The main job on one multi-GPU host as a cluster of several Ray nodes, with a real MLflow server.

Every step is the product's own: ``peagle registry server start`` (``pipelines.registry.server``), a private Ray
head and joining raylets (``pipelines.local_ray``: each "node" its own GPUs through ``CUDA_VISIBLE_DEVICES`` and a
name), ``ray job submit -- python -m ray_jobs.pipeline --config RECIPE`` (the job's runtime env of
``local_ray.job_runtime_env``), and the job's own ``summary.json`` (stage times and where each stage ran).

    python -m bench.multi_gpu up --nodes 2 --gpus-per-node 2          # MLflow server, head "a", node "b"
    python -m bench.multi_gpu submit --config configs/smollm2-135m-4gpu.yaml --set ...   # returns at once
    python -m bench.multi_gpu wait [--timeout-s 540]                  # follows the job; exit 0 done, 3 running
    python -m bench.multi_gpu record --name multi_gpu_pipeline        # summary + stage records -> bench/results
    python -m bench.multi_gpu new-champion --run-dir DIR             # the champion's files as a new champion
    python -m bench.multi_gpu submit --module ray_jobs.serve ...     # the serve stage alone: rolls to it
    python -m bench.multi_gpu gpu-run -- bash bench/device/run_synthetic_serving.sh ...  # beside it, on a GPU of its own
    python -m bench.multi_gpu down

The same commands run on a CPU box with ``--gpus-per-node 0`` (the rehearsal of ``bench/device/run_multi_gpu.sh``).
State (addresses, the job id) is kept in ``<temp dir>/multi_gpu.json`` between the calls.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelines import local_ray, settings

STATE = "multi_gpu.json"
NODE_NAMES = "abcdefgh"
DEFAULT_TEMP = "/tmp/peagle-ray"
PIPELINE_MODULE = "ray_jobs.pipeline"


def _state_path(temp: str) -> Path:
    return Path(temp) / STATE


def load_state(temp: str) -> dict[str, Any]:
    """What ``up`` and ``submit`` recorded.

    Raises:
        SystemExit: no cluster was brought up from ``temp``.
    """
    p = _state_path(temp)
    if not p.is_file():
        sys.exit(f"no cluster recorded in {p}: run `python -m bench.multi_gpu up` first")
    return json.loads(p.read_text())


def save_state(temp: str, state: dict[str, Any]) -> None:
    _state_path(temp).write_text(json.dumps(state, indent=2))


def up(opts: argparse.Namespace) -> dict[str, Any]:
    """MLflow server first (every Ray process inherits ``$MLFLOW_TRACKING_URI``), then the head and the joining
    nodes, GPUs split in order (node i owns GPUs ``i*g .. i*g+g-1``)."""
    from pipelines.registry import server

    mlflow = server.start(port=opts.mlflow_port)
    os.environ[settings.TRACKING_URI_ENV] = mlflow.uri
    g = opts.gpus_per_node

    def gpus(i: int) -> dict[str, Any]:
        ids = ",".join(str(i * g + j) for j in range(g))
        return {"num_gpus": g, "cuda_visible_devices": ids} if g else {"num_gpus": 0}

    head = local_ray.start(opts.temp_dir, port=opts.port, dashboard_port=opts.dashboard_port,
                           num_cpus=opts.cpus_per_node, node_name=NODE_NAMES[0], **gpus(0))
    for i in range(1, opts.nodes):
        local_ray.join(opts.temp_dir, node_name=NODE_NAMES[i], num_cpus=opts.cpus_per_node, **gpus(i))
    state = {"mlflow_uri": mlflow.uri, "dashboard_url": head.dashboard_url, "gcs_address": head.gcs_address,
             "nodes": opts.nodes, "gpus_per_node": g, "cpus_per_node": opts.cpus_per_node,
             "client_env": head.client_env(),  # what each node was started with (bench.node_fault restarts one)
             "node_args": {NODE_NAMES[i]: {"num_cpus": opts.cpus_per_node, **gpus(i)} for i in range(opts.nodes)}}
    save_state(opts.temp_dir, state)
    print(json.dumps(state, indent=2))
    return state


def _ray(state: dict[str, Any], *args: str, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, **state["client_env"])
    return subprocess.run([*local_ray.RAY_CLI, *args], env=env, capture_output=True, text=True, check=False, **kw)


def job_recipe(state: dict[str, Any], config: str | None, sets: list[str]) -> tuple[str, list[str]]:
    """The recipe and ``--set`` overrides of a job: ``config`` and ``sets`` when a recipe is named (recorded in
    ``state`` for the jobs after it), else the last recorded recipe with its overrides, then ``sets`` (a stage
    alone on the same run directory sees the same recipe).

    Raises:
        SystemExit: no recipe named and none recorded.
    """
    if config is None:
        if "recipe" not in state:
            sys.exit("submit: no --config, and no earlier job's recipe recorded to take it from")
        return state["recipe"]["config"], state["recipe"]["sets"] + sets
    state["recipe"] = {"config": config, "sets": sets}
    return config, sets


def submit(opts: argparse.Namespace) -> str:
    """``ray job submit --no-wait`` of the pipeline with the recipe and ``--set`` overrides; the job id."""
    state = load_state(opts.temp_dir)
    runtime_env = local_ray.job_runtime_env()
    runtime_env["env_vars"] |= {settings.TRACKING_URI_ENV: state["mlflow_uri"]}
    if opts.git_sha:  # a checkout copy without .git (the device's)
        runtime_env["env_vars"] |= {"PEAGLE_GIT_SHA": opts.git_sha}
    for kv in getattr(opts, "env", None) or []:  # the job's own variables (bench.node_fault: its progress period)
        key, sep, value = kv.partition("=")
        if not sep or not key:
            sys.exit(f"submit --env {kv!r}: give KEY=VALUE")
        runtime_env["env_vars"][key] = value
    job_id = opts.id or f"peagle-{int(time.time())}"
    config, sets = job_recipe(state, opts.config, opts.set)
    entry = ["python", "-m", opts.module, "--config", config, *[a for kv in sets for a in ("--set", kv)]]
    if opts.run_dir:
        entry += ["--run-dir", opts.run_dir]
    if getattr(opts, "force", False):  # rerun a current stage (e.g. capture on 1 GPU after 4: one key for both)
        entry += ["--force"]
    out = _ray(state, "job", "submit", "--address", state["dashboard_url"], "--no-wait", "--submission-id", job_id,
               "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--", *entry)
    if out.returncode != 0:
        sys.exit(f"ray job submit failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    state |= {"job_id": job_id, "submitted_at": time.time(), "config": config, "sets": sets,
              "entrypoint": entry, "log_lines_seen": 0}
    save_state(opts.temp_dir, state)
    print(f"submitted {job_id}: {' '.join(entry)}")
    return job_id


def job_client(state: dict[str, Any]):
    """Ray's job SDK against the recorded head (its token from the recorded client environment; call before
    anything imports Ray)."""
    os.environ.update(state["client_env"])
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(state["dashboard_url"])


def wait(opts: argparse.Namespace) -> int:
    """Follow the job's log (new lines only) until it ends or ``--timeout-s`` passes: 0 succeeded, 1 failed or
    stopped, 3 still running."""
    state = load_state(opts.temp_dir)
    client = job_client(state)  # before Ray is imported: it reads the token variables once
    job_id = state["job_id"]
    status, state["log_lines_seen"] = follow_job(client, job_id, int(state.get("log_lines_seen", 0)), opts)
    save_state(opts.temp_dir, state)
    print(f"job {job_id}: {status.value} ({time.time() - state['submitted_at']:.0f} s since submission)", flush=True)
    return exit_code(status)


def exit_code(status) -> int:
    """A followed job's exit status for the shell: 0 succeeded, 1 failed or stopped, 3 still running."""
    from ray.job_submission import JobStatus

    return 0 if status == JobStatus.SUCCEEDED else 1 if status.is_terminal() else 3


def follow_job(client, job_id: str, seen: int, opts: argparse.Namespace, *,
               on_line: Callable[[str], None] | None = None, on_poll: Callable[[], None] | None = None):
    """Print the job's new log lines every ``opts.poll_s`` until it ends or ``opts.timeout_s`` passes; its last
    status and the number of log lines seen. ``on_line`` sees each new line; ``on_poll`` runs after every poll
    that found the job still running (e.g. ``bench.node_fault``'s kill and rejoin)."""
    deadline = time.monotonic() + opts.timeout_s
    while True:
        logs = client.get_job_logs(job_id).splitlines()
        for line in logs[seen:]:
            print(line, flush=True)
            if on_line is not None:
                on_line(line)
        seen = max(seen, len(logs))
        status = client.get_job_status(job_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return status, seen
        if on_poll is not None:
            on_poll()
        time.sleep(opts.poll_s)


def gpu_run(opts: argparse.Namespace) -> int:
    """Run a command on the cluster as a Ray job holding ``--num-gpus`` GPUs (``entrypoint_num_gpus``: Ray sets
    its ``CUDA_VISIBLE_DEVICES`` and gives that GPU to nothing else), e.g. a one-GPU benchmark beside Serve
    replicas that use the other GPUs; the job state of ``submit``/``wait`` is left alone. Follows the job to its
    end (or ``--timeout-s``): 0 succeeded, 1 failed or stopped, 3 still running."""
    client = job_client(load_state(opts.temp_dir))
    runtime_env = local_ray.job_runtime_env() | {"working_dir": "."}
    runtime_env["env_vars"] |= {k: os.environ[k] for k in opts.pass_env if k in os.environ}
    # its own $OUT: the raylet's is that of the device call that started Ray, shared by every later call (a
    # device script's `save` in the job copied the job's whole fresh checkout of bench/results there)
    runtime_env["env_vars"]["OUT"] = str(Path(opts.temp_dir) / f"gpu-run-out-{int(time.time())}")
    job_id = client.submit_job(entrypoint=shlex.join(opts.command), runtime_env=runtime_env,
                               entrypoint_num_gpus=opts.num_gpus, submission_id=f"gpu-run-{int(time.time())}")
    print(f"submitted {job_id} ({opts.num_gpus} GPU): {shlex.join(opts.command)}", flush=True)
    status, _ = follow_job(client, job_id, 0, opts)
    print(f"job {job_id}: {status.value}", flush=True)
    return exit_code(status)


def record(opts: argparse.Namespace) -> Path:
    """``bench/results/<name>.json``: the job's summary (stage status, seconds, placement), every stage's record
    (its outputs: tokens/s, steps, the eval rows, the model version, the endpoint) and how it was submitted."""
    from bench.common import write_result
    from pipelines.stages.base import STAGE_FILE

    state = load_state(opts.temp_dir)
    run = Path(opts.run_dir)
    stages = {p.parent.name: json.loads(p.read_text()) for p in sorted(run.glob(f"*/{STAGE_FILE}"))}
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else \
        summary_of_failed_job(run, stages, opts.failure)
    for rec in stages.values():
        trim_history(rec)
    payload = {"benchmark": "multi_gpu_pipeline", "summary": summary, "stage_records": stages,
               "cluster": {k: state[k] for k in ("nodes", "gpus_per_node", "cpus_per_node", "mlflow_uri")},
               "job": {k: state.get(k) for k in ("job_id", "config", "sets", "entrypoint")},
               "gpus": _gpu_names() or opts.gpus, "note": opts.note}
    if opts.environment_json:  # records a device returned, recorded on another machine: the device's environment
        payload["environment"] = json.loads(Path(opts.environment_json).read_text())
    path = write_result(opts.name, payload)
    print(f"wrote {path}")
    return path


def trim_history(record: dict[str, Any]) -> dict[str, Any]:
    """A stage record with a long training ``history`` cut to its first and last three logged windows (in place)."""
    hist = (record.get("outputs") or {}).get("history")
    if isinstance(hist, list) and len(hist) > 6:
        record["outputs"]["history"] = hist[:3] + hist[-3:]
    return record


def summary_of_failed_job(run: Path, stages: dict[str, dict], failure: str | None) -> dict[str, Any]:
    """A job that failed writes no ``summary.json``: the stages that ran, from their own records, then the stage
    that failed (the first stage without a record) with ``failure`` as its reason."""
    import yaml

    from pipelines.pipeline import STAGES

    recipe = run / "recipe.yaml"
    name = (yaml.safe_load(recipe.read_text()) or {}).get("name") if recipe.is_file() else None
    out: dict[str, Any] = {"recipe": name or run.name, "run_dir": str(run), "failed": True, "stages": {}}
    for name in STAGES:
        rec = stages.get(name)
        if rec is not None:
            out["stages"][name] = {"status": rec["status"], "seconds": round(rec["seconds"], 1)} | (
                {"placement": rec["placement"]} if rec.get("placement") else {})
        else:
            out["stages"][name] = {"status": "failed", "seconds": 0.0, "reason": failure or "see the job log"}
            break
    return out


def new_champion(opts: argparse.Namespace) -> str:
    """Register the champion's files again as a new version of the run's registered model (its tags: AL, K, eval
    set, K per concurrency, K schedule) and promote it without the gate: a new champion as Serve sees it (the serve stage rolls
    to a new backend app with new replicas), without training another head. Prints and returns the version."""
    import tempfile

    from pipelines.stages.base import STAGE_FILE

    state = load_state(opts.temp_dir)
    os.environ[settings.TRACKING_URI_ENV] = state["mlflow_uri"]
    from pipelines.evaluate.k_schedule import K_SCHEDULE_TAG
    from pipelines.registry.promotion import CHAMPION, promote
    from pipelines.registry.register import download, get_client, register_head

    name = json.loads((Path(opts.run_dir) / "register" / STAGE_FILE).read_text())["outputs"]["model_name"]
    old = get_client().get_model_version_by_alias(name, CHAMPION)
    tags = old.tags or {}
    with tempfile.TemporaryDirectory() as tmp:
        head = download(f"models:/{name}/{old.version}", Path(tmp) / "head")
        mv = register_head(head, model_name=name, eval_al=float(tags["acceptance_length"]), K=int(tags["K"]),
                           eval_set=tags["eval_set"], target=tags.get("target") or None,
                           tags={k: v for k, v in tags.items() if k.startswith(("al.K", "K_best.c")) or k == K_SCHEDULE_TAG}
                           | {"copy_of_version": str(old.version)})
    promote(name, mv.version, reason=f"bench.multi_gpu new-champion: v{old.version}'s files as v{mv.version}")
    print(f"{name}: v{mv.version} (the files of v{old.version}) is the champion", flush=True)
    return str(mv.version)


def _gpu_names() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False, timeout=30)
        return [x.strip() for x in out.stdout.splitlines() if x.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def down(opts: argparse.Namespace) -> None:
    from pipelines.registry import server

    local_ray.stop(opts.temp_dir)
    server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temp-dir", default=DEFAULT_TEMP, help="the head's private Ray temp dir (and this state)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=2)
    p.add_argument("--cpus-per-node", type=int, default=16)
    p.add_argument("--port", type=int, default=6390)
    p.add_argument("--dashboard-port", type=int, default=8265)
    p.add_argument("--mlflow-port", type=int, default=5000)
    p = sub.add_parser("submit")
    p.add_argument("--config", default=None, help="the recipe (default: that of the last job that named one, with "
                   "its --set overrides before these)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--id", default=None, help="submission id (default peagle-<time>)")
    p.add_argument("--git-sha", default=None, help="the commit, where the checkout has no .git")
    p.add_argument("--module", default=PIPELINE_MODULE, help="the job's entry module (ray_jobs.<stage>: that stage "
                   "alone on the same run directory; ray_jobs.serve rolls to the registry's champion)")
    p.add_argument("--force", action="store_true", help="the job's --force: run its stages even when current")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="an environment variable of the "
                   "job (its runtime_env), e.g. PEAGLE_PROGRESS_EVERY_S=5")
    p = sub.add_parser("new-champion")
    p.add_argument("--run-dir", required=True, help="the run whose register stage names the registered model")
    p = sub.add_parser("wait")
    p.add_argument("--timeout-s", type=float, default=540.0)
    p.add_argument("--poll-s", type=float, default=10.0)
    p = sub.add_parser("gpu-run")
    p.add_argument("--num-gpus", type=float, default=1.0)
    p.add_argument("--timeout-s", type=float, default=540.0)
    p.add_argument("--poll-s", type=float, default=10.0)
    p.add_argument("--pass-env", nargs="*", default=["OUT", "PEAGLE_CALL_T0"], help="variables of this shell the "
                   "job gets")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p = sub.add_parser("record")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--name", default="multi_gpu_pipeline")
    p.add_argument("--note", default="")
    p.add_argument("--failure", default=None, help="why the job failed, for a run without summary.json")
    p.add_argument("--environment-json", default=None, help="the device's environment (date, device, versions) when "
                   "recording its returned run directory on another machine")
    p.add_argument("--gpus", nargs="*", default=[], help="GPU names when nvidia-smi is not here")
    sub.add_parser("down")
    opts = ap.parse_args(argv)
    if opts.cmd == "gpu-run":
        opts.command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
        if not opts.command:
            ap.error("gpu-run: no command (gpu-run [OPTIONS] -- CMD ARGS...)")
    out = {"up": up, "submit": submit, "new-champion": new_champion, "wait": wait, "gpu-run": gpu_run,
           "record": record, "down": down}[opts.cmd](opts)
    return out if isinstance(out, int) else 0


if __name__ == "__main__":
    sys.exit(main())
