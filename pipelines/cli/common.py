"""Options and error handling shared by the ``peagle`` commands.

Every command that runs on a recipe takes ``--config FILE`` (``--recipe`` is a hidden alias kept
for old scripts) plus ``--set section.field=value`` overrides validated by the recipe schema;
commands that report state take ``--json``. Expected failures (a config mistake, an unknown model
or alias, a gate refusal, an unreachable tracking server) end with an ``error:`` message (one line;
a recipe error adds one line per offending field) and a non-zero exit code, never a traceback: 2 for
a usage or config mistake, 1 for the rest.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from pipelines import recipe as recipe_mod
from pipelines.console import err_console

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML recipe (configs/*.yaml); default: the embedded SmolLM2 defaults.",
                 dir_okay=False),
]
LegacyRecipeOpt = Annotated[Path | None, typer.Option("--recipe", hidden=True, dir_okay=False)]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a recipe field: section.field=value (YAML value), repeatable. "
                 "See `peagle explain-config`."),
]
HomeOpt = Annotated[
    Path | None, typer.Option("--home", help="PEAGLE_HOME (default $PEAGLE_HOME or ~/.cache/peagle).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of text.")]


class CommandError(Exception):
    """An expected failure of a command: printed as one ``error:`` line, exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def fail(message: str, code: int) -> typer.Exit:
    """Print ``error: message`` on stderr (a recipe error lists one offending field per line); return
    the Exit to raise."""
    err_console.print("[bold red]error:[/] ", markup=True, highlight=False, end="")
    err_console.print(str(message).strip() or "failed", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def fail_cleanly(fn):
    """ValueErrors (config / input mistakes) exit 2 and :class:`CommandError` its code, each as one line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            raise fail(str(e), 2) from None
        except CommandError as e:
            raise fail(str(e), e.code) from None

    return wrapper


def recipe_from_cli(config: Path | None, overrides: list[str] | None) -> recipe_mod.Recipe:
    """The recipe a command runs on: ``config`` file (or the embedded defaults) plus overrides."""
    if config is None:
        return recipe_mod.recipe_from_dict({"name": "default"}, overrides, source="<defaults>")
    return recipe_mod.load_recipe(config, overrides)


def print_json(data: Any) -> None:
    """``data`` as indented JSON on stdout (nothing else goes to stdout with ``--json``)."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
