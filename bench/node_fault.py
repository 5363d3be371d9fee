"""A Ray node lost in the middle of a stage, on the cluster of ``bench.multi_gpu`` (the raylet-kill check of the
4-GPU issue, item 5: Ray Train restarts on what is left, or waits with a clear message and resumes once the node is
back), or with ``--kill worker`` one Ray Train worker process of that node (the same item's worker SIGKILL: the
node stays, Ray Train restarts the worker group from the last checkpoint).

The stage runs alone as a Ray job (``ray_jobs.<stage>`` on the last job's run directory and recipe, as
``bench.multi_gpu submit --module`` does). Once the stage's progress line (``[train] 12/40 steps``) reaches
``--kill-at``, the raylet of node ``--node`` is SIGKILLed (its workers die with it; nothing in the product is
told), the node joins again ``--down-s`` seconds later with the resources it had, and the job is followed to its
end. The result names the kill, what the job printed after it, how the job ended and the stage's own record.

    python -m bench.multi_gpu up --nodes 2 --gpus-per-node 2 ...          # or --gpus-per-node 0 on a CPU box
    python -m bench.multi_gpu submit --config RECIPE ...; python -m bench.multi_gpu wait   # the run directory
    python -m bench.node_fault --stage train --node b --kill-at 10 --down-s 60 --name node_fault_train \\
        --set training.num_workers=4 --set training.max_steps=40

On a one-node cluster (``up --nodes 1``, e.g. a one-GPU machine) only ``--kill worker --node a`` applies: one Ray
Train worker of the head; its raylet would take the cluster with it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench import multi_gpu
from pipelines import local_ray, settings
from pipelines.stages.base import STAGE_FILE

AFTER_KILL_LINES = 200  # job log lines kept from the kill on


def progress(line: str, stage: str) -> int | None:
    """The count of a stage's progress line (``[train] 1,234/5,000 steps, ...`` -> 1234); None for other lines."""
    m = re.match(rf"\[{re.escape(stage)}\] ([\d,]+)/[\d,]+ ", line)
    return int(m.group(1).replace(",", "")) if m else None


def raylet_of(temp_dir: str, node: str) -> list:
    """The raylet process(es) of node ``node`` of the cluster in ``temp_dir``: a joined node's raylet has
    ``<temp>/node-<node>`` on its command line (``pipelines.local_ray.join``), the head's (``multi_gpu.NODE_NAMES[0]``)
    its session directory ``<temp>/session_*``."""
    import psutil

    temp = Path(temp_dir).resolve()
    key = f"{temp}/session_" if node == multi_gpu.NODE_NAMES[0] else str(temp / f"node-{node}")
    return _processes_where(psutil.process_iter(["pid", "name", "cmdline"]), lambda p: p.info["name"] == "raylet"
                            and any(key in part for part in p.info["cmdline"] or []))


def _processes_where(procs, test) -> list:
    """The processes of ``procs`` (psutil) for which ``test`` holds; one that ends or denies access meanwhile is
    left out."""
    import psutil

    out = []
    for p in procs:
        try:
            if test(p):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def kill_node(temp_dir: str, node: str) -> list[int]:
    """SIGKILL the raylet of ``node``; its pids.

    Raises:
        SystemExit: no raylet of that node runs.
    """
    procs = raylet_of(temp_dir, node)
    if not procs:
        sys.exit(f"no raylet of node {node!r} runs under {temp_dir}")
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
    return [p.pid for p in procs]


TRAIN_WORKER_TITLE = "ray::RayTrainWorker"  # the process title of a Ray Train worker actor (Ray sets ray::<Class>)


def train_workers_of(temp_dir: str, node: str) -> list:
    """The Ray Train worker processes of node ``node``: the raylet's descendants titled :data:`TRAIN_WORKER_TITLE`."""
    return [p for raylet in raylet_of(temp_dir, node) for p in _processes_where(
        raylet.children(recursive=True), lambda p: " ".join(p.cmdline()).startswith(TRAIN_WORKER_TITLE))]


