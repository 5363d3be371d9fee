"""The several-GPU benchmarks' own parts: a new champion from the champion's files (``bench.multi_gpu
new-champion``, a real sqlite MLflow store and a tiny exported head), a stage's recipe, the load ramp's
per-replica-count rows and text prompts (``bench.serve_autoscale``), the 1/2/4-GPU tables (``bench.report_per_gpu``)."""

import json
import random

import pytest

from bench import multi_gpu
from bench import serve_autoscale as sa
from tests.unit.conftest import make_drafter, tiny_target_config

pytestmark = pytest.mark.unit


def test_new_champion_registers_the_champions_files_as_a_new_version(uri, tmp_path):
    from peagle_core.contract import export_head
    from pipelines.evaluate.k_schedule import K_SCHEDULE_TAG
    from pipelines.registry import register as reg
    from pipelines.registry.promotion import CHAMPION, promote
    from pipelines.stages.base import STAGE_FILE

    head = export_head(make_drafter(), tmp_path / "head", dtype="float32")
    v1 = reg.register_head(head, model_name="peagle-tiny", eval_al=1.7, K=5, eval_set="humaneval",
                           al_by_K={3: 1.6}, K_best={1: 5, 16: 3}, target_config=tiny_target_config(),
                           tags={K_SCHEDULE_TAG: "[[1, 1024, 5]]"}, tracking_uri=uri)
    promote("peagle-tiny", v1.version, tracking_uri=uri)
    temp, run = tmp_path / "ray", tmp_path / "run"
    temp.mkdir()
    multi_gpu.save_state(str(temp), {"mlflow_uri": uri})
    (run / "register").mkdir(parents=True)
    (run / "register" / STAGE_FILE).write_text(json.dumps({"outputs": {"model_name": "peagle-tiny"}}))

    assert multi_gpu.main(["--temp-dir", str(temp), "new-champion", "--run-dir", str(run)]) == 0

    client = reg.get_client(uri)
    new = client.get_model_version_by_alias("peagle-tiny", CHAMPION)
    old = client.get_model_version("peagle-tiny", v1.version)
    assert int(new.version) == int(v1.version) + 1
    for tag in ("acceptance_length", "K", "eval_set", "al.K3", "al.K5", "K_best.c1", "K_best.c16", K_SCHEDULE_TAG,
                reg.HEAD_SHA256_TAG):
        assert new.tags[tag] == old.tags[tag], tag
    assert new.tags["copy_of_version"] == str(v1.version)


def test_requests_are_grouped_by_the_replicas_running_when_they_started():
    """Polls at 0.5..4.5 s: 1 replica until 2.5 s, 2 until 4.5 s, then 1 again; a level from 0 to 5 s."""
    tl = sa.ReplicaTimeline([(0.5, 1, 0), (1.5, 1, 1), (2.5, 2, 0), (3.5, 2, 0), (4.5, 1, 0)])
    assert tl.seconds_at(0.0, 5.0) == {1: 3.0, 2: 2.0}
    assert tl.running_at(0.1) == 1 and tl.running_at(3.0) == 2 and tl.running_at(4.6) == 1
    t0 = 100.0
    done = [sa.RequestResult(True, t0 + s, ttft_s=0.05, e2e_s=0.5, num_tokens=10, served="models:/x/1")
            for s in (0.2, 1.0, 2.6, 3.0, 4.8)]
    lost = sa.RequestResult(False, t0 + 2.7, error="stream interrupted")
    rows = sa.by_replicas(8, [*done, lost], tl, t0, 0.0, 5.0)
    assert [(r["replicas"], r["completed"], r["failed"], r["seconds"]) for r in rows] == [(1, 3, 0, 3.0), (2, 2, 1, 2.0)]
    assert rows[0]["requests_per_s"] == 1.0 and rows[1]["tpot_ms_p50"] == pytest.approx(50.0)
    assert sa.level_row(8, [*done, lost], 5.0, [1, 2])["served"] == {"models:/x/1": 5}


