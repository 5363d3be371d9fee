"""``peagle assets``, ``peagle validate-config``, ``peagle explain-config``: the recipe and what it names.

Flags are not a second copy of the config: ``explain-config`` prints the schema's fields, defaults
and descriptions, and choices (e.g. ``--dtype``) come from the schema's types.
"""

from __future__ import annotations

import re
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from rich.table import Table

from pipelines import recipe as recipe_mod
from pipelines.cli.common import (
    ConfigOpt,
    HomeOpt,
    JsonOpt,
    LegacyRecipeOpt,
    SetOpt,
    fail_cleanly,
    print_json,
    recipe_from_cli,
)
from pipelines.console import console, err_console

DtypeChoice = Enum("DtypeChoice", {v: v for v in get_args(recipe_mod.Dtype)}, type=str)


@fail_cleanly
def assets(
    config: ConfigOpt = None,
    recipe: LegacyRecipeOpt = None,
    set_: SetOpt = None,
    dtype: Annotated[
        list[DtypeChoice] | None,
        typer.Option("--dtype", help="Target dtype(s) to materialize, repeatable; default: target.dtype."),
    ] = None,
    home: HomeOpt = None,
    verify: Annotated[bool, typer.Option(help="Re-hash every file of an existing target dir.")] = False,
    prompts: Annotated[bool, typer.Option(help="Also resolve and count the prompt sources.")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Materialize the target (HF safetensors dir, checksummed) and resolve the prompt sources.

    One line per target dtype (directory, sha256) and per prompt source (file, conversations),
    never wrapped, so paths and checksums can be copied.
    """
    from pipelines import console as console_mod
    from pipelines.assets import ensure_target

    console_mod.configure()
    r = recipe_from_cli(config or recipe, set_)
    report: dict[str, Any] = {"target": r.target.model, "targets": [], "sources": []}
    for dt in dict.fromkeys([d.value for d in dtype] if dtype else [r.target.dtype]):
        t0 = time.perf_counter()
        with err_console.status(f"materializing {r.target.model} ({dt}) ..."):
            asset = ensure_target(r.target.model, dt, home=home, verify=verify)
        row = {"dtype": dt, "path": str(asset.path), "sha256": asset.sha256, "seconds": round(time.perf_counter() - t0, 1)}
        report["targets"].append(row)
        _line(as_json, f"target {r.target.model} {dt}: {row['path']}  sha256 {row['sha256']}  ({row['seconds']}s)")
    if prompts:
        report["sources"] = _sources(r, home, as_json)
    if as_json:
        print_json(report)


def _sources(r: recipe_mod.Recipe, home: Path | None, as_json: bool) -> list[dict[str, Any]]:
    from pipelines.data.prompts import load_conversations, source_file

    rows, seen = [], set()
    for section, sources in (("data", r.data.sources), ("evaluation", r.evaluation.sources)):
        for s in sources:
            if (s.kind, s.path) in seen:
                continue
            seen.add((s.kind, s.path))
            if s.kind == "self_instruct":  # no file: the target writes these prompts in the regenerate stage
                rows.append({"section": section, "kind": s.kind, "path": None, "num_conversations": None,
                             "num_prompts": s.self_instruct.num_prompts, "seconds": 0.0})
                _line(as_json, f"{section} source self_instruct: written by the target in the regenerate stage "
                               f"({s.self_instruct.num_prompts} prompts asked)")
                continue
            t0 = time.perf_counter()
            path, _ = source_file(s)
            with err_console.status(f"loading {s.kind} ..."):
                ds = load_conversations(s.model_copy(update={"num_samples": None}), r.data.on_bad_row, home)
            row = {"section": section, "kind": s.kind, "path": str(path), "num_conversations": len(ds),
                   "seconds": round(time.perf_counter() - t0, 1)}
            rows.append(row)
            _line(as_json, f"{section} source {s.kind}: {row['path']}  {len(ds)} conversations  ({row['seconds']}s)")
    return rows


def _line(as_json: bool, text: str) -> None:
    if not as_json:
        console.print(text, soft_wrap=True, highlight=False, markup=False)


@fail_cleanly
def validate_config(
    files: Annotated[list[Path], typer.Argument(help="Recipe YAML file(s).")],
    set_: SetOpt = None,
    show: Annotated[bool, typer.Option(help="Print the resolved recipe (all defaults filled in).")] = False,
    against_target: Annotated[
        bool, typer.Option(help="Also load the target's config and tokenizer (local or embedded) and check "
                           "the recipe against them (chat template, real layer count, vocab).")
    ] = False,
    here: Annotated[
        bool, typer.Option("--here", help="Also run the pipeline's pre-flight against this machine (vLLM, MLflow, "
                           "CUDA GPUs, source files, env vars): errors as `peagle run` would raise them, and "
                           "the stages it would report as not run.")
    ] = False,
    home: HomeOpt = None,
) -> None:
    """Validate recipe files against the schema and the pre-flight's checks that hold on any machine
    (optionally against this machine and the real target)."""
    from pipelines.pipeline import not_runnable, preflight
    from pipelines.preflight import Machine, raise_for_errors

    bad = 0
    for f in files:
        try:
            r = recipe_mod.load_recipe(f, set_)
            problems = preflight(r, machine=Machine.probe() if here else Machine.ideal())
            raise_for_errors(problems, r.name)
            if against_target:
                _check_against_target(r, home)
        except ValueError as e:
            bad += 1
            err_console.print("[red]✗[/] ", highlight=False, end="")
            err_console.print(f"{f}: {e}", highlight=False, markup=False)
            continue
        aux = r.resolved_aux_layer_ids()
        console.print(
            f"[green]✓[/] {f}: target={r.target.model} K={r.drafter.num_speculative_tokens} "
            f"mask_token_id={r.drafter.mask_token_id} aux_layer_ids={list(aux) if aux else 'from target'}",
            highlight=False,
        )
        for stage, reason in not_runnable(problems).items():
            console.print(f"  {stage} not run here: {reason}", highlight=False, markup=False)
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


def explain_config(
    section: Annotated[str | None, typer.Argument(help="Recipe section (e.g. training); default: all.")] = None,
) -> None:
    """List recipe fields with their types, defaults and descriptions (generated from the schema)."""
    from pipelines.cli.common import fail

    sections = {name: f.annotation for name, f in recipe_mod.Recipe.model_fields.items()
                if isinstance(f.annotation, type) and issubclass(f.annotation, recipe_mod.Section)}
    if section is not None and section not in sections:
        raise fail(f"unknown section {section!r}; choose from {sorted(sections)}", 2)
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
    name = re.sub(r"pipelines\.recipe\.\w+\.", "", str(annotation))  # a section class's module path
    return name.replace("typing.", "").replace("<class '", "").replace("'>", "")


def _default(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return str([v.model_dump() if hasattr(v, "model_dump") else v for v in value]) if isinstance(
            value, list) else str(value)
    return "required" if field.is_required() else repr(field.default)
