"""After every other e2e test (``run_last``, conftest.py; before the replica-loss tests, which delete the app):
whatever those requests did — answered, refused, failed, abandoned mid-stream — no LLM replica runs or
queues a request or holds a KV block outside the prefix cache's free list, and no encoder-cache entry
of any model is still reserved."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.e2e.common import AUDIO, PORT, VL, wait_for

pytestmark = pytest.mark.usefixtures("app")  # the package's one app (conftest.py)


def _held() -> dict[str, Any]:
    from ray import serve

    stats = httpx.get(f"http://127.0.0.1:{PORT}/stats", timeout=30).json()
    held: dict[str, Any] = {}
    for model in (VL, AUDIO):
        llm = (
            serve.get_deployment_handle(f"LLMServer-{model}", app_name="mmserve")
            .stats.remote()
            .result(timeout_s=30)
        )
        held[model] = {
            "running": llm["num_running"],
            "waiting": llm["num_waiting"],
            "kv_blocks_in_use": llm["num_total_blocks"] - llm["num_free_blocks"],
            "encoder_cache_reserved": stats[model]["encoder_cache"]["reserved"],
        }
    return held


@pytest.mark.run_last(1)
def test_after_the_suite_no_request_kv_block_or_reservation_is_held() -> None:
    wait_for(lambda: not any(any(v.values()) for v in _held().values()), 30.0, "everything to be released")
    assert _held() == {
        m: {"running": 0, "waiting": 0, "kv_blocks_in_use": 0, "encoder_cache_reserved": 0}
        for m in (VL, AUDIO)
    }