def test_text_prompts_are_words_of_the_word_list():
    words = sa.text_prompt(random.Random(0), 128).split()
    assert len(words) == 128 and set(words) <= set(sa.WORDS)
    assert sa.text_prompt(random.Random(0), 128) == sa.text_prompt(random.Random(0), 128)


def test_a_stage_alone_takes_the_recipe_of_the_last_job_that_named_one():
    state: dict = {}
    with pytest.raises(SystemExit, match="no --config"):
        multi_gpu.job_recipe(state, None, [])
    assert multi_gpu.job_recipe(state, "configs/x.yaml", ["a.b=1"]) == ("configs/x.yaml", ["a.b=1"])
    assert multi_gpu.job_recipe(state, None, ["training.num_workers=1"]) == (
        "configs/x.yaml", ["a.b=1", "training.num_workers=1"])
    assert state["recipe"] == {"config": "configs/x.yaml", "sets": ["a.b=1"]}  # a stage's own overrides not kept


def test_the_per_gpu_table_scales_against_the_same_machines_one_gpu(monkeypatch, tmp_path):
    """Each run's efficiency is against the 1-GPU run of its own machine (lease), else one on the same kind of GPU,
    marked as such; the main job's stages are not rows of the series."""
    from bench import report_per_gpu as rmg

    def run(tok_s: float, gpus: int, machine_gpus: int, date: str) -> dict:
        history = [{"step": 10 * (i + 1), "loss": 5.0, "tokens_per_s": t} for i, t in enumerate((1.0, tok_s, tok_s))]
        return {"environment": {"date": date, "device": "NVIDIA H200"}, "gpus": ["NVIDIA H200"] * machine_gpus,
                "job": {"config": "configs/smollm2-135m-4gpu.yaml", "sets": [f"training.num_workers={gpus}"]},
                "stage_records": {"train": {"status": "ran", "placement": {"num_gpus": gpus},
                                            "outputs": {"history": history}}}}

    files = {"multi_gpu_train_1": run(100_000, 1, 2, "2026-12-01"), "multi_gpu_train_2": run(180_000, 2, 2, "2026-12-01"),
             "multi_gpu_train_4": run(342_000, 4, 4, "2026-12-02"), "multi_gpu_pipeline": run(1.0, 4, 4, "2026-11-27")}
    for name in files:
        (tmp_path / f"{name}.json").write_text("{}")
    monkeypatch.setattr(rmg, "RESULTS", tmp_path)
    monkeypatch.setattr(rmg, "load", files.get)
    lines: list[str] = []
    rmg.training(lines)
    rows = [ln.split(" | ") for ln in lines if ln.startswith("| ") and not ln.startswith("| GPUs") and "`" in ln]
    assert [(r[0], r[1], r[2], r[-1]) for r in rows] == [
        ("| 1", "`multi_gpu_train_1.json`", "2x NVIDIA H200, 2026-12-01 00:00", "1.00 |"),
        ("| 2", "`multi_gpu_train_2.json`", "2x NVIDIA H200, 2026-12-01 00:00", "0.90 |"),
        ("| 4", "`multi_gpu_train_4.json`", "4x NVIDIA H200, 2026-12-02 00:00", "0.85 (1 GPU: another machine) |")]

    # a second 2-GPU lease the same day (a lease holds its machine <= 30 min): its own machine, its own 1-GPU row
    files |= {"multi_gpu_train_1_late": run(50_000, 1, 2, "2026-12-01T13:00:00"),
              "multi_gpu_train_2_late": run(95_000, 2, 2, "2026-12-01T13:20:00")}
    for name in files:
        (tmp_path / f"{name}.json").write_text("{}")
    assert rmg.leases()["multi_gpu_train_2_late"] == "2x NVIDIA H200, 2026-12-01 13:00"
    lines = []
    rmg.training(lines)
    late = [ln for ln in lines if "_2_late" in ln and ln.startswith("| ")]
    assert late and late[0].endswith(" 0.95 |"), late

    # a row without a 1-GPU run on its machine is held to the fastest 1-GPU run of its GPU kind, whichever came first
    files |= {"multi_gpu_train_1_fast": run(120_000, 1, 1, "2026-12-03"),
              "multi_gpu_train_1_slow": run(60_000, 1, 1, "2026-11-30")}  # its machine's label sorts first
    for name in ("multi_gpu_train_1_fast", "multi_gpu_train_1_slow"):
        (tmp_path / f"{name}.json").write_text("{}")
    lines = []
    rmg.training(lines)
    four = [ln for ln in lines if "`multi_gpu_train_4.json`" in ln and ln.startswith("| ")]
    assert four and four[0].endswith(" 0.71 (1 GPU: another machine) |"), four


