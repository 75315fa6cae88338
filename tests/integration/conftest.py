"""Integration tests start Ray and Serve in this process (or import Ray); every one of them is marked
``slow`` here, so ``make test-fast`` (``-m "not slow"``) leaves them all out.

Serve reads its settings (``cluster/serve_env.py``) when ``ray.serve`` is imported. Imported here,
before any fixture applies mmserve's settings, this test process, which calls handles synchronously,
keeps Serve's defaults, and only the processes Ray starts get mmserve's: the same in a whole-suite run
and in one module run alone (``tests/integration/test_faults.py`` alone failed without it: a sync
handle call's router coroutine was never awaited).

A failing test's report carries the errors the app's processes logged while it ran (a 500's
traceback lives in the ingress replica's log, which a CI run does not keep).
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
import ray.serve  # noqa: F401
from openai import OpenAI

HERE = Path(__file__).resolve().parent
_MARKERS = ("Traceback", "ERROR", "Error", "Exception", "request failed")
_MAX_LINES = 80  # per failed test, at the end of the run where a CI log's tail shows them
_FOUND: dict[str, str] = {}


def _session_logs() -> Path | None:
    import ray

    if not ray.is_initialized():
        return None
    from ray._private.worker import global_worker

    logs = getattr(getattr(global_worker, "node", None), "get_logs_dir_path", None)
    return Path(logs()) if callable(logs) else None


def _log_sizes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in root.rglob("*") if p.is_file() and p.suffix in (".log", ".err")}


def _errors_since(root: Path, before: dict[Path, int]) -> list[str]:
    """Error lines and the traceback lines after them, of every log written since ``before``."""
    kept: list[str] = []
    for path, size in sorted(_log_sizes(root).items()):
        if size <= before.get(path, 0):
            continue
        with open(path, "rb") as f:
            f.seek(before.get(path, 0))
            lines = f.read().decode(errors="replace").splitlines()
        in_error, found = False, []
        for line in lines:
            in_error = any(m in line for m in _MARKERS) or (in_error and line.startswith((" ", "\t")))
            if in_error:
                found.append(line)
        if found:
            kept += [f"== {path.relative_to(root)}", *found]
    return kept


# Modules that share one app (tests/integration/local_app.py's ``shared_app``), by the fixture that
# gives it: they run one after the other, where the first of them would, and the app ends after the last.
SHARED_APPS = {"vl_pair_app": ("test_docs_examples.py", "test_prefix_affinity.py")}

# Modules (or packages) that start a cluster of their own, not the session's Ray (local_app.py's
# ``own_ray``): they run after the other integration modules, so the session Ray starts once, and it is
# ended before them. e2e/: Ray's metrics agent on a port of its own, reports every second;
# test_multinode.py: a multi-node ``ray.cluster_utils.Cluster``; test_deploy_cli.py: ``ray start``;
# test_graceful_drain.py: ``mmserve serve`` in a subprocess; chaos/: multi-node clusters.
OWN_CLUSTER = ("e2e", "test_multinode.py", "test_deploy_cli.py", "test_graceful_drain.py", "chaos")


def _own_cluster(item: pytest.Item | None) -> bool:
    if item is None:
        return True
    path = Path(item.path).resolve()
    return not path.is_relative_to(HERE) or path.relative_to(HERE).parts[0] in OWN_CLUSTER


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)
    ours = [n for n, i in enumerate(items) if Path(i.path).resolve().is_relative_to(HERE)]
    if ours:  # the integration tests are one run of the collection: the own-cluster ones to its end
        block = [items[n] for n in ours]
        block.sort(key=_own_cluster)  # stable: every module keeps its place among its kind
        items[ours[0] : ours[-1] + 1] = block
    for modules in SHARED_APPS.values():
        paths = [HERE / m for m in modules]
        group = [i for i in items if Path(i.path).resolve() in paths]
        if len({i.path for i in group}) < 2:
            continue
        group.sort(key=lambda i: paths.index(Path(i.path).resolve()))  # stable: each module's own order
        first = next(n for n, i in enumerate(items) if i in group)
        rest = [i for i in items if i not in group]
        items[:] = rest[:first] + group + rest[first:]


def _shared_app_of(item: pytest.Item | None) -> str | None:
    names = getattr(item, "fixturenames", ()) if item is not None else ()
    return next((key for key in SHARED_APPS if key in names), None)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The shared app ends after the last test that uses it, when the next test is of another module
    (or none): not left running beside the next modules' own apps. The session Ray ends before a
    module with a cluster of its own, and after the last integration test."""
    from tests.integration.local_app import close_session_ray, close_shared_app, shared_app_key

    key = shared_app_key()
    if key is not None and (
        nextitem is None or (nextitem.path != item.path and _shared_app_of(nextitem) != key)
    ):
        close_shared_app()
    if (nextitem is None or nextitem.path != item.path) and _own_cluster(nextitem):
        close_session_ray()


# vl_pair_app's two tiny-qwen2-vl LLM replicas: one set of cores each ("0|1"), or not pinned on one core
_CORES = sorted(os.sched_getaffinity(0))
PAIR_CORES = f"{_CORES[0]}|{_CORES[1]}" if len(_CORES) >= 2 else None


@pytest.fixture(scope="module")
def vl_pair_app(tmp_path_factory: pytest.TempPathFactory) -> OpenAI:
    """The tiny Qwen2-VL with two LLM replicas (test_prefix_affinity.py: which replica a conversation
    goes to), the tiny Qwen3-VL, whose template takes tools, and the tiny Qwen3.5 with its reasoning
    parser (test_docs_examples.py: the README's and docs' examples, tool calls and thinking among them)."""
    from tests.integration.local_app import shared_app

    models = [
        {
            "name": "tiny-qwen2-vl",
            "tiny": "qwen2-vl",
            # each replica on a core of its own where the machine has two (test_prefix_affinity.py)
            "llm": {"deployment": {"num_replicas": 2, "cpu_affinity": PAIR_CORES}},
            "encoder": {"cache_index_shards": 1},
        },
        {"name": "tiny-qwen3-vl", "tiny": "qwen3-vl"},
        {
            "name": "tiny-qwen3.5",
            "tiny": "qwen3.5",
            "reasoning_parser": "auto",
            "llm": {"max_model_len": 1024, "num_kv_blocks": 128},
            "encoder": {"cache_index_shards": 1},
        },
    ]
    cache_dir = str(tmp_path_factory.mktemp("models"))
    config: dict[str, Any] = {"models": models, "models_cache_dir": cache_dir}
    if PAIR_CORES is not None:  # the ingress on both of the pair's cores (it reports them: /stats?pools=true)
        config["ingress"] = {"deployment": {"cpu_affinity": PAIR_CORES.replace("|", ",")}}
    return shared_app("vl_pair_app", config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    root = _session_logs()
    before = _log_sizes(root) if root else {}
    outcome = yield
    if root is not None and outcome.excinfo is not None:
        errors = _errors_since(root, before)
        if errors:
            _FOUND[item.nodeid] = "\n".join(errors[:_MAX_LINES])


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.integration.local_app import session_ray_cleanups

    cleaned = session_ray_cleanups()
    if cleaned:
        terminalreporter.write_sep(
            "-", "left on the session Ray by integration modules (actors and groups ended)"
        )
        terminalreporter.write_line("\n".join(cleaned))
    for nodeid, errors in _FOUND.items():
        terminalreporter.write_sep("-", f"errors the app's processes logged during {nodeid}")
        terminalreporter.write_line(errors)
