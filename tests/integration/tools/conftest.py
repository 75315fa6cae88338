"""One app for the package: the tiny Qwen3-VL (the tiny family whose template reads ``tools``), shared by
the tools-in-the-prompt, tool-call and Responses-tools modules (one Ray start instead of three).
Each module's checks read counters as differences, and each sends its own images."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.local_app import local_app

MODEL = "tiny-qwen3-vl"


@pytest.fixture(scope="package")
def tool_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    cache_dir = tmp_path_factory.mktemp("models")
    model = {
        "name": MODEL,
        "tiny": "qwen3-vl",
        "llm": {"max_model_len": 2048, "block_size": 16, "num_kv_blocks": 256},
        "encoder": {"cache_index_shards": 1},
        "preprocess": {"limit_mm_per_prompt": {"image": 4, "video": 1}},
    }
    with local_app({"models": [model], "models_cache_dir": str(cache_dir)}, num_cpus=2) as client:
        yield {"client": client, "dir": Path(cache_dir) / MODEL}
