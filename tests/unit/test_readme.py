"""README.md is the user's guide: at most 250 lines, its recipe snippets validate, its results block is what
``python -m bench.report`` generates, CI runs the test command it names, and every relative link in it and in the
docs points to a file (and heading) that exists."""

import re
from pathlib import Path

import pytest
import yaml

from bench import report_summary
from bench.report_fmt import anchor
from pipelines.recipe import recipe_from_dict

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, ROOT / "infra" / "README.md", ROOT / "bench" / "device" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def yaml_blocks(text: str) -> list[str]:
    return re.findall(r"^```yaml\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= 250, f"README.md has {n} lines; move details to docs/"


def test_every_yaml_recipe_in_the_readme_validates():
    blocks = yaml_blocks(README.read_text())
    assert blocks, "the README's walkthrough has a recipe"
    for block in blocks:
        recipe = recipe_from_dict(yaml.safe_load(block), source="README.md")
        assert recipe.target.model and recipe.data.sources and recipe.evaluation.sources


def test_the_walkthrough_reads_a_local_target_and_a_jsonl_of_prompts():
    recipe = recipe_from_dict(yaml.safe_load(yaml_blocks(README.read_text())[0]))
    assert recipe.target.embedded is None, "the walkthrough's target is the user's own model directory"
    assert [s.kind for s in recipe.data.sources] == ["openai_jsonl"]


def test_the_readme_results_are_generated_from_the_rows():
    assert report_summary.block_of(README.read_text()) == report_summary.readme_block(), (
        "README.md's results block is stale: run python -m bench.report")


def test_the_readme_names_the_commands_ci_runs():
    text = README.read_text()
    assert "make demo" in text and "make test" in text and "make unit" in text
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "make test", "CI runs exactly the README's test command"


def test_the_several_gpus_commands_name_what_exists():
    """Every ``python -m MODULE`` of the section imports, every ``configs/*.yaml`` is there, and the ``local_ray``
    and ``peagle registry server`` subcommands it uses are commands of those CLIs."""
    import importlib.util
    import re

    from typer.testing import CliRunner

    from pipelines.cli import app
    from pipelines.local_ray import cli as local_ray_cli

    text = README.read_text()
    section = text.split("## Running on several GPUs\n", 1)[1].split("\n## ", 1)[0]
    modules = set(re.findall(r"python -m\s+([\w.]+)", section))
    assert {"pipelines.local_ray", "ray_jobs.pipeline", "bench.multi_gpu", "bench.serve_autoscale"} <= modules
    assert all(importlib.util.find_spec(m) is not None for m in modules), modules
    for path in re.findall(r"configs/[\w.-]+\.yaml", section):
        assert (README.parent / path).is_file(), path
    runner = CliRunner()
    for sub in set(re.findall(r"python -m pipelines\.local_ray (\w[\w-]*)", section)):
        assert runner.invoke(local_ray_cli, [sub, "--help"]).exit_code == 0, sub
    assert runner.invoke(app, ["registry", "server", "start", "--help"]).exit_code == 0


def _headings(path: Path) -> set[str]:
    return {anchor(ln) for ln in path.read_text().splitlines() if re.match(r"#{1,6} ", ln)}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_relative_links_point_to_files_and_headings_that_exist(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.DOTALL)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, frag = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        assert dest.exists(), f"{doc.relative_to(ROOT)}: link to {target}: no such file"
        if frag and dest.suffix == ".md":
            assert frag in _headings(dest), f"{doc.relative_to(ROOT)}: link to {target}: no such heading"
