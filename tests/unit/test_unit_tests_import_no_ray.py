"""Unit tests import no Ray: no module under tests/unit, nor a test helper one of them imports
(``tests.media``, ``tests.integration.local_app``, ...), says ``import ray`` or ``from ray``, at its top
or inside a function. A test that needs Ray belongs in tests/integration/."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
RAY_IMPORT = re.compile(r"^\s*(?:import ray\b|from ray\b)", re.MULTILINE)
TESTS_IMPORT = re.compile(r"^\s*(?:from|import) (tests(?:\.\w+)+)", re.MULTILINE)


def _source(module: str) -> Path | None:
    """The file of a ``tests.`` module (a package's ``__init__.py``), None for a name inside one."""
    path = TESTS.parent / module.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _ray_importers(roots: list[Path]) -> list[str]:
    """Each file of ``roots`` and of the ``tests.`` modules they import, transitively, that imports Ray."""
    seen: set[Path] = set()
    todo = list(roots)
    found = []
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text()
        if RAY_IMPORT.search(text):
            found.append(str(path.relative_to(TESTS.parent)))
        for module in TESTS_IMPORT.findall(text):
            helper = _source(module) or _source(module.rsplit(".", 1)[0])
            if helper is not None:
                todo.append(helper)
    return sorted(found)


def test_no_unit_test_imports_ray() -> None:
    unit = sorted((TESTS / "unit").rglob("*.py"))
    assert len(unit) > 100  # the walk found the tree
    assert _ray_importers(unit) == []


def test_the_check_finds_a_ray_import() -> None:
    """Not vacuous: the integration tests' conftest imports ``ray.serve`` (and ``local_app``, for the shared
    app, which imports Ray), and a helper of a helper counts."""
    assert _ray_importers([TESTS / "integration" / "conftest.py"]) == [
        "tests/integration/conftest.py",
        "tests/integration/local_app.py",
    ]
    drain = TESTS / "integration" / "test_graceful_drain.py"  # Ray only through local_app's own_ray
    assert _ray_importers([drain]) == ["tests/integration/local_app.py"]
    assert RAY_IMPORT.search("def f():\n    from ray.exceptions import ObjectLostError\n")
    assert not RAY_IMPORT.search("from cluster.ray_env import x\nimport rayon\n")
