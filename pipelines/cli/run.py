"""``peagle run``: the pipeline from one recipe (also behind ``python -m ray_jobs.<stage>``).

::

    peagle run --config FILE [--stage NAME ...] [--force] [--set k=v ...] [--run-dir DIR] [--verbose]

Stages run in pipeline order; one stage alone reads its upstream stage's outputs from the run
directory. ``--force`` re-runs the selected stages even when their outputs are current. Quiet by
default (``pipelines.console``); ``--verbose`` streams Ray and vLLM output.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from pipelines.cli.common import SetOpt, fail_cleanly
from pipelines.pipeline import STAGES

StageChoice = Enum("StageChoice", {s: s for s in STAGES}, type=str)

RequiredConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="YAML recipe (configs/*.yaml).",
                                                 dir_okay=False)]
ForceOpt = Annotated[bool, typer.Option("--force", help="Re-run the stage(s) even when their outputs are current.")]
RunDirOpt = Annotated[Path | None, typer.Option("--run-dir", help="Run directory (default "
                                                "$PEAGLE_HOME/runs/<recipe name>).", file_okay=False)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Stream Ray/vLLM worker output and INFO logs.")]


def run_pipeline(config: Path, stages: Sequence[str], *, force: bool = False, overrides: list[str] | None = None,
                 run_dir: Path | None = None, verbose: bool = False) -> dict:
    """Load the recipe, run ``stages`` (``PipelineRun``), print the summary; return it.

    Raises:
        ValueError: a config mistake or a missing upstream output (before any compute).
    """
    from pipelines import console

    console.configure(verbose)
    from pipelines.pipeline import PipelineRun, print_summary
    from pipelines.recipe import load_recipe

    recipe = load_recipe(config, overrides)
    run = PipelineRun(recipe, run_dir=run_dir, force=list(stages) if force else (), stages=stages, verbose=verbose,
                      say=lambda line: console.console.print(line, soft_wrap=True, highlight=False, markup=False))
    summary = run.run()
    print_summary(summary, console.console)
    return summary


@fail_cleanly
def run_cmd(
    config: RequiredConfigOpt,
    stage: Annotated[list[StageChoice] | None, typer.Option(
        "--stage", help="Run only this stage (repeatable; default: all, in pipeline order).")] = None,
    force: ForceOpt = False,
    set_: SetOpt = None,
    run_dir: RunDirOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Run the pipeline (regenerate, capture, train, evaluate, register, serve) from a recipe."""
    run_pipeline(config, [s.value for s in stage] if stage else STAGES, force=force, overrides=set_,
                 run_dir=run_dir, verbose=verbose)


def stage_app(stages: Sequence[str]) -> typer.Typer:
    """``peagle run`` for fixed ``stages``, without ``--stage``: the command of the Ray job entrypoints."""

    @fail_cleanly
    def job(config: RequiredConfigOpt, force: ForceOpt = False, set_: SetOpt = None, run_dir: RunDirOpt = None,
            verbose: VerboseOpt = False) -> None:
        run_pipeline(config, stages, force=force, overrides=set_, run_dir=run_dir, verbose=verbose)

    job.__doc__ = f"peagle stage(s) {', '.join(stages)}: `peagle run` with these stages."
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(job)
    return app


def stage_job(stages: Sequence[str], prog: str) -> None:
    """``python -m ray_jobs.<name> --config FILE [--force] [--set k=v] [--run-dir DIR] [--verbose]``
    (exits the process)."""
    stage_app(stages)(prog_name=f"python -m {prog}")
