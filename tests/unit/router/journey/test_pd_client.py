"""E/P/D's journey without Ray: ``PDClient`` over a real prefill ``LLMServer`` and a real decode one,
each with a real engine on the tiny Qwen2-VL; Serve's handles are shims calling the servers, the
direct link a shim calling the prefill server's ``pull_kv``. Greedy tokens equal a colocated engine's;
a lost prefill replica or a failed transfer is prefilled again, the decode replica's blocks freed;
an unpulled hand-off is freed at its deadline."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from llm_service.config import EngineConfig
from llm_service.request_spec import LLMRequestSpec, ReplicaTarget
from llm_service.sampling_params import SamplingParams
from llm_service.serve.deployment import HandoffWiring, LLMServer
from router.journey.pd_client import PDClient
from tests.unit.router.journey.test_llm_client import FakeLLMHandle

PROMPT = [(7 * i + 3) % 150 + 10 for i in range(37)]  # 37 tokens: 9 full blocks of 4 and a partial one
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
STEP_S = 0.2  # kv_pull_chunks tests: a prefill step takes this much more (a larger model's), so the
# decode replica's pulls, a few event-loop hops each, land between the chunks even on a loaded host


class ActorDiedError(RuntimeError):
    """Named as Ray's: ``replica_gone`` matches it by name."""


class FlakyLink:
    """The decode replica's link to the prefill replica: ``pull_kv`` on it, failing ``fail`` times first."""

    def __init__(self, prefill: LLMServer, fail: int = 0) -> None:
        self.prefill, self.fail, self.calls = prefill, fail, 0

    async def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        assert method in ("pull_kv", "pull_kv_chunks")
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise ConnectionError("link lost mid-pull")
        return await getattr(self.prefill, method)(*args)


class PrefillHandle:
    """``prefill.remote(spec)``, whose first ``lose`` calls find the replica dead."""

    def __init__(self, server: LLMServer, lose: int = 0) -> None:
        self.server, self.lose, self.calls = server, lose, 0

    @property
    def prefill(self) -> Any:
        async def call(spec: LLMRequestSpec) -> Any:
            self.calls += 1
            if self.lose:
                self.lose -= 1
                raise ActorDiedError("the prefill replica died")
            return await self.server.prefill(spec)

        return SimpleNamespace(remote=call)

    @property
    def stats(self) -> Any:
        async def call(target: Any) -> Any:
            return self.server.stats(target)

        return SimpleNamespace(remote=call)

    @property
    def abort(self) -> Any:
        return SimpleNamespace(remote=self.server.abort)


class DecodeHandle(FakeLLMHandle):
    """The decode pool's handle, its ``stats`` too."""

    @property
    def stats(self) -> Any:
        async def call(target: Any) -> Any:
            return self.server.stats(target)

        return SimpleNamespace(remote=call)


def _server(
    model_dir: Path,
    role: str,
    link: Any = None,
    deadline_s: float = 30.0,
    pull_chunks: bool = False,
    num_kv_blocks: int = 64,
) -> LLMServer:
    async def address() -> tuple[str, int]:
        return ("127.0.0.1", 1)

    config = EngineConfig(
        model=str(model_dir), block_size=4, num_kv_blocks=num_kv_blocks, max_num_batched_tokens=16
    )
    wiring = HandoffWiring(
        address, lambda _: link, deadline_s=deadline_s, timeout_s=5.0, pull_chunks=pull_chunks
    )
    return LLMServer(config, "tiny", role=role, handoff=None if role == "both" else wiring)


async def _tokens(client: PDClient, rid: str) -> list[int]:
    spec = LLMRequestSpec(rid, list(PROMPT), PARAMS)
    out: list[int] = []
    async for o in client.stream(spec):
        out += o.new_token_ids
    return out


@pytest.fixture(scope="module")
def colocated(tiny_vl_dir: Path) -> list[int]:
    async def run() -> list[int]:
        server = _server(tiny_vl_dir, "both")
        out: list[int] = []
        async for o in server.loop.stream("c", list(PROMPT), PARAMS, []):
            out += o.new_token_ids
        return out

    return asyncio.run(run())


