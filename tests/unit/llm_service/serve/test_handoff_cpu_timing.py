"""The hand-off's CPU counters (``kv_export_cpu_s``, ``kv_import_cpu_s``) time the worker thread that
reads or writes the blocks, not the replica's event loop, which only waits meanwhile."""

from __future__ import annotations

import asyncio
import time

from llm_service.serve.handoff import _on_thread_timed


def _burn(cpu_s: float) -> str:
    """Spin until this thread has used ``cpu_s`` of CPU."""
    t0 = time.thread_time()
    while time.thread_time() - t0 < cpu_s:
        pass
    return "done"


def test_the_cpu_counted_is_the_worker_threads() -> None:
    async def pull_like() -> tuple[str, float, float]:
        loop_t0 = time.thread_time()
        out, cpu_s = await asyncio.to_thread(_on_thread_timed, _burn, 0.05)
        return out, cpu_s, time.thread_time() - loop_t0

    out, cpu_s, loop_cpu_s = asyncio.run(pull_like())
    assert out == "done"
    assert cpu_s >= 0.05  # the worker's spin, however long the host made it wait for a core
    assert loop_cpu_s < cpu_s / 2  # what timing on the loop's thread would have counted instead
