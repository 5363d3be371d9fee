"""pipelines.ports: server ports outside the kernel's ephemeral range, never handed out twice."""

import socket

import pytest

from pipelines import ports

pytestmark = pytest.mark.unit


def test_ports_lie_below_the_ephemeral_range_and_differ():
    got = [ports.free_port() for _ in range(64)]
    assert len(set(got)) == len(got)
    assert all(ports.RAY_WORKER_PORTS_END <= p < ports.ephemeral_start() for p in got)


def test_a_bound_port_is_never_returned(monkeypatch):
    """With one candidate port, held by another socket, the pick falls back to the kernel's."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        monkeypatch.setattr(ports, "RAY_WORKER_PORTS_END", taken)
        monkeypatch.setattr(ports, "ephemeral_start", lambda: taken + 1)
        port = ports.free_port()
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # really free
