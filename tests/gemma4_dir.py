"""One tiny Gemma 4 model directory per variant per test process (tests/conftest.py is shared; this is not)."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path


@cache
def tiny_gemma4_dir(variant: str = "base") -> Path:
    from cluster.tiny_model import make_tiny_model

    root = Path(tempfile.mkdtemp(prefix=f"tiny-gemma4-{variant}-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return make_tiny_model(root / "model", "gemma4", variant=variant)
