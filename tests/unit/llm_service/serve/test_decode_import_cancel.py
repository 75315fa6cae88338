"""A decode replica's import cancelled while its pulled KV is being written on a thread (the ingress
gave up on the request): the request's blocks go back to the pool only after the write has ended, so
a write still running can never land in blocks another request was given in the meantime."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

from llm_service.kv_handoff import ImportSlots, KVBlocks, KVHandoff
from llm_service.outputs import RequestOutput
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from llm_service.serve.handoff import DecodeImports, TransferStats


class _Loop:
    async def on_engine(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    def track(self, request_id: str) -> None:
        pass


class _Runner:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.writing = threading.Event()

    def write_kv_blocks(self, *args: Any) -> None:
        self.writing.set()
        time.sleep(0.3)  # a large import's copy
        self.log.append("written")


class _Engine:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.runner = _Runner(self.log)

    def reserve_import(self, *args: Any) -> ImportSlots:
        return ImportSlots(hit_blocks=0, block_ids=[3, 4])

    def cancel_import(self, request_id: str) -> None:
        self.log.append("freed")


class _Link:
    async def call(self, method: str, rid: str, *args: Any, timeout_s: float) -> KVBlocks:
        return KVBlocks(rid, 0, 2, "float32", [(2, 2, 1, 1, 1)], [bytes(16)])


def test_blocks_are_freed_after_a_cancelled_write_ends() -> None:
    engine = _Engine()
    imports = DecodeImports(_Loop(), engine, lambda _addr: _Link(), 5.0, TransferStats())  # type: ignore[arg-type]
    first = RequestOutput("r", [7], None, False, None, 20, 0)
    handoff = KVHandoff("r", "prefill-0", first, ("127.0.0.1", 1), 20, 2, (b"a", b"b"), 5.0)
    spec = LLMRequestSpec("r", list(range(20)), SamplingParams(), handoff=handoff)

    async def run() -> None:
        task = asyncio.ensure_future(imports.import_request(spec))
        await asyncio.to_thread(engine.runner.writing.wait, 5.0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert engine.log == ["written", "freed"]
