"""A second server on a port in use is a clear start-up error naming the port, never a silent share.

The ingress replicas bind with ``SO_REUSEPORT`` (``router/http/listener.py: bind_reuseport``), so the
kernel would let a second server of the same user bind the port too; ``check_port_free`` refuses."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from cluster.bench.local_cluster import free_port
from cluster.serve_cli import PortInUse, check_port_free
from router.http.listener import bind_reuseport


def test_a_port_held_by_a_running_ingress_is_refused() -> None:
    port = free_port()
    held = bind_reuseport("127.0.0.1", port)  # what a serving ingress replica holds
    try:
        with pytest.raises(PortInUse, match=f"127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    finally:
        held.close()
    check_port_free("127.0.0.1", port)  # free again: no error


def test_a_port_held_by_another_server_is_refused() -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(PortInUse, match=str(port)):
            check_port_free("127.0.0.1", port)


@pytest.mark.slow
def test_mmserve_serve_exits_at_once_naming_the_port() -> None:
    """The real CLI: a second `mmserve serve` on a port in use exits non-zero before Ray starts."""
    port = free_port()
    held = bind_reuseport("127.0.0.1", port)
    try:
        run = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        held.close()
    assert run.returncode != 0
    assert f"127.0.0.1:{port}" in run.stderr + run.stdout
    assert "ray" not in (run.stderr + run.stdout).lower().replace("--port", "")  # nothing of Ray started
