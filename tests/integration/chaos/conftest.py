"""The chaos tier: every test here is marked ``chaos`` (besides ``slow``, as every integration test),
which pyproject's ``addopts = ["-m", "not chaos"]`` deselects from a plain ``pytest`` and ``make test``;
``make chaos`` (``pytest -m chaos tests/integration/chaos``) runs them. Each starts its own multi-node
cluster and takes minutes on a small machine."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(item.path).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.chaos)
