"""E/P/D's ``kv_pull_chunks`` journey without Ray (tests/unit/router/journey/pd_world.py's real servers and
shims): the decode replica pulls each chunk's full blocks while the next one computes; window and hybrid
families' final parts come with the last pull; an early hand-off the prefill side rejects, or every decode
replica refuses, leaves nothing held."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from llm_service.request_spec import LLMRequestSpec
from llm_service.sampling_params import SamplingParams
from router.journey.pd_client import PDClient
from tests.unit.router.journey.pd_world import (
    PARAMS,
    PROMPT,
    DecodeHandle,
    FlakyLink,
    PrefillHandle,
    TwoDecodeHandle,
    make_server,
    slow_steps,
    tokens,
)


def test_chunk_by_chunk_pull_overlaps_the_prefill_and_equals_colocated(
    tiny_vl_dir: Path, colocated: list[int]
) -> None:
    """``kv_pull_chunks``: the prefill replica answers at once, the decode replica allocates the blocks
    and pulls each chunk's full blocks while the next one computes (every prefill step here takes
    200 ms more, a larger model's: the 37-token prompt runs in chunks of 16, 16 and 5), then the rest and
    the first token. Greedy tokens equal a colocated engine's; a first token that ends the request
    comes back alone; nothing is left held on either side."""

    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill", pull_chunks=True)
        engine = slow_steps(prefill)
        decode = make_server(tiny_vl_dir, "decode", FlakyLink(prefill))
        client = PDClient(PrefillHandle(prefill), DecodeHandle(decode), reroute_timeout_s=5.0)

        assert await tokens(client, "o") == colocated
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
            await tokens(client, "other-hashes")
        assert getattr(err.value, "code", None) == "kv_transfer_failed"
        assert decode.kv_stats.failed_imports == 2 and client.prefilled_again == 1  # prefilled again once
        st = decode.engine.stats()  # type: ignore[attr-defined]
        assert st.num_free_blocks == 64 and st.num_running == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("family", ["gemma3", "qwen3.5"])
def test_chunk_by_chunk_pull_of_window_and_hybrid_families_equals_hf(family: str) -> None:
    """The chunks' full-attention blocks cross early; Gemma 3's window blocks and Qwen3.5's linear
    state only with the last pull (they are final only once the prompt is): greedy tokens equal HF's."""
    from tests.hf_oracle import hf_generate_ids
    from tests.tiny_dirs import tiny_model_dir

    model_dir = tiny_model_dir(family)
    prompt = [(7 * i + 3) % 150 + 10 for i in range(45)]
    params = SamplingParams(max_tokens=8)

    async def scenario() -> list[int]:
        prefill = make_server(model_dir, "prefill", pull_chunks=True)
        slow_steps(prefill)
        decode = make_server(model_dir, "decode", FlakyLink(prefill))
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

    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill", pull_chunks=True)
        engine = slow_steps(prefill)
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

    async def scenario() -> None:
        prefill = make_server(tiny_vl_dir, "prefill", pull_chunks=True, num_kv_blocks=10)
        engine = slow_steps(prefill)
        link = FlakyLink(prefill)
        first, second = make_server(tiny_vl_dir, "decode", link), make_server(tiny_vl_dir, "decode", link)
        client = PDClient(PrefillHandle(prefill), TwoDecodeHandle(first, second), reroute_timeout_s=5.0)

        with pytest.raises(Exception) as err:
            await tokens(client, "too-long")  # 37 prompt tokens + 8 new: 11 blocks of 4
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
