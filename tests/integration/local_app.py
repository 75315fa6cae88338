"""Starting the whole app on a module's own local Ray, as `mmserve serve` would, on a free loopback port."""

from __future__ import annotations

import socket
from typing import Any

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_local_app(config: dict[str, Any]) -> OpenAI:
    """``config`` (an AppConfig dict without port) served directly on a free port; returns its client.
    The caller shuts Serve and Ray down."""
    import ray

    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    port = free_port()
    cfg = AppConfig.model_validate({**config, "port": port, "ingress": {"http_mode": "direct"}})
    apply_serve_env()  # what `mmserve serve` runs with, before Ray starts its processes
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="mmserve")
    start(cfg)
    return OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
