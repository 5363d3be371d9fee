"""The ``peagle`` command line (typer).

Flags are not a second copy of the config: every command takes a recipe (``--recipe FILE``) plus
``--set section.field=value`` overrides that are validated by the same pydantic schema, and
``peagle explain-config`` prints the schema's fields, defaults and descriptions. Choices (e.g.
``--dtype``) are derived from the schema's types.

Adding a sub-app is one line at the bottom: ``app.add_typer(registry_app, name="registry")``.
Heavy modules (torch, transformers, datasets, ray, mlflow) are imported inside commands only.
"""

from __future__ import annotations

import functools
import sys
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.console import Console
from rich.table import Table

from pipelines import recipe as recipe_mod

app = typer.Typer(
    name="peagle",
    help="Train, evaluate, version and serve P-EAGLE speculative-decoding heads on Ray.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
err_console = Console(stderr=True)

# Choices generated from the schema's Literal types.
DtypeChoice = Enum("DtypeChoice", {v: v for v in get_args(recipe_mod.Dtype)}, type=str)

# Shared options for every command that runs on a recipe (stage commands reuse these).
RecipeOpt = Annotated[
    Path | None,
    typer.Option("--recipe", "-c", help="YAML recipe (configs/*.yaml); default: the embedded SmolLM2 defaults.",
                 exists=False, dir_okay=False),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override a recipe field: section.field=value (YAML value), repeatable. "
                 "See `peagle explain-config`."),
]
HomeOpt = Annotated[
    Path | None, typer.Option("--home", help="PEAGLE_HOME (default $PEAGLE_HOME or ~/.cache/peagle).")
]


def fail_cleanly(fn):
    """Print ValueErrors (config / input mistakes) as one red message and exit 2, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except ValueError as e:
            err_console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
            raise typer.Exit(2) from None

    return wrapper


def recipe_from_cli(recipe: Path | None, overrides: list[str] | None) -> recipe_mod.Recipe:
    """The recipe a command runs on: ``recipe`` file (or the embedded defaults) plus overrides."""
    if recipe is None:
        return recipe_mod.recipe_from_dict({"name": "default"}, overrides, source="<defaults>")
    return recipe_mod.load_recipe(recipe, overrides)


# ---------------------------------------------------------------------------------------------- commands


@app.command()
@fail_cleanly
def assets(
    recipe: RecipeOpt = None,
    set_: SetOpt = None,
    dtype: Annotated[
        list[DtypeChoice] | None,
        typer.Option("--dtype", help="Target dtype(s) to materialize, repeatable; default: target.dtype."),
    ] = None,
    home: HomeOpt = None,
    verify: Annotated[bool, typer.Option(help="Re-hash every file of an existing target dir.")] = False,
    prompts: Annotated[bool, typer.Option(help="Also resolve and count the prompt sources.")] = True,
) -> None:
    """Materialize the target (HF safetensors dir, checksummed) and resolve the prompt sources."""
    from pipelines.assets import ensure_target

    r = recipe_from_cli(recipe, set_)
    dtypes = [d.value for d in dtype] if dtype else [r.target.dtype]
    table = Table(title=f"target {r.target.model}")
    for col in ("dtype", "directory", "sha256", "seconds"):
        table.add_column(col, overflow="fold")
    for dt in dict.fromkeys(dtypes):
        t0 = time.perf_counter()
        with console.status(f"materializing {r.target.model} ({dt}) ..."):
            asset = ensure_target(r.target.model, dt, home=home, verify=verify)
        table.add_row(dt, str(asset.path), asset.sha256, f"{time.perf_counter() - t0:.1f}")
    console.print(table)

    if prompts:
        from pipelines.prompts import load_conversations, source_file

        table = Table(title="prompt sources")
        for col in ("section", "kind", "file", "conversations", "seconds"):
            table.add_column(col, overflow="fold")
        seen = set()
        for section, sources in (("data", r.data.sources), ("evaluation", r.evaluation.sources)):
            for s in sources:
                key = (s.kind, s.path)
                if key in seen:
                    continue
                seen.add(key)
                t0 = time.perf_counter()
                path, _ = source_file(s)
                with console.status(f"loading {s.kind} ..."):
                    ds = load_conversations(s.model_copy(update={"num_samples": None}), r.data.on_bad_row, home)
                table.add_row(section, s.kind, str(path), str(len(ds)), f"{time.perf_counter() - t0:.1f}")
        console.print(table)


@app.command("validate-config")
@fail_cleanly
def validate_config(
    files: Annotated[list[Path], typer.Argument(help="Recipe YAML file(s).")],
    set_: SetOpt = None,
    show: Annotated[bool, typer.Option(help="Print the resolved recipe (all defaults filled in).")] = False,
    against_target: Annotated[
        bool, typer.Option(help="Also load the target's config and tokenizer (local or embedded) and check "
                           "the recipe against them (chat template, real layer count, vocab).")
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Validate recipe files against the schema (and optionally against the real target)."""
    bad = 0
    for f in files:
        try:
            r = recipe_mod.load_recipe(f, set_)
            if against_target:
                _check_against_target(r, home)
        except ValueError as e:
            bad += 1
            err_console.print(f"[red]✗[/] {e}", highlight=False)
            continue
        aux = r.resolved_aux_layer_ids()
        console.print(
            f"[green]✓[/] {f}: target={r.target.model} K={r.drafter.num_speculative_tokens} "
            f"mask_token_id={r.drafter.mask_token_id} aux_layer_ids={list(aux) if aux else 'from target'}",
            highlight=False,
        )
        if show:
            console.print(r.dump_resolved(), highlight=False, markup=False)
    if bad:
        raise typer.Exit(1)


