"""The register stage under a tracking-server outage (issue 15, item 4): a real ``mlflow server`` (sqlite
backend, loopback; ``MlflowServer`` of serve_helpers) is SIGKILLed and restarted on the same store.

The stage runs for real (``RegisterStage.run``: MLflow run, head artifacts, model version, gate) on a
tiny random head, with its upstream outputs handed over by a small ``RunContext``; only the target's
config is the tiny test target's instead of SmolLM2's (no target download). A stage output that is
never written is an interrupted register: the re-run must find what the first one registered."""

import signal
import time
from pathlib import Path

import pytest

from pipelines.recipe import load_recipe
from pipelines.registry import client as mlflow_client
from pipelines.registry import register as reg
from pipelines.stages.capture import CaptureOutput
from pipelines.stages.evaluate import EvaluateOutput
from pipelines.stages.register import RegisterStage
from pipelines.stages.train import TrainOutput
from tests.integration.serve_helpers import MlflowServer
from tests.integration.test_register import TARGET, _head

pytestmark = pytest.mark.integration

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EVAL_SET = "humaneval"


class Ctx:
    """The ``RunContext`` the register stage sees: the CI recipe, a run dir, fixed upstream outputs."""

    def __init__(self, run_dir: Path, uri: str, key: str, head: Path) -> None:
        self.recipe = load_recipe(CONFIGS / "smollm2-135m-ci.yaml")
        self.run_dir, self.tracking_uri, self._key = run_dir, uri, key
        self.model_name = "peagle-faults-register"
        self.records, self.verbose, self.lines = {}, False, []
        r = self.recipe
        K, c, method = r.registry.gate_num_speculative_tokens, min(r.evaluation.concurrency_sweep), r.training.method
        rows = [{"method": "none", "K": 0, "concurrency": c, "tokens_per_s": 10.0, "eval_set": EVAL_SET},
                {"method": method, "K": K, "concurrency": c, "acceptance_length": 2.0, "tokens_per_s": 12.0,
                 "eval_set": EVAL_SET}]
        ev_dir = self.stage_dir("evaluate")
        ev_dir.mkdir(parents=True, exist_ok=True)
        (ev_dir / "table.md").write_text("| method | K |\n")
        self._outputs = {
            TrainOutput: TrainOutput(head_dir=str(head), step=4, history=[{"step": s, "loss": 3.0 - s / 4}
                                                                            for s in (1, 2, 3, 4)]),
            EvaluateOutput: EvaluateOutput(table=str(ev_dir / "table.md"), rows=rows, eval_set=EVAL_SET,
                                           best_K={method: {str(c): K}}),
            CaptureOutput: CaptureOutput(streaming=True, num_conversations=4),
        }

    def key(self, name: str) -> str:
        return self._key

    def stage_dir(self, name: str) -> Path:
        return self.run_dir / name

    def upstream(self, output_type):
        return self._outputs[output_type]

    def say(self, message: str) -> None:
        self.lines.append(message)


def _keyed(client, name: str, key: str) -> tuple[list, list]:
    """Versions of ``name`` and runs of the pipeline experiment tagged with stage key ``key``."""
    from pipelines import settings

    clause = f"tags.`{reg.PIPELINE_KEY_TAG}` = '{key}'"
    versions = client.search_model_versions(f"name = '{name}' AND {clause}")
    exp = client.get_experiment_by_name(settings.EXPERIMENT)
    return versions, client.search_runs([exp.experiment_id], filter_string=clause)


@pytest.fixture
def server(tmp_path, monkeypatch):
    import pipelines.assets

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    for k in mlflow_client.BOUNDED_HTTP_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipelines.assets, "resolve_target", lambda target_cfg: (None, TARGET))
    s = MlflowServer(tmp_path / "mlflow-server")
    s.start()
    yield s
    s.stop()


def test_register_outage_then_rerun_registers_once(server, tmp_path):
    up_s = server.wait_healthy()
    head = _head(tmp_path / "head", seed=3)
    ctx = Ctx(tmp_path / "run", server.uri, "a" * 64, head)
    stage = RegisterStage(ctx)
    client = reg.get_client(server.uri)

    # 1. A register that never wrote its output (interrupted after the gate).
    first = stage.run()
    assert first.promoted and first.version == "1"

    # 2. The server dies inside a guarded call: one line, in seconds (MLflow alone retries for minutes).
    with pytest.raises(reg.TrackingUnreachableError) as down_mid, reg.tracking_guard(server.uri, hint="later"):
        client.get_model_version(ctx.model_name, first.version)  # the server answers ...
        server.stop(signal.SIGKILL)
        t0 = time.monotonic()
        client.search_model_versions(f"name = '{ctx.model_name}'")  # ... then is gone
    mid_s = time.monotonic() - t0
    assert "lost during the call" in str(down_mid.value) and server.uri in str(down_mid.value)

    # 3. The register stage (and its validity check) against the dead server: a clear error, fast.
    t0 = time.monotonic()
    with pytest.raises(reg.TrackingUnreachableError) as down:
        stage.run()
    run_s = time.monotonic() - t0
    t0 = time.monotonic()
    with pytest.raises(reg.TrackingUnreachableError):
        stage.is_valid(first)
    valid_s = time.monotonic() - t0
    msg = str(down.value)
    assert server.uri in msg and "registers nothing twice" in msg and "\n" not in msg
    assert run_s < 60 and valid_s < 60 and mid_s < 60
    assert (ctx.stage_dir("evaluate") / "table.md").is_file()  # earlier stages' outputs untouched

    # 4. Back on the same store: the re-run reuses version 1 and its run, and its recorded decision.
    server.start()
    back_s = server.wait_healthy()
    again = stage.run()
    assert (again.version, again.run_id, again.promoted) == (first.version, first.run_id, first.promoted)
    assert any("reusing it" in line for line in ctx.lines)
    versions, runs = _keyed(client, ctx.model_name, ctx.key("register"))
    assert [str(v.version) for v in versions] == ["1"] and [r.info.run_id for r in runs] == [first.run_id]
    assert stage.is_valid(again)

    # 5. Interrupted between the run and the version (another key): the run is continued, not duplicated.
    ctx2 = Ctx(tmp_path / "run2", server.uri, "b" * 64, head)
    stage2 = RegisterStage(ctx2)
    orphan = stage2._log_run(ctx2.upstream(TrainOutput), ctx2.upstream(EvaluateOutput))
    out2 = stage2.run()
    versions, runs = _keyed(client, ctx.model_name, ctx2.key("register"))
    assert out2.run_id == orphan and [str(v.version) for v in versions] == [out2.version] == ["2"]
    assert [r.info.run_id for r in runs] == [orphan]
    assert sorted(m.step for m in client.get_metric_history(orphan, "loss")) == [1, 2, 3, 4]  # no point twice
    # 6. A head retrained under the first key (--force) is a new version with its own run.
    retrained = RegisterStage(Ctx(tmp_path / "run", server.uri, "a" * 64, _head(tmp_path / "head2", seed=4))).run()
    assert retrained.version == "3" and retrained.run_id not in (first.run_id, orphan)
    assert len(client.search_model_versions(f"name = '{ctx.model_name}'")) == 3
    print(f"\nserver up {up_s:.0f} s; killed mid-call -> error in {mid_s:.1f} s; stage against the dead server "
          f"-> error in {run_s:.1f} s, validity check {valid_s:.1f} s; restart {back_s:.0f} s; re-run reused v1; "
          f"1 version and 1 run per key")