def test_scale_down_is_counted_from_the_first_lower_level_after_the_peak():
    from bench.report_multi_gpu import _scaled_down

    levels = [{"concurrency": 1, "t_start_s": 0.0, "seconds": 15.0}, {"concurrency": 64, "t_start_s": 15.0,
              "seconds": 100.0}, {"concurrency": 8, "t_start_s": 115.0, "seconds": 100.0}]
    # up to 4 at 80 s, a kill leaves 3 at 90 s (not a scale-down), back to 1 at 160 s under the c=8 level
    timeline = [[1.0, 1, 0], [80.0, 4, 0], [90.0, 3, 1], [160.0, 1, 0]]
    r = {"levels": levels, "timeline": timeline, "replicas_at_start": 1, "replicas_max_seen": 4}
    assert _scaled_down(r) == "back to 1 at 160 s, 45 s after the load fell to concurrency 8"
    assert _scaled_down(r | {"timeline": timeline[:3]}) is None  # never back under load: the idle watch says it
    assert _scaled_down(r | {"levels": levels[:2]}) is None  # no lower level: counted from the load's end


def test_gpu_run_takes_the_command_after_the_double_dash_and_refuses_none(monkeypatch):
    seen = {}
    monkeypatch.setattr(multi_gpu, "gpu_run", lambda opts: seen.setdefault("command", opts.command) and 0)
    assert multi_gpu.main(["gpu-run", "--num-gpus", "1", "--", "bash", "run.sh", "--k", "5"]) == 0
    assert seen["command"] == ["bash", "run.sh", "--k", "5"]
    with pytest.raises(SystemExit) as e:
        multi_gpu.main(["gpu-run", "--"])
    assert e.value.code == 2


def test_node_fault_reads_the_stages_progress_lines_and_refuses_the_head():
    from bench import node_fault

    assert node_fault.progress("[train] 1,234/5,000 steps, 2.1 steps/s, ETA 0m30s, 1m00s", "train") == 1234
    assert node_fault.progress("[train] 0/40 steps, - steps/s, 0m00s", "train") == 0
    assert node_fault.progress("[capture] 12/40 conversations, ...", "train") is None
    assert node_fault.progress("[train] done in 101.5s", "train") is None
    with pytest.raises(SystemExit) as e:
        node_fault.main(["--node", multi_gpu.NODE_NAMES[0]])
    assert e.value.code == 2