def kill_worker(temp_dir: str, node: str) -> list[int]:
    """SIGKILL one Ray Train worker process of ``node`` (the lowest pid); its pid, in a list.

    Raises:
        SystemExit: no Ray Train worker runs on that node.
    """
    procs = sorted(train_workers_of(temp_dir, node), key=lambda p: p.pid)
    if not procs:
        sys.exit(f"no Ray Train worker ({TRAIN_WORKER_TITLE}*) runs on node {node!r} under {temp_dir}")
    os.kill(procs[0].pid, signal.SIGKILL)
    return [procs[0].pid]


def rejoin(temp_dir: str, node: str, node_args: dict[str, Any], timeout_s: float = 120.0) -> None:
    """Start the node again with the resources it had, once the cluster has marked the killed one dead.

    Raises:
        RuntimeError: the node could not join within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            local_ray.join(temp_dir, node_name=node, **node_args)
            return
        except ValueError:  # the killed node is still ALIVE to the GCS (its health check has not failed yet)
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node!r} still alive to the cluster {timeout_s:.0f}s after its raylet died")
            time.sleep(2)


def sample_id_check(record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """What the train stage trained, epoch by epoch, from the Ray Train run's ``sample_ids/epoch_XXXX.json``
    (``pipelines.train.order``; beside the checkpoint the stage record names): the epoch's samples, whether every
    rank's trained ids chain to the digest its trainer recorded from what it consumed (``matches_digest``: the
    planned order, nothing skipped or repeated across the kill) and whether the ids are unique. Empty where the
    record names no checkpoint or no epoch ended."""
    ckpt = ((record or {}).get("outputs") or {}).get("checkpoint")
    if not ckpt:
        return []
    from pipelines.train.order import SAMPLE_LOG_DIR

    out = []
    for f in sorted((Path(ckpt).parent / SAMPLE_LOG_DIR).glob("epoch_*.json")):
        log = json.loads(f.read_text())
        ids = [i for r in log["ranks"] for i in r.get("sample_ids", [])]
        out.append({"epoch": log["epoch"], "num_samples": log["num_samples"], "world_size": log["world_size"],
                    "ranks_match_digest": all(r.get("matches_digest", False) for r in log["ranks"]),
                    "ids_unique": len(ids) == len(set(ids)) == log["num_samples"]})
    return out


def job_run_dir(state: dict[str, Any]) -> Path:
    """The run directory of the last job's recipe: ``$PEAGLE_HOME/runs/<recipe name>`` (``settings.run_dir``)."""
    from pipelines.cli.common import recipe_from_cli

    return settings.run_dir(recipe_from_cli(Path(state["recipe"]["config"]), state["recipe"]["sets"]).name)


