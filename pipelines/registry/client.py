"""The MLflow client of the tracking store, and :func:`tracking_guard` for a server that may be down.

Tracking store: ``RegistryConfig.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else
``sqlite:///$PEAGLE_HOME/mlflow.db`` with artifacts under ``$PEAGLE_HOME/mlartifacts``
(``pipelines.settings.tracking_uri``). Outages (issue 15): :func:`tracking_guard` probes an
``http(s)://`` server first, bounds MLflow's own HTTP retries (minutes by default) and turns a failure
while the server is down into one :class:`TrackingUnreachableError` line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from pipelines import settings

# tracking_guard: the /health probe of an http(s) store, and MLflow's HTTP retries while inside it
# (environment variables of mlflow.environment_variables; set only where the user has not set them).
REACH_TIMEOUT_S = 5.0
REACH_ATTEMPTS = 3  # probes 1 s apart: a refused connection fails in ~2 s, a silent host in ~17 s
BOUNDED_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",  # MLflow default 7 (~4 min of backoff)
                    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60"}  # s per request; MLflow default 120


def get_client(tracking_uri: str | None = None):
    """An ``MlflowClient`` on the resolved tracking URI (the registry uses the same store).

    Also points the ``mlflow`` fluent API at it (``download_artifacts`` of ``models:/`` URIs uses it).
    The directory of a local sqlite store is created.
    """
    import mlflow
    from mlflow import MlflowClient

    uri = settings.tracking_uri(tracking_uri)
    d = settings.local_sqlite_dir(uri)
    if d is not None:
        d.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _experiment_id(client, name: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    d = settings.local_sqlite_dir(client.tracking_uri)
    # A local store keeps its artifacts beside the database (MLflow's default is ./mlruns of the cwd).
    location = (d / "mlartifacts" / name).as_uri() if d is not None else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # created concurrently by another process
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class TrackingUnreachableError(ConnectionError):
    """The MLflow tracking server of an ``http(s)://`` tracking URI does not answer (message: one line)."""


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _answers(uri: str) -> bool:
    """Whether ``uri``'s ``/health`` answers at all (any status) within :data:`REACH_ATTEMPTS` tries."""
    import httpx

    for attempt in range(REACH_ATTEMPTS):
        if attempt:
            time.sleep(1.0)
        try:
            httpx.get(uri.rstrip("/") + "/health", timeout=REACH_TIMEOUT_S)
            return True
        except httpx.HTTPError:
            pass
    return False


@contextmanager
def _bounded_http_retries() -> Iterator[None]:
    """:data:`BOUNDED_HTTP_ENV` in ``os.environ`` while inside (variables already set are left alone).
    Process-wide: MLflow reads them per request."""
    added = {k: v for k, v in BOUNDED_HTTP_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


@contextmanager
def tracking_guard(tracking_uri: str | None = None, *, hint: str = "start it and re-run") -> Iterator[str]:
    """Run MLflow calls against an ``http(s)://`` store that may be down; yields the resolved URI.

    Before: the server's ``/health`` is probed (:data:`REACH_ATTEMPTS` x :data:`REACH_TIMEOUT_S`).
    Inside: MLflow's own HTTP retries are bounded (:data:`BOUNDED_HTTP_ENV`; MLflow's defaults retry
    for minutes). An exception raised inside while the server no longer answers becomes a
    :class:`TrackingUnreachableError` (the original is its ``__cause__``); other exceptions pass. A
    local (sqlite) store is used as is.

    Args:
        hint: the end of the error line: what to do (e.g. what a re-run will do).

    Raises:
        TrackingUnreachableError: "MLflow tracking server <uri> is not reachable (<cause>); <hint>".
    """
    uri = settings.tracking_uri(tracking_uri)
    if not _is_http(uri):
        yield uri
        return

    def unreachable(cause: str) -> TrackingUnreachableError:
        return TrackingUnreachableError(f"MLflow tracking server {uri} is not reachable ({cause}); {hint}")

    if not _answers(uri):
        raise unreachable(f"no answer from /health in {REACH_ATTEMPTS} tries")
    with _bounded_http_retries():
        try:
            yield uri
        except TrackingUnreachableError:
            raise
        except Exception as e:
            if _answers(uri):
                raise
            raise unreachable(f"lost during the call: {type(e).__name__}") from e
