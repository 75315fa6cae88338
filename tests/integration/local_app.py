"""A module's own local Ray, shut down however the module ends, and the whole app started on it as
`mmserve serve` would, on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from openai import OpenAI


def free_port() -> int:
    """A loopback port nothing listens on, outside Ray's worker ports and the kernel's ephemeral range
    (``cluster.bench.local_cluster.free_port``, which the benchmark's clusters use too). A port the kernel
    handed out (bind to 0) is from the range Ray's processes draw from while the app starts: once one
    of them took it before the ingress bound it (EADDRINUSE, the module's start failed)."""
    from cluster.bench.local_cluster import free_port as free_loopback_port

    return free_loopback_port()


@contextmanager
def own_ray(address: str = "local", **init: Any) -> Iterator[None]:
    """``ray.init`` for one test module; Serve (if it started) and Ray are shut down on the way out,
    also when the start fails or Serve's shutdown raises. A module whose start failed thus leaves no
    Ray behind, so the next module's ``ray.init`` does not fail with "called ray.init twice"."""
    import ray
    from ray import serve

    if address == "local":
        init = {"num_cpus": 2, "include_dashboard": False, **init}
    ray.init(address=address, **{"namespace": "mmserve", **init})
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@contextmanager
def local_app(config: dict[str, Any], num_cpus: int = 2) -> Iterator[OpenAI]:
    """``config`` (an AppConfig dict without port) served directly on a free port, on this module's
    own Ray; yields its client, and shuts Serve and Ray down on the way out. ``num_cpus``: Ray's
    logical CPUs (a scheduling budget: an app of many models' fractional replicas needs more than
    the machine's 2, although they mostly idle; short of it, a replica waits to be scheduled forever
    and the requests routed to it hang)."""
    from cluster.config import AppConfig
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    port = free_port()
    cfg = AppConfig.model_validate({**config, "port": port, "ingress": {"http_mode": "direct"}})
    apply_serve_env()  # what `mmserve serve` runs with, before Ray starts its processes
    with own_ray(num_cpus=num_cpus):
        start(cfg)
        yield OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
