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

from collections.abc import Generator
from pathlib import Path

import pytest
import ray.serve  # noqa: F401

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)


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
    for nodeid, errors in _FOUND.items():
        terminalreporter.write_sep("-", f"errors the app's processes logged during {nodeid}")
        terminalreporter.write_line(errors)
