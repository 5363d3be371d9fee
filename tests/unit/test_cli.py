"""The ``peagle`` command line without Ray: help, flags, one-line errors and exit codes."""

import json

import pytest
from typer.testing import CliRunner

from pipelines.cli import app
from pipelines.cli.run import stage_app
from pipelines.ports import free_port
from tests.conftest import CONFIGS

pytestmark = pytest.mark.unit

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def one_error_line(result) -> str:
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:") and "Traceback" not in result.output
    return lines[0]


def error_message(result) -> str:
    """A config mistake: ``error:`` then one line per offending field, no traceback."""
    assert result.output.startswith("error:") and "Traceback" not in result.output, result.output
    return result.output


def test_run_help_lists_the_flags():
    res = invoke("run", "--help")
    assert res.exit_code == 0, res.output
    for flag in ("--config", "--stage", "--force", "--set", "--run-dir", "--verbose"):
        assert flag in res.output
    assert "<bool>" not in res.output  # a flag takes no value: no type beside it
    assert "<file>" in res.output  # options with a value keep theirs


def test_python_m_pipelines_cli_is_the_peagle_command():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "validate-config" in proc.stdout and "registry" in proc.stdout


def test_ray_job_entrypoints_take_the_same_flags_without_stage():
    res = runner.invoke(stage_app(["capture"]), ["--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for flag in ("--config", "--force", "--set", "--run-dir", "--verbose"):
        assert flag in res.output
    assert "--stage" not in res.output


def test_run_rejects_an_unknown_stage():
    res = invoke("run", "--config", str(CONFIGS / "smollm2-135m-ci.yaml"), "--stage", "trian")
    assert res.exit_code == 2 and "trian" in res.output


def test_run_config_mistakes_exit_2_without_traceback(tmp_path):
    res = invoke("run", "--config", str(tmp_path / "missing.yaml"))
    assert res.exit_code == 2
    assert "does not exist" in one_error_line(res)
    res = invoke("run", "--config", str(CONFIGS / "smollm2-135m-ci.yaml"), "--set", "training.lr=-1")
    assert res.exit_code == 2
    assert "training.lr" in error_message(res)


def test_run_refuses_what_this_machine_cannot_run_before_ray(monkeypatch):
    from pipelines import console

    monkeypatch.setattr(console, "init_ray", lambda **kw: pytest.fail("Ray started"))
    res = runner.invoke(app, ["run", "--config", str(CONFIGS / "smollm2-135m-ci.yaml"), "--set", "training.use_gpu=true",
                              "--set", "training.num_workers=64"], env={"COLUMNS": "200", "RAY_ADDRESS": "local"})
    assert res.exit_code == 2
    assert "[train] training.use_gpu=true: the train stage needs 64 CUDA GPUs" in error_message(res)


def test_help_imports_no_torch():
    """`peagle --help` stays instant: torch, ray, mlflow are imported inside commands only."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = "import sys, pipelines.cli; print(sorted({'torch', 'ray', 'mlflow', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_assets_takes_config_and_the_old_recipe_flag():
    for flag in ("--config", "--recipe"):
        res = invoke("assets", flag, str(CONFIGS / "smollm2-135m-ci.yaml"), "--set", "target.dtype=float8")
        assert res.exit_code == 2 and "target.dtype" in error_message(res)
    res = invoke("assets", "--help")
    assert "--config" in res.output and "--json" in res.output and "--recipe" not in res.output


@pytest.fixture(scope="module")
def store(module_mktemp):
    """An empty local MLflow registry (sqlite); created once, outside the commands under test."""
    from pipelines.registry.register import get_client

    uri = f"sqlite:///{module_mktemp('mlflow') / 'mlflow.db'}"
    get_client(uri).search_registered_models()
    return uri


def test_registry_list_json_on_an_empty_store(store):
    res = invoke("registry", "list", "--tracking-uri", store, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == []


@pytest.mark.parametrize("args", [
    ["promote", "peagle-nosuch"],
    ["promote", "peagle-nosuch", "--force"],
    ["rollback", "peagle-nosuch"],
    ["download", "peagle-nosuch@champion", "DST"],
    ["list", "peagle-nosuch"],
])
def test_registry_unknown_model_is_one_line(store, args, tmp_path):
    args = [str(tmp_path / "head") if a == "DST" else a for a in args]
    res = invoke("registry", *args, "--tracking-uri", store)
    assert res.exit_code == 1, res.output
    assert "peagle-nosuch" in one_error_line(res)


def test_registry_bad_reference_is_one_line(store, tmp_path):
    res = invoke("registry", "download", "peagle-nosuch", str(tmp_path / "head"), "--tracking-uri", store)
    assert res.exit_code == 2
    assert "NAME@ALIAS" in one_error_line(res)


def test_registry_unreachable_server_is_one_line():
    port = free_port()  # nothing listens there
    res = invoke("registry", "list", "--tracking-uri", f"http://127.0.0.1:{port}")
    assert res.exit_code == 1
    assert "not reachable" in one_error_line(res)
