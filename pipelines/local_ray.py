"""A private local Ray head for ``make demo`` and the CI pipeline test: start, wait, stop.

Why not plain ``ray start --head`` / ``ray stop``:

* ``ray stop`` kills every Ray process of the machine (other users' clusters, ``ray.init`` test
  sessions); :func:`stop` ends only the processes of *this* head, found by its own ``--temp-dir``
  (every Ray process of a head carries its session directory on its command line) plus their
  children (vLLM engine cores), by PID.
* a head killed without ``ray stop`` leaves ``ray_current_cluster`` in its temp dir, and a bare
  ``ray.init()`` later tries to join that dead cluster. A private ``--temp-dir`` keeps that file out
  of ``/tmp/ray``; jobs reach the head through ``RAY_ADDRESS`` (set by the job supervisor), never
  through the file.
* token auth: Ray 2.60 enables it for new ``ray start`` clusters unless ``RAY_AUTH_MODE`` is set,
  writing a token to ``~/.ray/auth_token`` that the ``ray`` CLI and ``ray.init`` then read. We keep
  it on and make it explicit: :func:`start` writes a token file (``<temp_dir>/auth_token``) and sets
  ``RAY_AUTH_MODE=token`` + ``RAY_AUTH_TOKEN_PATH`` for the head; :func:`client_env` gives the same
  variables to ``ray job submit`` (which otherwise fails with an authentication error when the token
  is not the default one).
* the job's ``python`` is the head's: the head is started with the venv's ``bin`` first on ``PATH``,
  so ``ray job submit -- python -m ray_jobs.pipeline`` runs in the venv.

* several "nodes" on one host: :func:`join` starts another raylet that joins the head (same token, its own temp
  dir below the head's, its own free ports), with its own GPUs (``CUDA_VISIBLE_DEVICES``) and a node name (the custom
  resource ``settings.NODE_RESOURCE_PREFIX + name``), so what differs per node (Ray Data and Train placement,
  Serve replicas and their head cache) is exercised on one machine; :func:`stop` ends both.

CLI (used by the Makefile and ``bench/device/run_multi_gpu.sh``)::

    python -m pipelines.local_ray start --temp-dir /tmp/peagle-ray --port 6390 --dashboard-port 8266
    python -m pipelines.local_ray start ... --num-gpus 2 --cuda-visible-devices 0,1 --node-name a
    python -m pipelines.local_ray join  --temp-dir /tmp/peagle-ray --num-gpus 2 --cuda-visible-devices 2,3 --node-name b
    python -m pipelines.local_ray env   --temp-dir /tmp/peagle-ray    # export lines for the ray CLI
    python -m pipelines.local_ray runtime-env                        # the jobs' runtime_env JSON
    python -m pipelines.local_ray stop  --temp-dir /tmp/peagle-ray
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from peagle_core.atomic import atomic_write_text
from pipelines import settings
from pipelines.ports import free_port, port_open

# the `ray` command of this interpreter's Ray: also where Ray is on PYTHONPATH without its console scripts
RAY_CLI = (sys.executable, "-m", "ray.scripts.scripts")
STATE_FILE = "peagle_head.json"
# What `ray job submit --working-dir .` leaves out of the upload (Ray 2.60 also skips .git, .venv and what
# .gitignore lists by itself; older Rays do not): environments, caches, local stores, outputs, device carries.
JOB_EXCLUDES = (".venv", ".git", "**/__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "mlruns", "*.db",
                "outputs", ".whl", ".carry")
TOKEN_FILE = "auth_token"


@dataclass
class HeadInfo:
    """A running private head: addresses and the token file its clients need."""

    temp_dir: str
    gcs_address: str  # host:port of the GCS (ray.init / RAY_ADDRESS inside the cluster)
    dashboard_url: str  # http://host:port (ray job submit --address)
    token_path: str
    num_cpus: int

    def client_env(self) -> dict[str, str]:
        """Env vars for ``ray`` CLI calls (job submit/logs/stop) against this head."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path, "RAY_ADDRESS": self.dashboard_url}