def test_journey_equals_colocated_and_recovers_from_losses(tiny_vl_dir: Path, colocated: list[int]) -> None:
    async def scenario() -> None:
        prefill = _server(tiny_vl_dir, "prefill")
        link = FlakyLink(prefill)
        decode = _server(tiny_vl_dir, "decode", link)
        handle = PrefillHandle(prefill)
        client = PDClient(handle, DecodeHandle(decode), reroute_timeout_s=5.0)
        free = decode.engine.stats().num_free_blocks  # type: ignore[attr-defined]

        assert await _tokens(client, "a") == colocated
        assert (prefill.kv_stats.handoffs, prefill.kv_stats.pulls, decode.kv_stats.imports) == (1, 1, 1)
        assert decode.kv_stats.blocks_pulled == 10  # 9 full blocks and the partial one

        handle.lose = 1  # the prefill replica dies before its answer: prefilled again
        assert await _tokens(client, "b") == colocated
        assert handle.calls == 3 and client.prefilled_again == 1
        # the decode replica held "a"'s full blocks under the same hashes: nothing but the partial block crossed
        assert decode.kv_stats.blocks_hit == 9 and decode.kv_stats.blocks_pulled == 11

        link.fail = 1  # the pull fails: the decode replica frees its blocks, the request is prefilled again
        assert await _tokens(client, "c") == colocated
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
        prefill = _server(tiny_vl_dir, "prefill", deadline_s=0.2)
        engine: Any = prefill.engine
        handoff = await prefill.prefill(LLMRequestSpec("x", list(PROMPT), PARAMS))
        assert handoff.handed_off and handoff.num_blocks == 10 and len(handoff.block_hashes) == 9
        assert engine.stats().num_free_blocks == 64 - 10
        for _ in range(100):
            if prefill.kv_stats.expired:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
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
        prefill = _server(tiny_vl_dir, "prefill")
        link = FlakyLink(prefill)
        dying, successor = _server(tiny_vl_dir, "decode", link), _server(tiny_vl_dir, "decode", link)
        client = PDClient(PrefillHandle(prefill), DyingDecodeHandle(dying, successor), reroute_timeout_s=5.0)
        assert await _tokens(client, "d") == colocated
        assert client.prefilled_again == 1 and client.rerouted == 1
        assert prefill.kv_stats.handoffs == prefill.kv_stats.pulls == 2  # the second pin was pulled too
        assert (dying.kv_stats.imports, successor.kv_stats.imports) == (1, 1)
        await dying.abort(ReplicaTarget(dying.replica_id, request_ids=("d",)))  # (the "dead" one's leftovers)

    asyncio.run(scenario())


class TwoDecodeHandle(FakeLLMHandle):
    """Two decode replicas behind one handle, routed as ``FreeKVRouter`` routes a hand-off: the first
    one that has not refused it (``KVHandoff.refused_by``), else the first."""

    def __init__(self, first: LLMServer, second: LLMServer) -> None:
        super().__init__(first)
        self.replicas = [first, second]
        self.asked: list[str] = []

    @property
    def submit(self) -> Any:
        def route(spec: LLMRequestSpec) -> Any:
            refused = spec.handoff.refused_by if spec.handoff is not None else ()
            self.server = next((s for s in self.replicas if s.replica_id not in refused), self.replicas[0])
            self.asked.append(self.server.replica_id)
            return super(TwoDecodeHandle, self).submit.remote(spec)

        return SimpleNamespace(remote=route)


def test_a_decode_replica_short_of_blocks_refuses_and_another_takes_the_import(
    tiny_vl_dir: Path, colocated: list[int]
) -> None:
    """The first decode replica's pool is held by other requests (4 blocks free of 64; the import needs
    10): it refuses the import as overloaded, allocating nothing, and the ingress sends the same hand-off
    (the prefill replica's pin still stands) to the second, which answers. When both are short, the
    ingress stops after ``MAX_DECODE_TRIES`` with the retryable 503 ``overloaded``."""
    from router.journey.pd_client import MAX_DECODE_TRIES

    async def scenario() -> None:
        prefill = _server(tiny_vl_dir, "prefill", deadline_s=2.0)
        link = FlakyLink(prefill)
        full, free = _server(tiny_vl_dir, "decode", link), _server(tiny_vl_dir, "decode", link)
        hog = full.engine.kv.pool.allocate(60)  # type: ignore[attr-defined]  # other requests' blocks
        handle = TwoDecodeHandle(full, free)
        client = PDClient(PrefillHandle(prefill), handle, reroute_timeout_s=5.0)

        assert await _tokens(client, "r") == colocated
        assert handle.asked == [full.replica_id, free.replica_id]
        assert client.decode_refusals == 1 and client.prefilled_again == 0
        assert full.kv_stats.refused_imports == 1 and full.kv_stats.failed_imports == 0
        assert full.engine.stats().num_free_blocks == 4 and not full.engine.scheduler.requests  # type: ignore[attr-defined]
        assert prefill.kv_stats.handoffs == prefill.kv_stats.pulls == 1  # one prefill, one pull

        free.engine.kv.pool.allocate(60)  # type: ignore[attr-defined]  # now both are short
        handle.asked.clear()
        with pytest.raises(Exception) as err:
            await _tokens(client, "s")
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


