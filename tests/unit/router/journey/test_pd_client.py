"""E/P/D's journey without Ray: ``PDClient`` over a real prefill ``LLMServer`` and a real decode one,
each with a real engine on the tiny Qwen2-VL (tests/unit/router/journey/pd_world.py: Serve's handles are
shims calling the servers, the direct link a shim calling the prefill server's ``pull_kv``). Greedy tokens
equal a colocated engine's; a lost prefill replica or a failed transfer is prefilled again, the decode
replica's blocks freed; an unpulled hand-off is freed at its deadline; a decode replica short of blocks
refuses and another takes the import (``kv_pull_chunks``: test_pd_client_chunks.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llm_service.request_spec import LLMRequestSpec, ReplicaTarget
from llm_service.serve.deployment import LLMServer
from router.journey.pd_client import PDClient
from tests.unit.router.journey.pd_world import (
    PARAMS,
    PROMPT,
    ActorDiedError,
    DecodeHandle,
    FlakyLink,
    PrefillHandle,
    TwoDecodeHandle,
    make_server,
    tokens,
)
from tests.unit.router.journey.test_llm_client import FakeLLMHandle


def test_journey_equals_colocated_and_recovers_from_losses(tiny_vl_dir: Path, colocated: list[int]) -> None:
    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill")
        link = FlakyLink(prefill)
        decode = make_server(tiny_vl_dir, "decode", link)
        handle = PrefillHandle(prefill)
        client = PDClient(handle, DecodeHandle(decode), reroute_timeout_s=5.0)
        free = decode.engine.stats().num_free_blocks  # type: ignore[attr-defined]

        assert await tokens(client, "a") == colocated
        assert (prefill.kv_stats.handoffs, prefill.kv_stats.pulls, decode.kv_stats.imports) == (1, 1, 1)
        assert decode.kv_stats.blocks_pulled == 10  # 9 full blocks and the partial one

        handle.lose = 1  # the prefill replica dies before its answer: prefilled again
        assert await tokens(client, "b") == colocated
        assert handle.calls == 3 and client.prefilled_again == 1
        # the decode replica held "a"'s full blocks under the same hashes: nothing but the partial block crossed
        assert decode.kv_stats.blocks_hit == 9 and decode.kv_stats.blocks_pulled == 11

        link.fail = 1  # the pull fails: the decode replica frees its blocks, the request is prefilled again
        assert await tokens(client, "c") == colocated
        assert decode.kv_stats.failed_imports == 1 and client.prefilled_again == 2
        assert prefill.kv_stats.expired == 0
        await asyncio.sleep(0.05)
        assert decode.engine.stats().num_free_blocks == free  # type: ignore[attr-defined]
        assert decode.engine.stats().num_running == 0  # type: ignore[attr-defined]
        # prefilling "c" again replaced its first hand-off (whose pull never reached the prefill replica):
        # no pin left, no block held there
        assert len(prefill._prefill.pins) == 0  # type: ignore[union-attr]
        stats = await client.replica_stats()  # /stats?pools=true: both pools' replicas, by role
        assert stats[prefill.replica_id]["role"] == "prefill" and stats[prefill.replica_id]["kv_pulls"] == 3
        assert stats[decode.replica_id]["role"] == "decode"
        assert prefill.engine.stats().num_free_blocks == 64  # type: ignore[attr-defined]
        assert not prefill.engine.scheduler.handed_off  # type: ignore[attr-defined]

    asyncio.run(scenario())


def test_an_unpulled_handoff_is_freed_at_its_deadline(tiny_vl_dir: Path) -> None:
    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill", deadline_s=0.2)
        engine: Any = prefill.engine
        handoff = await prefill.prefill(LLMRequestSpec("x", list(PROMPT), PARAMS))
        assert handoff.handed_off and handoff.num_blocks == 10 and len(handoff.block_hashes) == 9
        assert engine.stats().num_free_blocks == 64 - 10
        # the expiry counts first, then the engine's thread frees the blocks: wait for both (a loaded
        # host can take far longer than the deadline to get there)
        for _ in range(1000):
            if prefill.kv_stats.expired and not engine.scheduler.handed_off:
                break
            await asyncio.sleep(0.02)
        assert prefill.kv_stats.expired == 1 and not engine.scheduler.handed_off
        assert engine.stats().num_free_blocks == 64  # freed, still cached: a repeat hits them
        with pytest.raises(Exception, match="no KV held"):
            await prefill.pull_kv("x", 0)

    asyncio.run(scenario())


class DyingDecodeHandle(FakeLLMHandle):
    """The decode pool: its replica dies when the ingress opens the first output channel; Serve then
    routes everything to the successor (``successor``)."""

    def __init__(self, server: LLMServer, successor: LLMServer) -> None:
        super().__init__(server)
        self.successor = successor

    @property
    def channel(self) -> Any:
        if self.server is self.successor:
            return super().channel

        def dead(target: Any) -> Any:
            self.server = self.successor

            class Gone:
                def __aiter__(self) -> Any:
                    return self

                async def __anext__(self) -> Any:
                    raise ActorDiedError("the decode replica died")

                def cancel(self) -> None:
                    pass

            return Gone()

        return SimpleNamespace(remote=dead)


def test_a_decode_replica_lost_before_the_first_output_is_prefilled_again(
    tiny_vl_dir: Path, colocated: list[int]
) -> None:
    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill")
        link = FlakyLink(prefill)
        dying, successor = make_server(tiny_vl_dir, "decode", link), make_server(tiny_vl_dir, "decode", link)
        client = PDClient(PrefillHandle(prefill), DyingDecodeHandle(dying, successor), reroute_timeout_s=5.0)
        assert await tokens(client, "d") == colocated
        assert client.prefilled_again == 1 and client.rerouted == 1
        assert prefill.kv_stats.handoffs == prefill.kv_stats.pulls == 2  # the second pin was pulled too
        assert (dying.kv_stats.imports, successor.kv_stats.imports) == (1, 1)
        await dying.abort(ReplicaTarget(dying.replica_id, request_ids=("d",)))  # (the "dead" one's leftovers)

    asyncio.run(scenario())


def test_a_decode_replica_short_of_blocks_refuses_and_another_takes_the_import(
    tiny_vl_dir: Path, colocated: list[int]
) -> None:
    """The first decode replica's pool is held by other requests (4 blocks free of 64; the import needs
    10): it refuses the import as overloaded, allocating nothing, and the ingress sends the same hand-off
    (the prefill replica's pin still stands) to the second, which answers. When both are short, the
    ingress stops after ``MAX_DECODE_TRIES`` with the retryable 503 ``overloaded``."""
    from router.journey.pd_client import MAX_DECODE_TRIES

    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill", deadline_s=2.0)
        link = FlakyLink(prefill)
        full, free = make_server(tiny_vl_dir, "decode", link), make_server(tiny_vl_dir, "decode", link)
        hog = full.engine.kv.pool.allocate(60)  # type: ignore[attr-defined]  # other requests' blocks
        handle = TwoDecodeHandle(full, free)
        client = PDClient(PrefillHandle(prefill), handle, reroute_timeout_s=5.0)

        assert await tokens(client, "r") == colocated
        assert handle.asked == [full.replica_id, free.replica_id]
        assert client.decode_refusals == 1 and client.prefilled_again == 0
        assert full.kv_stats.refused_imports == 1 and full.kv_stats.failed_imports == 0
        assert full.engine.stats().num_free_blocks == 4 and not full.engine.scheduler.requests  # type: ignore[attr-defined]
        assert prefill.kv_stats.handoffs == prefill.kv_stats.pulls == 1  # one prefill, one pull

        free.engine.kv.pool.allocate(60)  # type: ignore[attr-defined]  # now both are short
        handle.asked.clear()
        with pytest.raises(Exception) as err:
            await tokens(client, "s")
        assert getattr(err.value, "code", None) == "overloaded" and err.value.status_code == 503  # type: ignore[attr-defined]
        assert "4 KV blocks" in str(err.value)
        assert len(handle.asked) == MAX_DECODE_TRIES
        assert set(handle.asked) == {full.replica_id, free.replica_id}
        # the prefill replica let the refused hand-off's pin go at once, not at its 2 s deadline
        assert client.abandoned == 1 and prefill.kv_stats.abandoned == 1 and prefill.kv_stats.expired == 0
        assert len(prefill._prefill.pins) == 0 and not prefill.engine.scheduler.handed_off  # type: ignore[union-attr,attr-defined]
        assert prefill.engine.stats().num_free_blocks == 64  # type: ignore[attr-defined]
        full.engine.kv.pool.free(hog)  # type: ignore[attr-defined]
        assert full.engine.stats().num_free_blocks == 64  # type: ignore[attr-defined]  # the refusals held none

    asyncio.run(scenario())
