"""Shared fixtures: tiny models generated once per test session, real media files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray binds its GCS, raylets and workers to 127.0.0.1 instead of the machine's routable address:
# every test's traffic stays on loopback (a Ray flag meant for laptops, valid on Linux too).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-vl"), "qwen2-vl")


@pytest.fixture(scope="session")
def tiny_audio_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from cluster.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-audio"), "qwen2-audio")