def test_worker_kill_takes_one_ray_train_worker_of_the_node_and_nothing_else(monkeypatch):
    """``bench.node_fault --kill worker``: real processes under a stand-in raylet, one titled as Ray titles a Ray
    Train worker actor (``ray::RayTrainWorker...``) and one not; only the titled one is SIGKILLed."""
    import subprocess
    import time

    import psutil

    from bench import node_fault

    script = f"(exec -a '{node_fault.TRAIN_WORKER_TITLE}.run_train_fn' sleep 30) & (exec -a 'ray::IDLE' sleep 30) & wait"
    raylet = subprocess.Popen(["bash", "-c", script])
    try:
        parent = psutil.Process(raylet.pid)
        deadline = time.monotonic() + 10
        while len(parent.children(recursive=True)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        monkeypatch.setattr(node_fault, "raylet_of", lambda temp_dir, node: [parent])
        [worker] = node_fault.train_workers_of("/tmp/x", "b")
        assert node_fault.kill_worker("/tmp/x", "b") == [worker.pid]
        worker.wait(timeout=5)
        others = parent.children(recursive=True)
        assert [" ".join(p.cmdline()) for p in others] == ["ray::IDLE 30"]
        monkeypatch.setattr(node_fault, "raylet_of", lambda temp_dir, node: [])
        with pytest.raises(SystemExit, match="no Ray Train worker"):
            node_fault.kill_worker("/tmp/x", "b")
    finally:
        for p in psutil.Process(raylet.pid).children(recursive=True):
            p.kill()
        raylet.kill()
        raylet.wait()


def test_raylet_of_tells_the_head_from_a_joined_node(tmp_path):
    """The head's raylet (node ``a``, ``--kill worker`` on a one-node cluster) is the one whose session directory
    lies right under the cluster's temp dir; a joined node's lies under ``<temp>/node-<name>``. Real processes named
    ``raylet`` (a link to bash), each with the ``--session_dir`` Ray gives a raylet."""
    import subprocess

    from bench import node_fault

    link = tmp_path / "bin" / "raylet"
    link.parent.mkdir()
    link.symlink_to("/bin/bash")
    temp = tmp_path / "ray"
    procs = {node: subprocess.Popen([str(link), "-c", "sleep 30; true", "raylet", f"--session_dir={d}/session_2026_12_01"])
             for node, d in (("a", temp), ("b", temp / "node-b"))}
    try:
        for node, proc in procs.items():
            assert [p.pid for p in node_fault.raylet_of(str(temp), node)] == [proc.pid], node
        assert node_fault.raylet_of(str(temp), "c") == []
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
    with pytest.raises(SystemExit) as e:  # the head's raylet is refused; a worker of the head is not
        node_fault.main(["--node", multi_gpu.NODE_NAMES[0], "--kill", "raylet"])
    assert e.value.code == 2
    with pytest.raises(SystemExit, match="no cluster recorded"):
        node_fault.main(["--node", "a", "--kill", "worker", "--temp-dir", str(tmp_path / "none")])


def test_sample_id_check_reads_what_each_epoch_trained(tmp_path):
    """``bench.node_fault.sample_id_check``: the epoch files ``pipelines.train.order`` writes beside the
    checkpoints, read back; a rank whose ids do not chain to its recorded digest, or an id trained twice, shows."""
    from bench import node_fault
    from pipelines.train import order

    planned = order.epoch_orders([f"s{i}" for i in range(6)], seed=0, epoch=0, world_size=2)
    recs = [order.EpochRecord(epoch=0, rank=r, num_samples=3, sha256=order.chain_digest(planned[r]))
            for r in range(2)]
    run = tmp_path / "ray_results" / "run"
    order.write_epoch_summary(run / order.SAMPLE_LOG_DIR, order.epoch_summary(recs, seed=0, planned=planned))
    bad = [recs[0], order.EpochRecord(epoch=1, rank=1, num_samples=3, sha256="x")]
    summary = order.epoch_summary(bad, seed=0, planned=[planned[0], planned[0]])
    summary["epoch"] = 1
    order.write_epoch_summary(run / order.SAMPLE_LOG_DIR, summary)
    record = {"outputs": {"checkpoint": str(run / "checkpoint_00000008")}}
    assert node_fault.sample_id_check(record) == [
        {"epoch": 0, "num_samples": 6, "world_size": 2, "ranks_match_digest": True, "ids_unique": True},
        {"epoch": 1, "num_samples": 6, "world_size": 2, "ranks_match_digest": False, "ids_unique": False}]
    assert node_fault.sample_id_check({"outputs": {}}) == [] == node_fault.sample_id_check(None)


def test_submit_gives_the_job_its_own_variables(monkeypatch, tmp_path):
    """``submit --env KEY=VALUE`` lands in the job's runtime_env beside the tracking URI (bench.node_fault: the
    progress period); a malformed one stops before ``ray job submit``."""
    import argparse
    import subprocess

    calls = []
    monkeypatch.setattr(multi_gpu, "_ray", lambda state, *args, **kw: calls.append(args) or
                        subprocess.CompletedProcess(args, 0, "", ""))
    multi_gpu.save_state(str(tmp_path), {"mlflow_uri": "http://127.0.0.1:5000", "dashboard_url": "http://x:8265",
                                         "client_env": {}})
    opts = argparse.Namespace(temp_dir=str(tmp_path), config="configs/x.yaml", set=[], run_dir=None, id="j1",
                              git_sha=None, module="ray_jobs.train", env=["PEAGLE_PROGRESS_EVERY_S=2"])
    multi_gpu.submit(opts)
    env = json.loads(calls[0][calls[0].index("--runtime-env-json") + 1])["env_vars"]
    assert env["PEAGLE_PROGRESS_EVERY_S"] == "2" and env["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5000"
    with pytest.raises(SystemExit, match="give KEY=VALUE"):
        multi_gpu.submit(argparse.Namespace(**{**vars(opts), "env": ["PEAGLE_PROGRESS_EVERY_S"]}))
    assert len(calls) == 1


def test_progress_rate_skips_the_compiling_steps_and_the_last_short_interval():
    from bench.report_per_gpu import progress_steps_per_s

    log = """[train] running
[train] 0/300 steps, - steps/s, 0m30s
[train] 1/300 steps, - steps/s, 1m00s
[train] 29/300 steps, 0.87 steps/s, ETA 5m11s, 1m30s
[train] 98/300 steps, 1.56 steps/s, ETA 2m09s, 2m00s
[train] 298/300 steps, 1.95 steps/s, ETA 0m01s, 3m30s
[train] 300/300 steps, 1.86 steps/s, ETA 0m00s, 3m39s
[train] done in 219.2s"""
    assert progress_steps_per_s(log) == (298 - 29) / 120
    assert progress_steps_per_s("[train] 5/9 steps, - steps/s, 0m30s\n[train] 9/9 steps, 1 steps/s, 0m40s") is None


def test_the_regeneration_reading_names_the_best_gpu_and_the_engines_a_gpu_side_by_side(monkeypatch):
    """The reading's best GPU is the fastest from first engine ready to last answer, over the GPUs its engines
    answered on; one machine's 1-GPU runs of 1, 2 and 3 engines a GPU are read side by side."""
    from bench import report_per_gpu as rmg

    def run(name: str, engines: int, per_gpu: int, gpus: int, tok_s: float, seconds: float) -> rmg.StageRun:
        outputs = {"tokens_per_s": tok_s, "decode_tokens_per_s": tok_s * engines,
                   "engines": [{"gpu": f"n/{i % gpus}", "start_s": 90.0 + 10 * i} for i in range(engines)]}
        record = {"job": {"sets": [f"regenerate.engines_per_gpu={per_gpu}"]},
                  "stage_records": {"regenerate": {"seconds": seconds}}}
        return rmg.StageRun(name, gpus, "NVIDIA H200", "1x NVIDIA H200, 2026-12-02 02:40" if gpus == 1
                            else "4x NVIDIA H200, 2026-11-29 19:17", outputs, record)

    runs = [run("r1x1", 1, 1, 1, 17_000, 320), run("r1x2", 2, 2, 1, 18_500, 255), run("r1x3", 3, 3, 1, 16_000, 240),
            run("r4x2", 8, 2, 4, 21_000, 133)]
    monkeypatch.setattr(rmg, "load", lambda name: {"vllm_sweep": [{"tokens_per_s": 20_000.0}]})
    lines: list[str] = []
    rmg.regen_reading(lines, runs)
    text = lines[0]
    assert "The best GPU decoded 48,000 tok/s" in text and "3 engines a GPU (`r1x3.json`; goal 45,000 a GPU: met)" in text
    assert "1 / 2 / 3 engines decoded 17,000 / 37,000 / 48,000 tok/s and the stage took 320 / 255 / 240 s" in text
