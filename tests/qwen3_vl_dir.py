"""One tiny Qwen3-VL model directory per test process (tests/conftest.py is shared; this is not)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def tiny_qwen3_vl_dir() -> Path:
    from cluster.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tiny-qwen3-vl-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny_model(root / "model", "qwen3-vl")
