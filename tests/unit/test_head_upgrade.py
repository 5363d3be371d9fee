"""A head for the vLLM that loads it: evaluate and serve check the installed release's mask-token keys (one helper
asks importlib.metadata), and `peagle head upgrade` fixes a head exported before the keys of every release."""

import json

import pytest

from .conftest import make_drafter

pytestmark = pytest.mark.unit


@pytest.fixture
def old_head(tmp_path):
    """A P-EAGLE head exported before ptd_token_id was written (config.json has only mask_token_id)."""
    from peagle_core.contract import export_head, write_checksums

    head = export_head(make_drafter(), tmp_path / "head", dtype="float32")
    cfg = json.loads((head / "config.json").read_text())
    del cfg["ptd_token_id"]
    (head / "config.json").write_text(json.dumps(cfg))
    write_checksums(head)
    return head


@pytest.mark.parametrize("caller", ["evaluate", "serve"])
def test_callers_check_heads_for_the_installed_vllm(caller, old_head, monkeypatch):
    """evaluate and serve validate a head for the vLLM installed where it is loaded (one helper asks
    importlib.metadata): an old head loads in 0.32 and is refused, with the command that fixes it, by 0.26."""
    from peagle_core.contract import HeadContractError, upgrade_head
    from pipelines import preflight
    from pipelines.evaluate import measure as evaluate
    from pipelines.serve import heads

    def check():
        if caller == "evaluate":
            evaluate._check_inputs([[1, 2]], {"peagle": old_head})
        else:
            assert heads.fetch_head(str(old_head)) == old_head

    monkeypatch.setattr(preflight, "installed_vllm_version", lambda: "0.32.0+cpu")
    check()
    monkeypatch.setattr(preflight, "installed_vllm_version", lambda: "0.26.0")
    with pytest.raises(HeadContractError, match=r"vLLM 0.26 reads it from \['ptd_token_id', 'pard_token'\].*"
                       "`peagle head upgrade HEAD_DIR`"):
        check()
    assert upgrade_head(old_head) == ["ptd_token_id"]
    check()


def test_head_upgrade_command(old_head):
    from typer.testing import CliRunner

    from pipelines.cli import app

    out = CliRunner().invoke(app, ["head", "upgrade", str(old_head)])
    assert out.exit_code == 0 and "added ['ptd_token_id']; valid for vllm>=0.26,<0.34" in out.output
    assert json.loads((old_head / "config.json").read_text())["ptd_token_id"] == 97
    assert "nothing to add" in CliRunner().invoke(app, ["head", "upgrade", str(old_head)]).output
    (old_head / "config.json").write_text("{}")  # edited after its export: refused, nothing rewritten
    bad = CliRunner().invoke(app, ["head", "upgrade", str(old_head)])
    assert bad.exit_code == 1 and "sha256" in bad.output