def read_head(temp_dir: str | os.PathLike) -> HeadInfo | None:
    """The head recorded in ``temp_dir`` if its dashboard answers, else None."""
    f = Path(temp_dir) / STATE_FILE
    if not f.is_file():
        return None
    info = HeadInfo(**json.loads(f.read_text()))
    host, port = info.dashboard_url.removeprefix("http://").split(":")
    return info if port_open(host, int(port)) else None


def ensure_token(path: Path) -> Path:
    """The Ray auth token file ``path``, created when missing: mode 0600 from its creation on
    (umask-proof, never a 0644 window), whole or absent after a crash, never replaced
    (``peagle_core.atomic.atomic_write_text`` with ``exclusive=True``).

    Returns:
        ``path``.
    """
    if not path.is_file():
        try:
            atomic_write_text(path, secrets.token_hex(32), mode=0o600, exclusive=True)
        except FileExistsError:
            pass  # another start made it first: both use that one
    return path


def start(
    temp_dir: str | os.PathLike,
    *,
    port: int = 6390,
    dashboard_port: int = 8266,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    cuda_visible_devices: str | None = None,
    node_name: str | None = None,
    timeout_s: float = 180.0,
    quiet: bool = False,
) -> HeadInfo:
    """Start a private Ray head (token auth on) unless one already runs from ``temp_dir``.

    ``num_cpus``: logical CPUs (default :func:`pipelines.settings.local_num_cpus`, 2x the cores; more keeps a
    Serve endpoint up while compute stages run beside it). ``num_gpus`` / ``cuda_visible_devices``: the GPUs of
    this node (None: Ray counts the visible ones); ``node_name``: see :func:`node_resources`. Every other port of
    the head is picked free, so it coexists with other Ray clusters of the machine.

    Raises:
        ValueError: ``port`` / ``dashboard_port`` taken by something that is not this head.
        RuntimeError: the head did not come up within ``timeout_s`` (its log dir is named).
    """
    temp = Path(temp_dir).resolve()
    running = read_head(temp)
    if running is not None:
        return running
    for name, p in (("port", port), ("dashboard_port", dashboard_port)):
        if port_open("127.0.0.1", p):
            raise ValueError(f"{name}={p} is in use by another process; pick a free one (e.g. {free_port()})")
    temp.mkdir(parents=True, exist_ok=True)
    token_path = ensure_token(temp / TOKEN_FILE)
    num_cpus = num_cpus or settings.local_num_cpus()
    _ray_start(["--head", f"--port={port}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                "--include-dashboard=true", f"--ray-client-server-port={free_port()}"],
               temp=temp, token_path=token_path, num_cpus=num_cpus, num_gpus=num_gpus,
               cuda_visible_devices=cuda_visible_devices, node_name=node_name)
    info = HeadInfo(temp_dir=str(temp), gcs_address=f"127.0.0.1:{port}",
                    dashboard_url=f"http://127.0.0.1:{dashboard_port}", token_path=str(token_path), num_cpus=num_cpus)
    deadline = time.time() + timeout_s
    while not port_open("127.0.0.1", dashboard_port):
        if time.time() > deadline:
            raise RuntimeError(f"Ray head dashboard did not open port {dashboard_port} in {timeout_s:.0f}s; "
                               f"see {temp}/session_latest/logs")
        time.sleep(1)
    atomic_write_text(temp / STATE_FILE, json.dumps(asdict(info), indent=2))
    if not quiet:
        print(f"Ray head up: {info.dashboard_url} (GCS {info.gcs_address}, temp dir {temp}, token auth on)")
    return info


def node_resources(node_name: str | None) -> dict[str, float]:
    """The custom resources of a node named ``node_name`` (``{settings.NODE_RESOURCE_PREFIX + name: 1}``: how
    ``pipelines.placement`` names it in a summary); ``{}`` for None.

    Raises:
        ValueError: a name with characters other than letters, digits, ``_`` and ``-``.
    """
    if node_name is None:
        return {}
    if not node_name or not all(c.isascii() and (c.isalnum() or c in "_-") for c in node_name):
        raise ValueError(f"node name {node_name!r}: use letters, digits, '_' or '-'")
    return {settings.NODE_RESOURCE_PREFIX + node_name: 1.0}


def _ray_start(args: list[str], *, temp: Path, token_path: Path, num_cpus: int, num_gpus: int | None,
               cuda_visible_devices: str | None, node_name: str | None) -> None:
    """``ray start ARGS`` for a node of this private cluster: token auth, the venv's ``bin`` first on ``PATH``
    (the job's ``python`` is the head's), free ports for everything the caller does not fix, its GPUs.

    Raises:
        RuntimeError: ``ray start`` failed (its output is in the message).
    """
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path),
               PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""), RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    cmd = [*RAY_CLI, "start", *args, f"--temp-dir={temp}", "--node-ip-address=127.0.0.1",
           f"--num-cpus={num_cpus}", "--disable-usage-stats", f"--node-manager-port={free_port()}",
           f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           f"--dashboard-agent-grpc-port={free_port()}", f"--metrics-export-port={free_port()}",
           f"--runtime-env-agent-port={free_port()}"]
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if node_name is not None:
        cmd.append(f"--resources={json.dumps(node_resources(node_name))}")
    # a session of its own: the node outlives the command that started it (a GPU lease's call ends by killing its
    # session: node b, joined again by bench.node_fault inside such a call on 2026-11-29, died when the call ended)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, start_new_session=True)
    if out.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def join(temp_dir: str | os.PathLike, *, num_cpus: int | None = None, num_gpus: int | None = None,
         cuda_visible_devices: str | None = None, node_name: str, timeout_s: float = 120.0,
         quiet: bool = False) -> str:
    """Start one more raylet on this host that joins the head running from ``temp_dir``: a second "node" with its
    own CPUs, GPUs (``cuda_visible_devices``) and name (:func:`node_resources`). Returns the node's name.

    Raises:
        ValueError: no head runs from ``temp_dir``, or a node of that name is already alive.
        RuntimeError: ``ray start`` failed, or the node did not register within ``timeout_s``.
    """
    temp = Path(temp_dir).resolve()
    head = read_head(temp)
    if head is None:
        raise ValueError(f"no peagle Ray head runs from {temp}: start it first (python -m pipelines.local_ray start)")
    resource = next(iter(node_resources(node_name)))
    if resource in _alive_node_resources(head):
        raise ValueError(f"a node named {node_name!r} is already alive in the cluster of {temp}")
    # its own temp dir below the head's: a raylet's runtime-env agent owns <session>/runtime_resources and deletes
    # the job packages its own node no longer uses, including the running job's working dir when two raylets of
    # one host share the head's session dir; below the head's dir, stop() still finds its processes
    _ray_start([f"--address={head.gcs_address}"], temp=temp / f"node-{node_name}", token_path=Path(head.token_path),
               num_cpus=num_cpus or settings.local_num_cpus(), num_gpus=num_gpus,
               cuda_visible_devices=cuda_visible_devices, node_name=node_name)
    deadline = time.time() + timeout_s
    while resource not in _alive_node_resources(head):
        if time.time() > deadline:
            raise RuntimeError(f"node {node_name!r} did not join within {timeout_s:.0f}s; see {temp}/session_latest/logs")
        time.sleep(1)
    if not quiet:
        print(f"Ray node {node_name!r} joined {head.gcs_address} (GPUs {cuda_visible_devices or 'as visible'})")
    return node_name


