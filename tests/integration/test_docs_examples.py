"""The README's and docs/' examples that need a running server, run as a reader runs them: the Python
blocks marked ``<!-- needs: server -->`` with the venv's Python, and the README's quick-start curl
block with bash, against one app (the tiny Qwen2-VL the examples name, the tiny Qwen3-VL of the tool calls, the tiny Qwen3.5
thinking) on a free loopback port instead
of 127.0.0.1:8000. The examples that need no server run in ``tests/unit/docs/test_docs.py``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI

from tests.unit.docs.test_docs import PAGES, README, ROOT, _fenced_blocks, _section

DOCS_URL = "http://127.0.0.1:8000"
SERVER_EXAMPLES = [
    (f"{page.name}:{line}", code)
    for page in PAGES
    for line, code, marked in _fenced_blocks(page, "python")
    if marked
]


@pytest.fixture(scope="module")
def server(vl_pair_app: OpenAI) -> str:
    """tests/integration/conftest.py's app (the tiny Qwen2-VL, Qwen3-VL and Qwen3.5), shared with
    test_prefix_affinity.py."""
    return str(vl_pair_app.base_url).rstrip("/").removesuffix("/v1")


def test_there_are_examples_that_need_a_server() -> None:
    assert any(where.startswith("README.md:") for where, _ in SERVER_EXAMPLES)
    assert all(DOCS_URL in code for _, code in SERVER_EXAMPLES)


@pytest.mark.parametrize("where,code", SERVER_EXAMPLES, ids=[w for w, _ in SERVER_EXAMPLES])
def test_python_example_runs_against_a_server(where: str, code: str, server: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", code.replace(DOCS_URL, server)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"


def test_readme_curl_example(server: str) -> None:
    (block,) = [
        b
        for b in re.findall(r"```bash\n(.*?)```", _section(README.read_text(), "Quick start"), re.S)
        if "curl" in b
    ]
    assert block.startswith("IMG=$(.venv/bin/python")
    venv_python = Path(sys.executable).parent / "python"  # the README's `.venv/bin/python`, this venv's
    script = block.replace(DOCS_URL, server).replace(".venv/bin/python", str(venv_python))
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    reply = json.loads(done.stdout)
    assert reply["model"] == "tiny-qwen2-vl"
    assert reply["choices"][0]["finish_reason"] in ("length", "stop")
    assert 0 < reply["usage"]["completion_tokens"] <= 16
