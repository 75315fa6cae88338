"""Output channels: one message per engine step per ingress, requests never lost between channels,
and requests of a channel nobody reads are handed back for abort."""

from __future__ import annotations

import asyncio

import pytest

from llm_service.output_channels import ChannelBatch, ChannelGone, OutputChannels
from llm_service.outputs import RequestOutput


def _out(rid: str, tok: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid, [tok], None, finished, "length" if finished else None, 3, 0)


async def _take(it: object, n: int) -> list[ChannelBatch]:
    return [await it.__anext__() for _ in range(n)]  # type: ignore[attr-defined]


def test_one_batch_per_step_per_ingress_and_close_after_linger() -> None:
    async def scenario() -> None:
        orphans: list[list[str]] = []
        ch = OutputChannels("rep-1", orphans.append, linger_s=0.05)
        a = ch.register("ing-A", "r1")
        assert ch.register("ing-A", "r2") == a  # same ingress: same channel
        b = ch.register("ing-B", "r3")
        assert b != a
        sa, sb = ch.stream(a), ch.stream(b)
        hello_a, hello_b = (await _take(sa, 1))[0], (await _take(sb, 1))[0]
        assert hello_a.replica_id == "rep-1" and not hello_a and hello_b.replica_id == "rep-1"
        ch.deliver([_out("r1", 1), _out("r2", 1), _out("r3", 1)])  # one engine step
        (batch,) = await _take(sa, 1)
        assert [(o.request_id, o.new_token_ids) for o in batch.outputs] == [("r1", [1]), ("r2", [1])]
        ch.deliver([_out("r1", 2, True), _out("r2", 2, True), _out("r3", 2, True)])
        (batch,) = await _take(sa, 1)
        assert [o.finished for o in batch.outputs] == [True, True]
        with pytest.raises(StopAsyncIteration):  # nothing open: closes after the linger
            await sa.__anext__()
        (b_batch,) = await _take(sb, 1)  # B read late: both steps coalesced into one message
        assert [o.new_token_ids for o in b_batch.outputs] == [[1], [2]]
        assert ch.register("ing-A", "r4") != a  # a closed channel is never reused
        assert orphans == []

    asyncio.run(scenario())


def test_a_request_registered_during_the_linger_keeps_the_channel() -> None:
    async def scenario() -> None:
        ch = OutputChannels("rep-1", lambda rids: None, linger_s=0.2)
        cid = ch.register("ing", "r1")
        s = ch.stream(cid)
        await _take(s, 1)
        ch.deliver([_out("r1", 1, True)])
        await _take(s, 1)
        nxt = asyncio.ensure_future(s.__anext__())  # lingering now
        await asyncio.sleep(0.05)
        assert ch.register("ing", "r2") == cid
        ch.deliver([_out("r2", 9, True)])
        batch = await nxt
        assert batch.outputs[0].request_id == "r2"

    asyncio.run(scenario())


def test_errors_go_to_their_request_only() -> None:
    async def scenario() -> None:
        ch = OutputChannels("rep-1", lambda rids: None, linger_s=0.01)
        cid = ch.register("ing", "bad")
        ch.register("ing", "ok")
        s = ch.stream(cid)
        await _take(s, 1)
        ch.fail("bad", ValueError("prompt too long"))
        (batch,) = await _take(s, 1)
        assert [(rid, str(e)) for rid, e in batch.errors] == [("bad", "prompt too long")]
        ch.deliver([_out("ok", 1, True), _out("bad", 5)])  # nothing more for the failed one
        (batch,) = await _take(s, 1)
        assert [o.request_id for o in batch.outputs] == ["ok"]

    asyncio.run(scenario())


def test_a_reader_that_leaves_orphans_its_requests() -> None:
    async def scenario() -> list[list[str]]:
        orphans: list[list[str]] = []
        ch = OutputChannels("rep-1", orphans.append, linger_s=5)
        cid = ch.register("ing", "r1")
        ch.register("ing", "r2")
        s = ch.stream(cid)
        await _take(s, 1)
        await s.aclose()  # the ingress hung up (or died)
        with pytest.raises(ChannelGone):
            await ch.stream(cid).__anext__()
        return orphans

    assert asyncio.run(scenario()) == [["r1", "r2"]]


def test_a_channel_nobody_connects_to_is_dropped() -> None:
    async def scenario() -> list[list[str]]:
        orphans: list[list[str]] = []
        ch = OutputChannels("rep-1", orphans.append, connect_timeout_s=10)
        cid = ch.register("ing", "r1")
        ch.drop_unconnected(now=ch._channels[cid].created + 11)
        assert len(ch) == 0
        assert ch.register("ing", "r2") != cid
        return orphans

    assert asyncio.run(scenario()) == [["r1"]]