def test_chunk_by_chunk_pull_overlaps_the_prefill_and_equals_colocated(
    tiny_vl_dir: Path, colocated: list[int]
) -> None:
    """``kv_pull_chunks``: the prefill replica answers at once, the decode replica allocates the blocks
    and pulls each chunk's full blocks while the next one computes (every prefill step here takes
    200 ms more, a larger model's: the 37-token prompt runs in chunks of 16, 16 and 5), then the rest and
    the first token. Greedy tokens equal a colocated engine's; a first token that ends the request
    comes back alone; nothing is left held on either side."""
    import time

    async def scenario() -> None:
        prefill = _server(tiny_vl_dir, "prefill", pull_chunks=True)
        engine: Any = prefill.engine
        step = engine.step

        def slow_step() -> Any:
            time.sleep(STEP_S)
            return step()

        engine.step = slow_step
        decode = _server(tiny_vl_dir, "decode", FlakyLink(prefill))
        client = PDClient(PrefillHandle(prefill), DecodeHandle(decode), reroute_timeout_s=5.0)

        assert await _tokens(client, "o") == colocated
        assert decode.kv_stats.blocks_pulled == 10  # 9 full blocks and the partial one
        assert decode.kv_stats.blocks_overlapped >= 4  # the first chunk's, at least, pulled early
        assert prefill.kv_stats.pulls == 1 and prefill.kv_stats.handoffs == 1

        spec = LLMRequestSpec("one", [*PROMPT[:-1], 77], SamplingParams(max_tokens=1))
        outs = [o async for o in client.stream(spec)]
        assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length"
        assert len(outs[0].new_token_ids) == 1

        await asyncio.sleep(0.05)
        for server in (prefill, decode):
            st: Any = server.engine.stats()  # type: ignore[attr-defined]
            assert st.num_free_blocks == 64 and st.num_running == 0
        assert len(prefill._prefill.pins) == 0 and not prefill._prefill.early._firsts  # type: ignore[union-attr]

        # a prefill replica hashing the prompt otherwise (another version, a bug): its hashes come with
        # the last pull and the decode replica refuses the blocks, as it does a plain hand-off's at once
        engine.handoff_hashes = lambda rid: [b"\0" * 16 for _ in range(len(PROMPT) // 4)]
        with pytest.raises(Exception, match="block hashes differ") as err:
            await _tokens(client, "other-hashes")
        assert getattr(err.value, "code", None) == "kv_transfer_failed"
        assert decode.kv_stats.failed_imports == 2 and client.prefilled_again == 1  # prefilled again once
        st = decode.engine.stats()  # type: ignore[attr-defined]
        assert st.num_free_blocks == 64 and st.num_running == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("family", ["gemma3", "qwen3.5"])
def test_chunk_by_chunk_pull_of_window_and_hybrid_families_equals_hf(family: str) -> None:
    """The chunks' full-attention blocks cross early; Gemma 3's window blocks and Qwen3.5's linear
    state only with the last pull (they are final only once the prompt is): greedy tokens equal HF's."""
    import time

    from tests.hf_oracle import hf_generate_ids
    from tests.tiny_dirs import tiny_model_dir

    model_dir = tiny_model_dir(family)
    prompt = [(7 * i + 3) % 150 + 10 for i in range(45)]
    params = SamplingParams(max_tokens=8)

    async def scenario() -> list[int]:
        prefill = _server(model_dir, "prefill", pull_chunks=True)
        engine: Any = prefill.engine
        step = engine.step
        engine.step = lambda: (time.sleep(STEP_S), step())[1]  # a larger model's step time
        decode = _server(model_dir, "decode", FlakyLink(prefill))
        client = PDClient(PrefillHandle(prefill), DecodeHandle(decode), reroute_timeout_s=5.0)
        out: list[int] = []
        async for o in client.stream(LLMRequestSpec("w", prompt, params)):
            out += o.new_token_ids
        assert decode.kv_stats.blocks_overlapped >= 4 and decode.kv_stats.blocks_pulled == 12
        return out

    assert asyncio.run(scenario()) == hf_generate_ids(model_dir, prompt, 8)


def test_a_chunk_pull_before_the_prefill_started_waits_for_its_first_chunk(tiny_vl_dir: Path) -> None:
    """The decode replica's first ``pull_kv_chunks`` may come before the request has reached the
    prefill engine: it waits for the first chunk's blocks (it does not take the request for done and
    wait out the whole prefill); the chunks then come in order, the last answer a plain pull's."""
    import time

    async def scenario() -> None:
        prefill = _server(tiny_vl_dir, "prefill", pull_chunks=True)
        engine: Any = prefill.engine
        step = engine.step
        engine.step = lambda: (time.sleep(STEP_S), step())[1]
        handoff = await prefill.prefill(LLMRequestSpec("e", list(PROMPT), PARAMS))
        assert handoff.early and handoff.num_blocks == 10 and not engine.scheduler.requests
        got, done, parts = 0, False, []
        while not done:
            part, done = await prefill.pull_kv_chunks("e", got)
            if part is not None:
                parts.append((part.from_block, part.num_blocks, done))
                got += part.num_blocks
        assert parts[0] in ((0, 4, False), (0, 8, False))  # a chunk's 16 tokens: 4 full blocks (or two)
        assert parts[-1][2] and parts[-1][0] + parts[-1][1] == 10 and got == 10
        assert part is not None and part.first is not None and len(part.first.new_token_ids) == 1
        await asyncio.sleep(0.05)
        assert len(prefill._prefill.pins) == 0 and engine.stats().num_free_blocks == 64  # type: ignore[union-attr]

    asyncio.run(scenario())


def test_an_early_handoff_rejected_or_refused_everywhere_leaves_nothing_on_the_prefill_side(
    tiny_vl_dir: Path,
) -> None:
    """``kv_pull_chunks``: the prefill replica answers before its engine has seen the request. One its
    engine then rejects (here its pool, 10 blocks, can never hold the 11 the request needs; the decode
    replicas' 64 can: pools on machines of different memory) reaches the client as that
    ``RequestRejected`` (``too_many_blocks``, a 400), not as a failed transfer prefilled again into a
    503. One every decode replica refuses (both short of blocks) is the 503 ``overloaded``, and the
    prefill replica is told to give it up at once: its prefill aborted or its pin freed, not kept to
    the 30 s deadline."""
    import time

    async def scenario() -> None:
        prefill = _server(tiny_vl_dir, "prefill", pull_chunks=True, num_kv_blocks=10)
        engine: Any = prefill.engine
        step = engine.step

        def slow_step() -> Any:
            time.sleep(STEP_S)
            return step()

        engine.step = slow_step
        link = FlakyLink(prefill)
        first, second = _server(tiny_vl_dir, "decode", link), _server(tiny_vl_dir, "decode", link)
        client = PDClient(PrefillHandle(prefill), TwoDecodeHandle(first, second), reroute_timeout_s=5.0)

        with pytest.raises(Exception) as err:
            await _tokens(client, "too-long")  # 37 prompt tokens + 8 new: 11 blocks of 4
        assert getattr(err.value, "code", None) == "too_many_blocks", err.value
        assert "the pool has 10" in str(err.value)
        assert client.prefilled_again == 0 and first.kv_stats.failed_imports == 1
        assert first.engine.stats().num_free_blocks == 64  # type: ignore[attr-defined]

        for server in (first, second):
            server.engine.kv.pool.allocate(60)  # type: ignore[attr-defined]  # other requests' blocks
        with pytest.raises(Exception) as err:
            spec = LLMRequestSpec("refused", PROMPT[:30], PARAMS)  # 10 blocks: it fits the prefill side
            async for _ in client.stream(spec):
                pass
        assert getattr(err.value, "code", None) == "overloaded", err.value
        assert client.abandoned >= 1 and prefill.kv_stats.abandoned == 1
        assert not engine.scheduler.requests and not engine.scheduler.handed_off
        assert len(prefill._prefill.pins) == 0 and not prefill._prefill.early._firsts  # type: ignore[union-attr]
        assert engine.stats().num_free_blocks == 10

    asyncio.run(scenario())