def run(opts: argparse.Namespace) -> dict[str, Any]:
    state = multi_gpu.load_state(opts.temp_dir)
    node_args = (state.get("node_args") or {}).get(opts.node)
    if node_args is None:
        sys.exit(f"node {opts.node!r} is not among the nodes `bench.multi_gpu up` started: "
                 f"{sorted(state.get('node_args') or {})}")
    if not raylet_of(opts.temp_dir, opts.node):
        sys.exit(f"node {opts.node!r} has no raylet running under {opts.temp_dir}")
    submit = argparse.Namespace(temp_dir=opts.temp_dir, config=opts.config, set=opts.set, run_dir=None,
                                id=f"{opts.stage}-fault-{int(time.time())}", git_sha=opts.git_sha,
                                module=f"ray_jobs.{opts.stage}",
                                env=[f"{settings.PROGRESS_EVERY_ENV}={opts.progress_every_s:g}"])
    job_id = multi_gpu.submit(submit)
    client = multi_gpu.job_client(multi_gpu.load_state(opts.temp_dir))
    t0, lines = time.monotonic(), []
    last: int | None = None
    kill: dict[str, Any] | None = None
    rejoined_s: float | None = None

    def on_line(line: str) -> None:
        nonlocal last
        n = progress(line, opts.stage)
        last = n if n is not None else last
        if kill is not None and "[state-dump]" not in line:  # not the dead raylet's event-loop statistics
            lines.append(f"[{time.monotonic() - t0:.0f}s] {line}")

    def on_poll() -> None:
        nonlocal kill, rejoined_s
        now = time.monotonic() - t0
        if kill is None and last is not None and last >= opts.kill_at:
            pids = (kill_worker if opts.kill == "worker" else kill_node)(opts.temp_dir, opts.node)
            kill = {"t_s": round(now, 1), "progress": last, "what": opts.kill, "pids": pids}
            print(f"--- SIGKILL of node {opts.node}'s {opts.kill} {pids} at {last} ({now:.0f} s)", flush=True)
        if opts.kill == "raylet" and kill is not None and rejoined_s is None and now - kill["t_s"] >= opts.down_s:
            rejoin(opts.temp_dir, opts.node, node_args)
            rejoined_s = round(time.monotonic() - t0, 1)
            print(f"--- node {opts.node} joined again at {rejoined_s:.0f} s", flush=True)
            lines.append(f"[{rejoined_s:.0f}s] --- node {opts.node} joined again")

    status, _ = multi_gpu.follow_job(client, job_id, 0, opts, on_line=on_line, on_poll=on_poll)
    record_path = Path(opts.run_dir or job_run_dir(multi_gpu.load_state(opts.temp_dir))) / opts.stage / STAGE_FILE
    record = multi_gpu.trim_history(json.loads(record_path.read_text())) if record_path.is_file() else None
    out = {"benchmark": "node_fault", "stage": opts.stage, "node": opts.node, "node_args": node_args,
           "job": {"id": job_id, "status": status.value, "config": opts.config or state["recipe"]["config"],
                   "sets": opts.set,
                   "seconds": round(time.monotonic() - t0, 1)},
           "kill": kill, "down_s": opts.down_s, "rejoined_s": rejoined_s, "last_progress": last,
           "log_after_kill": lines[-AFTER_KILL_LINES:], "stage_record": record,
           "sample_ids": sample_id_check(record) if opts.stage == "train" else [], "note": opts.note,
           "command": "python -m bench.node_fault " + " ".join(sys.argv[1:])}
    from bench.common import write_result

    print(f"wrote {write_result(opts.name, out)}: job {out['job']['status']}, kill {kill}, rejoined {rejoined_s}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--temp-dir", default=multi_gpu.DEFAULT_TEMP)
    ap.add_argument("--stage", default="train", help="ray_jobs.<stage>, alone on the last job's run directory")
    ap.add_argument("--node", default="b", help="the node whose raylet (not the head's) or Train worker is SIGKILLed")
    ap.add_argument("--kill", choices=("raylet", "worker"), default="raylet",
                    help="what is SIGKILLed on --node: its raylet (the node is lost, then joins again after "
                    "--down-s) or one Ray Train worker process (the node stays)")
    ap.add_argument("--kill-at", type=int, default=10, help="SIGKILL once the stage's progress count reaches this")
    ap.add_argument("--down-s", type=float, default=60.0, help="seconds until the node joins again")
    ap.add_argument("--timeout-s", type=float, default=540.0)
    ap.add_argument("--poll-s", type=float, default=2.0)
    ap.add_argument("--progress-every-s", type=float, default=2.0, help="the job's progress period: the kill waits "
                    "for a progress line at --kill-at (the 30 s default let 60 steps pass on 2 GPUs before the first)")
    ap.add_argument("--config", default=None, help="the recipe (default: the last job's, with its --set overrides)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--run-dir", default=None, help="the run directory, where the cluster state does not name it")
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--name", default="node_fault_train")
    ap.add_argument("--note", default="")
    opts = ap.parse_args(argv)
    if opts.node == multi_gpu.NODE_NAMES[0] and opts.kill == "raylet":
        ap.error(f"--node {opts.node}: the head's raylet takes the cluster with it; kill another node, or "
                 "--kill worker (a one-node cluster: one Ray Train worker of the head)")
    out = run(opts)
    return 0 if out["job"]["status"] == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
