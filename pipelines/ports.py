"""Ports for the servers peagle starts itself: a Ray head and its agents, Ray Serve's proxy, an MLflow server,
a torch.distributed rendezvous.

A port from ``bind(("127.0.0.1", 0))`` lies in the kernel's ephemeral range, which every outgoing connection
also draws from, and Ray's processes open many: in CI (2026-11-26) Ray Serve's proxy found 127.0.0.1:44933,
picked that way moments before, already taken (``Failed to bind to address``). Ports here are chosen below
that range and above Ray's default worker ports (10002-19999), where only an explicit bind can take them,
and never twice in one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

RAY_WORKER_PORTS_END = 20_000  # Ray's default --max-worker-port is 19999
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_START = 32_768  # Linux's default when the file cannot be read

_given: set[int] = set()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``; 32768 where unreadable)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port`` now."""
    with socket.socket() as s:
        s.settimeout(timeout_s)
        return s.connect_ex((host, port)) == 0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now and that this process has not handed out before,
    from ``[20000, ephemeral start)`` in a random order (the kernel's own pick, ``bind(0)``, where that range is
    empty or taken).

    Raises:
        OSError: not even the kernel has a free port.
    """
    candidates = list(range(RAY_WORKER_PORTS_END, ephemeral_start()))
    random.SystemRandom().shuffle(candidates)
    for port in candidates:
        if port not in _given and _bindable(port):
            _given.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _given.add(port)
    return port


__all__ = ["ephemeral_start", "free_port", "port_open"]