def _alive_node_resources(head: HeadInfo) -> set[str]:
    """Resource names of the alive nodes of ``head``'s cluster (``ray list nodes`` through the ray CLI)."""
    out = subprocess.run([*RAY_CLI, "list", "nodes", "--format=json", "--detail",
                          f"--address={head.dashboard_url}"], env=dict(os.environ, **head.client_env()),
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return set()
    nodes = json.loads(out.stdout or "[]")
    return {r for n in nodes if n.get("state") == "ALIVE" for r in (n.get("resources_total") or {})}


def _head_processes(temp: Path) -> list:
    import psutil

    key = str(temp)
    me = psutil.Process()
    spare = {me.pid} | {p.pid for p in me.parents()}  # this command and its callers (make, a shell)
    found = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(key in part for part in (p.info["cmdline"] or [])) and p.pid not in spare:
                found[p.pid] = p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for p in list(found.values()):
        try:
            for c in p.children(recursive=True):
                if c.pid not in spare:
                    found.setdefault(c.pid, c)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return list(found.values())


def stop(temp_dir: str | os.PathLike, *, grace_s: float = 10.0, quiet: bool = False) -> int:
    """End the head started from ``temp_dir`` and everything it spawned (by PID); other Ray
    clusters of the machine are untouched. Returns the number of processes ended."""
    import psutil

    temp = Path(temp_dir).resolve()
    procs = _head_processes(temp)
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    (temp / STATE_FILE).unlink(missing_ok=True)
    if not quiet:
        print(f"stopped {len(procs)} process(es) of the Ray head in {temp}")
    return len(procs)


def job_runtime_env() -> dict:
    """The ``runtime_env`` of peagle's jobs: :data:`JOB_EXCLUDES`, and the checkout's commit as environment
    variables (``pipelines.registry.provenance.submitter_env``: the upload has no ``.git``)."""
    from pipelines.registry.provenance import submitter_env

    return {"excludes": list(JOB_EXCLUDES), "env_vars": submitter_env()}


# ---------------------------------------------------------------------------------------------- CLI

cli = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.split("\n")[0])
TempOpt = typer.Option("/tmp/peagle-ray", "--temp-dir", help="The head's private Ray temp dir (short path).")


