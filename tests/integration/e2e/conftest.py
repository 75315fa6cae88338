"""One app for the whole e2e package (Ray + Serve start once): the default tiny models on Ray Serve,
HTTP on 127.0.0.1:PORT, Prometheus metrics exported every second on a free local port.

The package's modules share it. A test marked ``run_last(rank)`` runs after the package's other
tests, in rank order (``pytest_collection_modifyitems`` below), whatever the file names: the check that
nothing is held after the suite (1), the encoder replica killed (2), the app deleted (3).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.integration.e2e.common import AUDIO, PORT, VL
from tests.integration.local_app import free_port, own_ray
from tests.media import make_image_bytes

HERE = Path(__file__).resolve().parent


def _rank(item: pytest.Item) -> int:
    marker = item.get_closest_marker("run_last")
    return 0 if marker is None else int(marker.args[0])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This package's tests keep their slots in the session (one block, one app), reordered within
    them: unmarked first in collection order, then the ``run_last`` ones by rank."""
    slots = [i for i, item in enumerate(items) if Path(item.path).resolve().is_relative_to(HERE)]
    ordered = sorted((items[i] for i in slots), key=_rank)  # stable: collection order within a rank
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.fixture(scope="package")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from cluster.config import AppConfig, default_config
    from cluster.serve_cli import start
    from cluster.serve_env import apply_serve_env

    cache_dir = tmp_path_factory.mktemp("models")
    cfg = default_config().model_dump()
    cfg.update(port=PORT, models_cache_dir=str(cache_dir))
    cfg["ingress"]["http_mode"] = "direct"  # what `mmserve serve` runs (the multi-node test covers the proxy)
    for m in cfg["models"]:
        m["preprocess"]["media"]["allow_private_addresses"] = True  # the test's HTTP server is on loopback
        m["preprocess"]["limit_mm_per_prompt"] = {"image": 2, "video": 1, "audio": 1}
    # start() would call the same ray.init; here Ray's metrics agent also serves Prometheus text on a
    # known port, and workers push their metrics every second instead of every ten.
    metrics_port = free_port()
    apply_serve_env()  # what `mmserve serve` runs with, before Ray starts its processes
    # Tracing on (cluster/tracing.py) with every process writing its spans to trace_dir, but only for
    # requests whose client sent a sampled traceparent: the other tests' requests record nothing.
    trace_dir = tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MMSERVE_TRACE_FILE_DIR", str(trace_dir))
        env.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_off")
        with own_ray(_metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000}):
            start(AppConfig.model_validate(cfg))
            yield {
                "dirs": {VL: cache_dir / "tiny-qwen2-vl", AUDIO: cache_dir / "tiny-qwen2-audio"},
                "metrics_url": f"http://127.0.0.1:{metrics_port}/metrics",
                "trace_dir": trace_dir,
            }


@pytest.fixture(scope="package")
def client(app: dict[str, Any]) -> OpenAI:
    return OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="package")
def media_server() -> Iterator[str]:
    files = {
        "/cat.png": make_image_bytes(96, 64, seed=5),
        "/stages.png": make_image_bytes(70, 56, seed=613),
        "/traced.png": make_image_bytes(56, 70, seed=614),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