def _check_against_target(r: recipe_mod.Recipe, home: Path | None) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from pipelines.assets import ensure_target

    asset = ensure_target(r.target.model, r.target.dtype, home=home)
    recipe_mod.validate_against_target(
        r, AutoConfig.from_pretrained(asset.path), AutoTokenizer.from_pretrained(asset.path)
    )


@app.command("explain-config")
def explain_config(
    section: Annotated[str | None, typer.Argument(help="Recipe section (e.g. training); default: all.")] = None,
) -> None:
    """List recipe fields with their types, defaults and descriptions (generated from the schema)."""
    sections = {name: f.annotation for name, f in recipe_mod.Recipe.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, recipe_mod.BaseModel)}
    if section is not None and section not in sections:
        err_console.print(f"[red]error:[/] unknown section {section!r}; choose from {sorted(sections)}")
        raise typer.Exit(2)
    for name, model in sections.items():
        if section is not None and name != section:
            continue
        table = Table(title=f"{name} ({model.__name__}): {(model.__doc__ or '').strip().splitlines()[0]}")
        for col in ("field", "type", "default", "description"):
            table.add_column(col, overflow="fold")
        for fname, field in model.model_fields.items():
            table.add_row(f"{name}.{fname}", _type_name(field.annotation), _default(field), field.description or "")
        console.print(table)


def _type_name(annotation: Any) -> str:
    return str(annotation).replace("typing.", "").replace("pipelines.recipe.", "").replace("<class '", "").replace(
        "'>", "")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return str([v.model_dump() if hasattr(v, "model_dump") else v for v in value]) if isinstance(
            value, list) else str(value)
    return "required" if field.is_required() else repr(field.default)


# ---------------------------------------------------------------------------------------------- sub-apps
# One line per stage app, e.g.:  app.add_typer(registry_app, name="registry")
from pipelines.register import registry_app  # light: typer only, mlflow is imported inside commands

app.add_typer(registry_app, name="registry")


def main() -> None:  # pragma: no cover - console entry point alternative
    app(prog_name="peagle")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
