"""EngineLoop: a caller that leaves (closed stream, cancelled task) aborts its engine request at once,
and every KV block comes back. The engine is a fake over the real Scheduler and KVCacheManager: no
model, each step samples token 7 for every request due a sample."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from llm_service.engine_loop import EngineLoop
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.outputs import EngineStats, RequestOutput
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler
from llm_service.sequence import Request
from mmcore.errors import StillHeld

MAX_TOKENS = 200  # what a request would generate if nobody aborted it
PROMPT = list(range(10))


class FakeEngine:
    """The LLMEngine surface EngineLoop drives. ``gate`` cleared: step() blocks (the loop is busy)."""

    def __init__(self, num_blocks: int = 128, block_size: int = 4) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=True)
        self.scheduler = Scheduler(self.kv, max_num_seqs=8, max_num_batched_tokens=64)
        self.generated: Counter[str] = Counter()  # tokens sampled, per request id
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()

    def add_request(
        self, rid: str, ids: list[int], params: SamplingParams, mm: Any, cache_salt: str | None = None
    ) -> None:
        self.scheduler.add_request(Request(rid, list(ids), params))

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        assert self.gate.wait(timeout=10)
        sched = self.scheduler.schedule()
        sampled = {c.request.request_id: (7, None) for c in sched.chunks if c.samples}
        outputs = []
        for req in self.scheduler.update(sched, sampled):
            self.generated[req.request_id] += 1
            reason = req.status.value if req.is_finished else None
            outputs.append(
                RequestOutput(req.request_id, [7], None, req.is_finished, reason, req.num_prompt_tokens, 0)
            )
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_total_blocks,
            kv_usage=self.kv.usage,
            prefix_hit_tokens=0,
            prefix_query_tokens=0,
            num_preemptions=self.scheduler.num_preemptions,
        )


def stream(loop: EngineLoop, rid: str) -> AsyncIterator[RequestOutput]:
    return loop.stream(rid, PROMPT, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), [])


async def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def idle(loop: EngineLoop) -> bool:
    """What LLMServer.stats() reports: nothing running or waiting, every block free."""
    s = loop.last_stats
    return (
        s is not None
        and s.num_running == 0
        and s.num_waiting == 0
        and s.num_free_blocks == s.num_total_blocks
        and not loop._has_pending()
    )


def test_closed_stream_aborts_its_request() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine)

    async def scenario() -> list[RequestOutput]:
        gen = stream(loop, "r1")
        seen = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()  # what the Serve replica does to generate() when the router cancels it
        await wait_until(lambda: idle(loop), "the engine to drop the closed request")
        return seen

    seen = asyncio.run(scenario())
    assert [o.new_token_ids for o in seen] == [[7], [7], [7]] and not seen[-1].finished
    assert engine.generated["r1"] < MAX_TOKENS // 4  # aborted, not run to max_tokens
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    assert not engine.scheduler.requests


def test_cancelled_consumer_aborts_its_request() -> None:
    engine = FakeEngine()
    loop = EngineLoop(engine)

    async def scenario() -> int:
        got = 0
        three = asyncio.Event()

        async def consume() -> None:
            nonlocal got
            async for _ in stream(loop, "r1"):
                got += 1
                if got == 3:
                    three.set()

        task = asyncio.create_task(consume())
        await three.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: idle(loop), "the engine to drop the cancelled request")
        return got

    got = asyncio.run(scenario())
    assert 3 <= got <= engine.generated["r1"] < MAX_TOKENS // 4
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_stream_cancelled_before_the_loop_added_it_never_runs() -> None:
    """The add and the abort are both pending when the loop comes back from a step: the request
    must be added then aborted (arrival order), not aborted (a no-op) then added and run unwatched."""
    engine = FakeEngine()
    loop = EngineLoop(engine)

    async def scenario() -> None:
        engine.gate.clear()
        first = stream(loop, "busy")
        first_out = asyncio.create_task(first.__anext__())
        await wait_until(engine.in_step.is_set, "the loop to be inside a step")
        late = asyncio.create_task(stream(loop, "late").__anext__())
        await wait_until(lambda: "late" in loop._queues, "the late request to be queued")
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        engine.gate.set()
        await first_out
        await first.aclose()
        await wait_until(lambda: idle(loop), "the engine to drop both requests")

    asyncio.run(scenario())
    assert engine.generated["late"] == 0
    assert engine.generated["busy"] < MAX_TOKENS // 4
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_on_outputs_sees_every_generated_token_even_after_the_caller_left() -> None:
    """What the generated-tokens metric counts: the engine's work, listened to or not."""
    engine = FakeEngine()
    seen_by_hook: Counter[str] = Counter()

    def hook(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            seen_by_hook[out.request_id] += len(out.new_token_ids)

    loop = EngineLoop(engine, on_outputs=hook)

    async def scenario() -> None:
        whole = [
            o async for o in loop.stream("full", PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), [])
        ]
        assert sum(len(o.new_token_ids) for o in whole) == 5
        gen = stream(loop, "left")
        await gen.__anext__()
        await gen.aclose()
        await wait_until(lambda: idle(loop), "the engine to drop the closed request")

    asyncio.run(scenario())
    assert seen_by_hook == engine.generated  # every sampled token, per request, including after the close
    assert seen_by_hook["full"] == 5 and seen_by_hook["left"] >= 1


