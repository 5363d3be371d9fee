"""The ``peagle`` command line (typer): one app, one command per job.

::

    peagle run --config FILE [--stage NAME ...] [--force] [--set k=v ...] [--run-dir DIR] [--verbose]
    peagle assets [--config FILE] [--dtype D ...] [--json]
    peagle validate-config FILE... [--against-target] [--show]
    peagle explain-config [SECTION]
    peagle registry list|promote|rollback|download [--tracking-uri URI] [--json]
    peagle head upgrade DIR

``run`` lives in ``run.py`` (the ``ray_jobs/*.py`` entrypoints are ``run`` with fixed stages), the
recipe commands in ``recipes.py``, the registry in ``registry.py``, head directories in ``head.py``,
shared options and the one-line error handling in ``common.py``. Heavy modules (torch, transformers, datasets, ray, mlflow) are
imported inside commands only, so ``peagle --help`` is instant.
"""

from __future__ import annotations

import typer
import typer.core

from pipelines.cli import recipes
from pipelines.cli.head import head_app
from pipelines.cli.registry import registry_app
from pipelines.cli.run import run_cmd

_display_type_rich = getattr(typer.core.TyperOption, "display_type_rich", None)


def _no_type_for_flags(self, ctx):
    """typer 0.29 prints ``<bool>`` beside every flag (``--help <bool>``); a flag takes no value: no type."""
    return None if self.is_flag else _display_type_rich(self, ctx)


if _display_type_rich is not None:  # other typer releases (e.g. a GPU image's) lack the hook and the noise
    typer.core.TyperOption.display_type_rich = _no_type_for_flags

app = typer.Typer(
    name="peagle",
    help="Train, evaluate, version and serve P-EAGLE speculative-decoding heads on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("run")(run_cmd)
app.command("assets")(recipes.assets)
app.command("validate-config")(recipes.validate_config)
app.command("explain-config")(recipes.explain_config)
app.add_typer(registry_app, name="registry")
app.add_typer(head_app, name="head")


def main() -> None:  # pragma: no cover - console entry point alternative
    app(prog_name="peagle")
