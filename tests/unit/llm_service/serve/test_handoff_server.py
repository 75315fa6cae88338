"""E/P/D on two real LLMServers (a prefill and a decode replica over the tiny Qwen2-VL, no Ray): the
decode replica's pull goes to the prefill replica's ``pull_kv`` through a link double that holds it
until the test lets it go, so what happens while a request's KV is in flight can be driven.

A request orphaned while its KV is being pulled (its ingress's output channel closed: the ingress
died, or never connected in time) has nobody to stream to: once its import ends, the decode replica
aborts it and frees its blocks, rather than decoding it to its end for nobody."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import HandoffWiring, LLMServer

PROMPT = list(range(30, 70))  # 40 text tokens: 10 blocks of 4
LONG = SamplingParams(max_tokens=2000, ignore_eos=True)  # decodes for seconds unless stopped


class HeldLink:
    """The decode replica's link to the prefill replica: a ``pull_kv`` waits for ``release``."""

    def __init__(self, prefill: LLMServer) -> None:
        self.prefill = prefill
        self.pulling = asyncio.Event()
        self.release = asyncio.Event()

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        assert method == "pull_kv"
        self.pulling.set()
        await self.release.wait()
        return await self.prefill.pull_kv(*args)


def _servers(model_dir: Path) -> tuple[LLMServer, LLMServer, HeldLink]:
    config = EngineConfig(model=str(model_dir), block_size=4, num_kv_blocks=600)

    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 1)

    link: HeldLink | None = None
    prefill = LLMServer(config, "tiny", role="prefill", handoff=HandoffWiring(address, lambda a: link))  # type: ignore[arg-type,return-value]
    link = HeldLink(prefill)
    decode = LLMServer(config, "tiny", role="decode", handoff=HandoffWiring(address, lambda a: link))  # type: ignore[arg-type,return-value]
    return prefill, decode, link


async def _until(cond: Any, what: str) -> None:
    for _ in range(300):  # 3 s: the engine loop applies an abort between steps
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 3 s: {what}")


@pytest.mark.slow  # two engines loaded: 13 s here at load average 50
def test_a_request_orphaned_during_its_pull_is_aborted_once_imported(tiny_vl_dir: Path) -> None:
    async def scenario() -> None:
        prefill, decode, link = _servers(tiny_vl_dir)
        spec = LLMRequestSpec("r1", PROMPT, LONG, [], ingress_id="ing")
        handoff = await prefill.prefill(spec)
        assert handoff.handed_off and prefill.stats()["kv_pins_held"] == 1
        submit = asyncio.create_task(
            decode.submit_detached(LLMRequestSpec("r1", PROMPT, LONG, [], ingress_id="ing", handoff=handoff))
        )
        await link.pulling.wait()
        decode.channels.connect_timeout_s = 0.0  # nobody connected to the channel: it is dropped
        decode.channels.drop_unconnected()  # ...and its request orphaned, mid-pull
        link.release.set()
        await submit  # the import itself succeeds
        eng: Any = decode.engine  # the LLMEngine behind the replica
        await _until(lambda: not eng.scheduler.requests, "the orphaned request aborted on the decode replica")
        assert eng.stats().num_free_blocks == eng.stats().num_total_blocks
        assert decode.stats()["kv_imports"] == 1 and prefill.stats()["kv_pins_held"] == 0

    asyncio.run(scenario())
