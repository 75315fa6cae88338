"""Fixtures of the journey tests: ``colocated``, the E/P/D journeys' reference tokens (pd_world.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.router.journey.pd_world import colocated_tokens


@pytest.fixture(scope="session")
def colocated(tiny_vl_dir: Path) -> list[int]:
    """``PROMPT``'s greedy tokens from one colocated server: what every E/P/D journey must equal."""
    return colocated_tokens(tiny_vl_dir)
