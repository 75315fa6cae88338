"""One tiny Qwen2.5-VL model directory per test process (tests/conftest.py is shared; this is not)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def tiny_qwen2_5_vl_dir() -> Path:
    from cluster.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix="tiny-qwen2.5-vl-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny_model(root / "model", "qwen2.5-vl")
