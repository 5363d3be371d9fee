"""``peagle registry list|promote|rollback|download|server``: the MLflow model registry of peagle heads (and
a tracking server for a cluster: ``server start|stop``, :mod:`pipelines.registry.server`).

The store is ``--tracking-uri``, else ``$MLFLOW_TRACKING_URI``, else the local sqlite store
(``pipelines.settings.tracking_uri``), the same one the pipeline's register stage writes to.
Expected failures end with one ``error:`` line and exit 1 (2 for a malformed reference): an
unknown model, alias or version, a gate that keeps the champion, an unreachable tracking server.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

import typer

from pipelines import settings
from pipelines.cli.common import CommandError, JsonOpt, fail_cleanly, print_json
from pipelines.console import console

registry_app = typer.Typer(help="MLflow model registry of peagle heads (aliases champion / challenger).",
                           no_args_is_help=True)
URIOpt = Annotated[str | None, typer.Option(
    help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or sqlite:///$PEAGLE_HOME/mlflow.db).")]
REACH_TIMEOUT_S = 5.0


def registry_errors(fn):
    """Checks the tracking server first; MLflow's own errors (unknown model, alias, version) become
    one line (exit 1), ValueErrors exit 2 (via :func:`fail_cleanly`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from pipelines.console import configure

        configure()  # before mlflow is imported: no INFO lines about creating a local store
        from mlflow.exceptions import MlflowException

        check_reachable(settings.tracking_uri(kwargs.get("tracking_uri")))
        try:
            return fn(*args, **kwargs)
        except MlflowException as e:
            raise CommandError(str(e.message).strip().splitlines()[0]) from None

    return fail_cleanly(wrapper)


def check_reachable(uri: str) -> None:
    """An ``http(s)://`` tracking server must answer ``/health`` within ``REACH_TIMEOUT_S``
    (MLflow's client would otherwise retry for minutes).

    Raises:
        CommandError: the server does not answer.
    """
    if not uri.startswith(("http://", "https://")):
        return
    import httpx

    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise CommandError(f"MLflow tracking server {uri} is not reachable ({type(e).__name__}); start it or "
                           "pass --tracking-uri / set $MLFLOW_TRACKING_URI") from None


@registry_app.command("list")
@registry_errors
def list_cmd(
    model_name: Annotated[str | None, typer.Argument(help="Registered model; all when omitted.")] = None,
    tracking_uri: URIOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List registered head versions with aliases and acceptance lengths."""
    from rich.table import Table

    from pipelines.registry.register import list_versions

    rows = list_versions(model_name, tracking_uri=tracking_uri)
    if as_json:
        print_json(rows)
        return
    console.print(f"peagle registry: {settings.tracking_uri(tracking_uri)}", soft_wrap=True, highlight=False)
    table = Table()
    cols = ["name", "version", "aliases", "method", "eval_set", "K", "acceptance_length", "promotion_decision"]
    for c in cols:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*[str(r[c] or "") for c in cols])
    console.print(table)


@registry_app.command("promote")
@registry_errors
def promote_cmd(
    model_name: Annotated[str, typer.Argument(help="Registered model, e.g. peagle-smollm2-135m-instruct.")],
    version: Annotated[str | None, typer.Option(help="Version to promote (default: the challenger).")] = None,
    force: Annotated[bool, typer.Option(help="Skip the AL gate.")] = False,
    k: Annotated[int | None, typer.Option(
        "--k", help="Gate K (default: RegistryConfig.gate_num_speculative_tokens).")] = None,
    margin: Annotated[float | None, typer.Option(
        help="Gate margin in AL units (default: RegistryConfig.promote_margin).")] = None,
    tracking_uri: URIOpt = None,
) -> None:
    """Run the promotion gate on a version (or force it) and print the decision; exit 1 when the
    gate keeps the champion."""
    from pipelines.recipe import RegistryConfig
    from pipelines.registry.promotion import maybe_promote, promote
    from pipelines.registry.register import CHALLENGER, get_client

    defaults = RegistryConfig()
    if force:
        if version is None:
            version = str(get_client(tracking_uri).get_model_version_by_alias(model_name, CHALLENGER).version)
        d = promote(model_name, version, reason="forced by `peagle registry promote --force`",
                    tracking_uri=tracking_uri)
    else:
        d = maybe_promote(model_name, version, K=k or defaults.gate_num_speculative_tokens,
                          promote_margin=defaults.promote_margin if margin is None else margin,
                          tracking_uri=tracking_uri)
    if not d.promoted and not force:
        raise CommandError(f"not promoted, champion stays v{d.champion_version}: {d.reason}")
    typer.echo(f"{'PROMOTED' if d.promoted else 'KEPT'} champion=v{d.champion_version}: {d.reason}")


@registry_app.command("rollback")
@registry_errors
def rollback_cmd(
    model_name: Annotated[str, typer.Argument(help="Registered model.")],
    tracking_uri: URIOpt = None,
) -> None:
    """Move champion back to the previous champion."""
    from pipelines.registry.promotion import rollback

    mv = rollback(model_name, tracking_uri=tracking_uri)
    typer.echo(f"champion=v{mv.version}")


@registry_app.command("download")
@registry_errors
def download_cmd(
    ref: Annotated[str, typer.Argument(help="NAME@ALIAS, e.g. peagle-smollm2-135m-instruct@champion.")],
    dst: Annotated[Path, typer.Argument(help="Destination head directory (replaced after verification).")],
    tracking_uri: URIOpt = None,
) -> None:
    """Download a head by alias and verify its checksums and contract."""
    from pipelines.registry.register import download

    typer.echo(str(download(ref, dst, tracking_uri=tracking_uri)))


server_app = typer.Typer(help="A real MLflow tracking server for a cluster (SQLite store, served artifacts under "
                         "$PEAGLE_HOME/mlflow-server).", no_args_is_help=True)
registry_app.add_typer(server_app, name="server")


@server_app.command("start")
@fail_cleanly
def server_start_cmd(
    host: Annotated[str, typer.Option(help="Bind address (0.0.0.0: reachable from other nodes).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 5000,
) -> None:
    """Start `mlflow server` in the background unless it runs; print `export MLFLOW_TRACKING_URI=...`."""
    from pipelines.registry import server

    up = server.start(host=host, port=port)
    typer.echo(f"export {settings.TRACKING_URI_ENV}={up.uri}")


@server_app.command("stop")
@fail_cleanly
def server_stop_cmd() -> None:
    """Stop the server `peagle registry server start` started."""
    from pipelines.registry import server

    typer.echo("stopped" if server.stop() else f"no server recorded under {settings.mlflow_server_dir()}")
