"""A real MLflow tracking server for a cluster: ``mlflow server`` with a SQLite backend store and the artifacts it
serves itself (``--artifacts-destination``: clients upload and download heads through HTTP, so Serve replicas
and training workers on other nodes need no shared artifact path), started in its own process group.

::

    peagle registry server start [--host 0.0.0.0] [--port 5000]   # prints the URL; export MLFLOW_TRACKING_URI=...
    peagle registry server stop

Its files live under ``settings.mlflow_server_dir()`` (``$PEAGLE_HOME/mlflow-server``: ``mlflow.db``,
``artifacts/``, ``server.log``, ``server.json`` with its URL and process group). A recipe points at it with
``registry.tracking_uri: http://HOST:PORT`` or ``$MLFLOW_TRACKING_URI`` on every node
(``pipelines.settings.tracking_uri``). On Kubernetes use ``infra/mlflow.yaml`` (Postgres + object store) instead.

Shape legend: not applicable (orchestration only).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from peagle_core.atomic import atomic_write_text
from pipelines import settings
from pipelines.ports import port_open

STATE_FILE = "server.json"


@dataclass
class MlflowServer:
    """A running ``mlflow server``: its ``uri``, the process group ``pgid`` it leads, its files under ``root``."""

    uri: str
    pgid: int
    root: str
    proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)  # when this process started it

    def to_json(self) -> dict:
        return {"uri": self.uri, "pgid": self.pgid, "root": self.root}

    def wait_healthy(self, timeout_s: float = 300.0) -> float:
        """Seconds until ``/health`` answers.

        Raises:
            RuntimeError: the server exited (when this process started it) or did not answer within ``timeout_s``
                (the end of its log in the message).
        """
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s and (self.proc is None or self.proc.poll() is None):
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(0.25)
        log = Path(self.root) / "server.log"
        raise RuntimeError(f"mlflow server {self.uri} did not answer (rc={self.proc.poll() if self.proc else None}): "
                           f"{log.read_text()[-2000:] if log.is_file() else ''}")

    def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether ``/health`` answers 200."""
        import httpx

        try:
            return httpx.get(f"{self.uri}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server and its workers (the process group it leads); gone already is fine."""
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        if self.proc is not None and sig == signal.SIGKILL:
            self.proc.wait(30)
        (Path(self.root) / STATE_FILE).unlink(missing_ok=True)


def running(root: str | os.PathLike | None = None) -> MlflowServer | None:
    """The server recorded under ``root`` (default ``settings.mlflow_server_dir()``) if it answers, else None."""
    f = Path(root or settings.mlflow_server_dir()) / STATE_FILE
    if not f.is_file():
        return None
    server = MlflowServer(**json.loads(f.read_text()))
    return server if server.healthy() else None


def launch(root: str | os.PathLike, *, host: str = "127.0.0.1", port: int = 5000, workers: int = 2) -> MlflowServer:
    """Start ``mlflow server`` (SQLite store ``root/mlflow.db``, served artifacts ``root/artifacts``, log
    ``root/server.log``) in its own process group and return at once (:meth:`MlflowServer.wait_healthy` waits).
    MLflow's job runner is off (``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``): the tracking and registry API only.

    Args:
        host: bind address (``0.0.0.0`` for other nodes; the URI clients get names 127.0.0.1 then).
        port: HTTP port.
        workers: its uvicorn workers.
    """
    root = Path(root).expanduser().resolve()
    (root / "artifacts").mkdir(parents=True, exist_ok=True)
    with open(root / "server.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", host, "--port", str(port), "--workers", str(workers),
             "--backend-store-uri", f"sqlite:///{root / settings.SQLITE_NAME}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    client_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return MlflowServer(uri=f"http://{client_host}:{port}", pgid=proc.pid, root=str(root), proc=proc)


def start(root: str | os.PathLike | None = None, *, host: str = "127.0.0.1", port: int = 5000, workers: int = 2,
          timeout_s: float = 300.0) -> MlflowServer:
    """:func:`launch` the server under ``root`` (default ``settings.mlflow_server_dir()``) unless one already
    answers from there, wait for ``/health``, record it in ``root/server.json``. The server outlives this process.

    Raises:
        ValueError: ``port`` is taken by something else.
        RuntimeError: it exited or did not answer within ``timeout_s`` (the end of its log in the message).
    """
    root = Path(root or settings.mlflow_server_dir()).expanduser().resolve()
    up = running(root)
    if up is not None:
        return up
    if port_open("127.0.0.1", port):
        raise ValueError(f"port {port} is in use by another process; pick a free one")
    server = launch(root, host=host, port=port, workers=workers)
    try:
        server.wait_healthy(timeout_s)
    except RuntimeError:
        server.kill()
        raise
    atomic_write_text(root / STATE_FILE, json.dumps(server.to_json(), indent=2))
    return server


def stop(root: str | os.PathLike | None = None) -> bool:
    """Stop the server recorded under ``root`` (SIGTERM to its process group, SIGKILL after 10 s); False when none
    was recorded."""
    f = Path(root or settings.mlflow_server_dir()) / STATE_FILE
    if not f.is_file():
        return False
    server = MlflowServer(**json.loads(f.read_text()))
    server.kill(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.healthy(timeout_s=0.5):
        time.sleep(0.5)
    server.kill(signal.SIGKILL)
    return True