@cli.command("start")
def start_cmd(temp_dir: str = TempOpt, port: int = typer.Option(6390, help="GCS port."),
              dashboard_port: int = typer.Option(8266, help="Dashboard / Jobs API port."),
              num_cpus: int = typer.Option(0, help="Logical CPUs (0 = 2x the cores; more keeps a CPU endpoint serving during a refresh run)."),
              num_gpus: int = typer.Option(-1, help="GPUs of this node (-1 = the visible ones)."),
              cuda_visible_devices: str = typer.Option("", help="GPU indices this node owns, e.g. 0,1 (empty = as set)."),
              node_name: str = typer.Option("", help="Name shown in the summary (custom resource peagle_node_NAME).")) -> None:
    """Start the head unless it already runs."""
    try:
        start(temp_dir, port=port, dashboard_port=dashboard_port, num_cpus=num_cpus or None,
              num_gpus=None if num_gpus < 0 else num_gpus, cuda_visible_devices=cuda_visible_devices or None,
              node_name=node_name or None)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@cli.command("join")
def join_cmd(temp_dir: str = TempOpt, node_name: str = typer.Option(..., help="This node's name (required)."),
             num_cpus: int = typer.Option(0, help="Logical CPUs (0 = 2x the cores)."),
             num_gpus: int = typer.Option(-1, help="GPUs of this node (-1 = the visible ones)."),
             cuda_visible_devices: str = typer.Option("", help="GPU indices this node owns, e.g. 2,3.")) -> None:
    """Start another raylet on this host that joins the running head (a second "node")."""
    try:
        join(temp_dir, node_name=node_name, num_cpus=num_cpus or None, num_gpus=None if num_gpus < 0 else num_gpus,
             cuda_visible_devices=cuda_visible_devices or None)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


@cli.command("env")
def env_cmd(temp_dir: str = TempOpt) -> None:
    """Print `export` lines for the ray CLI (address + token); exit 1 when no head runs."""
    info = read_head(temp_dir)
    if info is None:
        raise typer.Exit(1)
    for k, v in info.client_env().items():
        print(f"export {k}={v}")


@cli.command("runtime-env")
def runtime_env_cmd() -> None:
    """Print the job runtime_env JSON (`ray job submit --runtime-env-json "$(... runtime-env)"`)."""
    print(json.dumps(job_runtime_env()))


@cli.command("stop")
def stop_cmd(temp_dir: str = TempOpt) -> None:
    """Stop the head (only its own processes)."""
    stop(temp_dir)


if __name__ == "__main__":
    cli()