def test_a_failing_on_outputs_callback_does_not_stop_the_loop() -> None:
    def broken(outputs: list[RequestOutput]) -> None:
        raise RuntimeError("metrics backend down")

    loop = EngineLoop(FakeEngine(), on_outputs=broken)

    async def scenario() -> int:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        outs = [o async for o in loop.stream("r", PROMPT, params, [])]
        return sum(len(o.new_token_ids) for o in outs)

    assert asyncio.run(asyncio.wait_for(scenario(), 10)) == 5


def test_a_request_the_engine_ends_with_a_coded_error_gets_it_as_a_retryable_503() -> None:
    """An engine that ends a request with a coded error between steps (``take_failed``: a decode
    replica's swap past its budget, llm_service/kv_swap.py) has it raised to that request's caller
    only, as the 503 ``kv_swap_full`` with Retry-After at the edge; the other request runs on."""
    from llm_service.kv_swap import SwapSpaceFull
    from router.protocol.errors import from_exception

    class Ending(FakeEngine):
        def take_failed(self) -> list[tuple[str, BaseException]]:
            req = self.scheduler.requests.get("victim")
            if req is None or self.generated["victim"] < 3:
                return []
            self.scheduler.abort("victim")  # the engine retires it, its blocks freed
            return [("victim", SwapSpaceFull("victim: its KV copy would pass kv_swap_space_mib"))]

    engine = Ending()
    loop = EngineLoop(engine)

    async def scenario() -> tuple[BaseException, int]:
        async def drain(rid: str) -> int:
            return len([o async for o in stream(loop, rid)])

        other = asyncio.ensure_future(drain("other"))
        try:
            await asyncio.wait_for(drain("victim"), 30)  # without its error it would wait forever
        except SwapSpaceFull as e:
            return e, await other
        raise AssertionError("the victim's stream ended without its error")

    err, other_outputs = asyncio.run(scenario())
    api = from_exception(err)
    assert api is not None and (api.status_code, api.code, api.retry_after_s) == (503, "kv_swap_full", 1)
    assert other_outputs == MAX_TOKENS and engine.generated["victim"] < MAX_TOKENS
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_a_request_sent_again_while_its_earlier_attempt_runs_is_a_retryable_503_and_the_earlier_runs_on() -> (
    None
):
    """What a replica's ``submit``/``prefill`` checks first (``EngineLoop.holds``): an ingress that lost
    its link to this replica sends the request again, and Serve may route it back here before the
    replica saw the link go. The engine's own check answers the same coded 503."""
    engine = FakeEngine()
    loop = EngineLoop(engine)

    async def scenario() -> None:
        gen = stream(loop, "r1")
        await gen.__anext__()
        assert loop.holds("r1") and not loop.holds("r2")
        await gen.aclose()
        await wait_until(lambda: idle(loop), "the engine to drop the closed request")
        assert not loop.holds("r1")

    asyncio.run(scenario())


def test_the_engine_answers_a_duplicate_request_id_with_a_retryable_503(tiny_vl_dir: Path) -> None:
    from llm_service.config import EngineConfig
    from llm_service.engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=str(tiny_vl_dir), max_model_len=256, num_kv_blocks=64))
    eng.add_request("r1", PROMPT, SamplingParams(max_tokens=4))
    with pytest.raises(StillHeld, match="already in the engine") as e:
        eng.add_request("r1", PROMPT, SamplingParams(max_tokens=4))
    assert (e.value.status_code, e.value.code) == (503, "request_still_held")
    assert list(eng.scheduler.requests) == ["r1"]  # the earlier attempt untouched
