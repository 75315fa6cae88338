"""The ingress's hit path (Orchestrator + ``RequestPreparer.prepare_hits``), without Ray: the real
Preprocessor on the tiny Qwen2-VL, the real cache client and shard in-process behind a ``.remote``
shim, and the real ``RequestPreparer`` standing in for the encoder replica's ``prepare`` (its encode
fake commits to the index as the encoder does).

What it must hold: a request the cache holds whole is prepared at the ingress alone, with exactly
the prompt and items the replica would have made; any other is looked up once (the replica gets the
answers and the reservations, and neither hashes nor looks up again); a client's bad input is its
4xx from the hit path; a failing shard costs the shortcut, never the request; nothing stays reserved.
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace
from typing import Any

import pytest

from encoder_service.cache.near_cache import NearCache
from encoder_service.preprocess.prepare import RequestPreparer
from encoder_service.types import MediaRef
from llm_service.outputs import RequestOutput
from llm_service.sampling_params import SamplingParams
from router.protocol.errors import from_exception
from router.protocol.messages import NormalizedChat
from tests.fakes import Clock
from tests.media import make_image_bytes
from tests.unit.router.journey.hit_path_world import (
    CountingShard,
    Setup,
    make_setup,
)


@pytest.fixture
def setup(tiny_vl_dir: Any) -> Setup:
    return make_setup(str(tiny_vl_dir))


def _png(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(make_image_bytes(64, 48, seed=seed)).decode()


def _chat(*refs: MediaRef) -> NormalizedChat:
    content: list[dict[str, Any]] = [{"type": "image", "media": r} for r in refs]
    content.append({"type": "text", "text": "What is it?"})
    return NormalizedChat([{"role": "user", "content": content}], list(refs))


def _image(seed: int | None = None, uuid_: str | None = None, url: str | None = None) -> MediaRef:
    return MediaRef("image", url=url or (_png(seed) if seed is not None else None), uuid=uuid_)


async def _nothing_reserved(shard: CountingShard) -> None:
    stats = await shard.stats()
    assert stats["reserved"] == 0, stats


def _items(prepared: Any) -> list[tuple[Any, ...]]:
    return [(m.offset, m.length, m.mm_hash, m.grid_thw, m.ref[0].hex()) for m in prepared.mm_items]


def test_a_warm_request_is_prepared_at_the_ingress_exactly_as_the_replica_would(setup: Setup) -> None:
    asyncio.run(_a_warm_request_is_prepared_at_the_ingress_exactly_as_the_replica_would(setup))


async def _a_warm_request_is_prepared_at_the_ingress_exactly_as_the_replica_would(setup: Setup) -> None:
    cold = await setup.orch.prepare("r1", _chat(_image(1)))
    assert len(setup.replica.prepare_calls) == 1 and setup.orch.calls.hit_path_served == 0
    warm = await setup.orch.prepare("r2", _chat(_image(1)))
    assert len(setup.replica.prepare_calls) == 1, "a request the cache holds whole makes no prepare call"
    assert setup.orch.calls.hit_path_served == 1
    assert warm.prompt_token_ids == cold.prompt_token_ids
    assert _items(warm) == _items(cold)
    # The replica, asked directly, prepares the same prompt (the hit path is not a second implementation).
    direct = await setup.replica.preparer.prepare("r3", _chat(_image(1)).messages)
    assert direct.prompt_token_ids == warm.prompt_token_ids
    await _nothing_reserved(setup.shard)


def test_a_cold_request_is_looked_up_once_and_its_reservation_handed_on(setup: Setup) -> None:
    asyncio.run(_a_cold_request_is_looked_up_once_and_its_reservation_handed_on(setup))


async def _a_cold_request_is_looked_up_once_and_its_reservation_handed_on(setup: Setup) -> None:
    await setup.orch.prepare("r1", _chat(_image(2)))
    (looked_up,) = setup.replica.prepare_calls
    assert looked_up is not None and len(looked_up.hashes) == 1
    assert [kind for kind, _ in looked_up.found.values()] == ["compute"]
    assert setup.shard.lookup_calls == 1, "the replica must not look the item up again"
    assert setup.replica.encoded == looked_up.hashes
    await _nothing_reserved(setup.shard)


def test_a_data_url_is_decoded_once_on_its_way_to_the_replica(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    from encoder_service.preprocess.media import fetch

    decodes: list[int] = []
    decode = fetch.pybase64.b64decode

    def counted(payload: Any, *args: Any, **kwargs: Any) -> bytes:
        decodes.append(len(payload))
        return decode(payload, *args, **kwargs)

    monkeypatch.setattr(fetch.pybase64, "b64decode", counted)
    asyncio.run(_a_data_url_is_decoded_once_on_its_way_to_the_replica(setup, decodes))


async def _a_data_url_is_decoded_once_on_its_way_to_the_replica(setup: Setup, decodes: list[int]) -> None:
    """The hit path decodes the cold image's data URL to hash it; the replica it hands the miss to
    gets the bytes in the message part (not the base64) and decodes nothing."""
    png = make_image_bytes(64, 48, seed=7)
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    prepared = await setup.orch.prepare("r1", _chat(MediaRef("image", url=url)))
    assert len(decodes) == 1, decodes
    ((part, _),) = [m["content"] for m in setup.replica.received[0]]
    assert part["media"].url is None and part["media"].data == png
    # the same answer as a replica given the data URL itself (which decodes it once more)
    direct = await setup.replica.preparer.prepare("r2", _chat(MediaRef("image", url=url)).messages)
    assert len(decodes) == 2
    assert direct.prompt_token_ids == prepared.prompt_token_ids
    assert [it.mm_hash for it in direct.items] == [it.mm_hash for it in prepared.mm_items]
    await _nothing_reserved(setup.shard)


def test_a_partial_hit_hands_on_the_hit_and_encodes_only_the_miss(setup: Setup) -> None:
    asyncio.run(_a_partial_hit_hands_on_the_hit_and_encodes_only_the_miss(setup))


async def _a_partial_hit_hands_on_the_hit_and_encodes_only_the_miss(setup: Setup) -> None:
    await setup.orch.prepare("r1", _chat(_image(3)))
    setup.replica.encoded.clear()
    prepared = await setup.orch.prepare("r2", _chat(_image(3), _image(4)))
    looked_up = setup.replica.prepare_calls[-1]
    assert looked_up is not None
    assert sorted(kind for kind, _ in looked_up.found.values()) == ["compute", "hit"]
    assert setup.replica.encoded == [looked_up.hashes[1]]
    assert [m.mm_hash for m in prepared.mm_items] == looked_up.hashes
    await _nothing_reserved(setup.shard)


def test_a_uuid_alone_is_served_at_the_ingress_and_an_unknown_one_is_a_named_400(setup: Setup) -> None:
    asyncio.run(_a_uuid_alone_is_served_at_the_ingress_and_an_unknown_one_is_a_named_400(setup))


async def _a_uuid_alone_is_served_at_the_ingress_and_an_unknown_one_is_a_named_400(setup: Setup) -> None:
    first = await setup.orch.prepare("r1", _chat(_image(5, uuid_="cat")))
    await setup.orch.settle("r1")  # what the ingress does before r1's last chunk goes out
    by_name = await setup.orch.prepare("r2", _chat(_image(uuid_="cat")))
    assert setup.orch.calls.hit_path_served == 1 and len(setup.replica.prepare_calls) == 1
    assert by_name.prompt_token_ids == first.prompt_token_ids
    with pytest.raises(Exception) as e:
        await setup.orch.prepare("r3", _chat(_image(uuid_="never-sent")))
    api = from_exception(e.value)
    assert api is not None and api.status_code == 400 and api.code == "mm_cache_miss"
    assert "never-sent" in str(e.value)
    assert len(setup.replica.prepare_calls) == 1, "a client's error is answered without the replica"
    await _nothing_reserved(setup.shard)


def test_bad_bytes_are_the_clients_4xx_naming_the_item(setup: Setup) -> None:
    asyncio.run(_bad_bytes_are_the_clients_4xx_naming_the_item(setup))


async def _bad_bytes_are_the_clients_4xx_naming_the_item(setup: Setup) -> None:
    broken = "data:image/png;base64," + base64.b64encode(b"not a png at all").decode()
    with pytest.raises(Exception) as e:
        await setup.orch.prepare("r1", _chat(_image(6), MediaRef("image", url=broken)))
    api = from_exception(e.value)
    assert api is not None and 400 <= api.status_code < 500 and "image 1" in api.message
    assert setup.replica.prepare_calls == []
    await _nothing_reserved(setup.shard)


def test_a_failing_shard_costs_the_shortcut_not_the_request(setup: Setup) -> None:
    asyncio.run(_a_failing_shard_costs_the_shortcut_not_the_request(setup))


async def _a_failing_shard_costs_the_shortcut_not_the_request(setup: Setup) -> None:
    setup.shard.fail_lookups = 1
    prepared = await setup.orch.prepare("r1", _chat(_image(7)))
    (looked_up,) = setup.replica.prepare_calls
    assert looked_up is None, "the replica prepares it from scratch, under a fresh attempt id"
    assert len(prepared.mm_items) == 1 and setup.replica.encoded == [prepared.mm_items[0].mm_hash]
    await _nothing_reserved(setup.shard)


def test_media_it_would_have_to_fetch_goes_straight_to_prepare(setup: Setup) -> None:
    asyncio.run(_media_it_would_have_to_fetch_goes_straight_to_prepare(setup))


async def _media_it_would_have_to_fetch_goes_straight_to_prepare(setup: Setup) -> None:
    calls: list[Any] = []

    async def prepare(request_id: str, messages: Any, looked_up: Any = None) -> Any:
        calls.append(looked_up)
        raise RuntimeError("stop here: nothing is fetched in this test")

    setup.orch.handles.encoder = SimpleNamespace(prepare=SimpleNamespace(remote=prepare))  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="stop here"):
        await setup.orch.prepare("r1", _chat(_image(8), _image(url="http://127.0.0.1:9/cat.png")))
    assert calls == [None] and setup.shard.lookup_calls == 0


def _with_near_cache(setup: Setup, clock: Clock) -> RequestPreparer:
    """The setup's hit path, given a near cache of 8 entries for 30 s on ``clock``."""
    hit_path = setup.orch.handles.hit_path
    assert isinstance(hit_path, RequestPreparer)
    hit_path.near = NearCache(8, ttl_s=30.0, clock=clock)
    return hit_path


def test_the_near_cache_serves_what_a_prepare_just_made_until_its_ttl(setup: Setup) -> None:
    asyncio.run(_near_cache_serves_until_ttl(setup))


async def _near_cache_serves_until_ttl(setup: Setup) -> None:
    clock = Clock()
    hit_path = _with_near_cache(setup, clock)
    cold = await setup.orch.prepare("r1", _chat(_image(11)))  # learnt from the prepare reply
    calls = setup.shard.lookup_calls
    warm = await setup.orch.prepare("r2", _chat(_image(11)))
    assert setup.shard.lookup_calls == calls, "a near-cache hit asks no shard"
    assert _items(warm) == _items(cold) and warm.prompt_token_ids == cold.prompt_token_ids
    assert hit_path.near.stats()["hits"] == 1
    clock.now = 31.0  # past the ttl: the index is asked again (and its hit remembered anew)
    await setup.orch.prepare("r3", _chat(_image(11)))
    assert setup.shard.lookup_calls == calls + 1
    await setup.orch.prepare("r4", _chat(_image(11)))
    assert setup.shard.lookup_calls == calls + 1
    assert setup.orch.calls.hit_path_served == 3 and len(setup.replica.prepare_calls) == 1
    await _nothing_reserved(setup.shard)


def test_lost_embeddings_are_dropped_from_the_near_cache(setup: Setup) -> None:
    asyncio.run(_lost_embeddings_are_dropped(setup))


async def _lost_embeddings_are_dropped(setup: Setup) -> None:
    hit_path = _with_near_cache(setup, Clock())
    prepared = await setup.orch.prepare("r1", _chat(_image(12)))
    (item,) = prepared.mm_items
    assert len(hit_path.near) == 1
    await setup.orch._invalidate("r1", [item.mm_hash], prepared.mm_items, attempt=1)
    assert len(hit_path.near) == 0
    again = await setup.orch.prepare("r2", _chat(_image(12)))  # the index dropped it too: re-encoded
    assert len(setup.replica.prepare_calls) == 2 and again.mm_items[0].ref[0] != item.ref[0]
    await _nothing_reserved(setup.shard)


class TwoTokenLLM:
    """The LLMClient surface: every request gets two outputs, the second finished."""

    async def submit(self, spec: Any) -> Any:
        self.spec = spec
        return SimpleNamespace(replica_id="llm-0", channel_id="ch-0")

    async def outputs(self, request_id: str, reply: Any) -> Any:
        n = len(self.spec.prompt_token_ids)
        yield RequestOutput(request_id, [7], None, False, None, n, 0)
        yield RequestOutput(request_id, [8], None, True, "length", n, 0)


def test_a_uuid_sent_with_bytes_is_pointed_before_the_answer_ends_not_before_it_starts(setup: Setup) -> None:
    asyncio.run(_pointing_is_deferred_to_the_answer(setup))


async def _pointing_is_deferred_to_the_answer(setup: Setup) -> None:
    await setup.orch.prepare("r0", _chat(_image(13)))  # the bytes are in the cache; now name them
    release = asyncio.Event()
    shard_point = setup.shard.alias_point

    async def slow_point(aliases: dict[str, str], tenant: str | None = None) -> None:
        await release.wait()
        await shard_point(aliases, tenant)

    setup.shard.alias_point = slow_point  # type: ignore[method-assign]
    setup.orch.handles.llm = TwoTokenLLM()  # type: ignore[assignment]
    prepared = await setup.orch.prepare("r1", _chat(_image(13, uuid_="dog")))  # did not wait for it
    assert setup.orch.calls.hit_path_served == 1
    stream = setup.orch.stream("r1", prepared, SamplingParams(max_tokens=2))
    first = await asyncio.wait_for(stream.__anext__(), 5)  # the first output does not wait for it
    assert not first.finished
    last = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)
    assert not last.done(), "the last output waits for the pointing"
    release.set()
    assert (await last).finished
    await stream.aclose()
    by_name = await setup.orch.prepare("r2", _chat(_image(uuid_="dog")))
    assert by_name.prompt_token_ids == prepared.prompt_token_ids


def test_a_uuid_naming_an_evicted_entry_is_a_400_and_releases_what_it_reserved(setup: Setup) -> None:
    asyncio.run(_uuid_naming_an_evicted_entry(setup))


async def _uuid_naming_an_evicted_entry(setup: Setup) -> None:
    first = await setup.orch.prepare("r1", _chat(_image(14, uuid_="owl")))
    await setup.orch.settle("r1")
    (item,) = first.mm_items
    await setup.shard.invalidate({item.mm_hash: None})  # the index lost it; the name still points there
    with pytest.raises(Exception) as e:
        await setup.orch.prepare("r2", _chat(_image(uuid_="owl")))  # its lookup reserved the item
    api = from_exception(e.value)
    assert api is not None and api.status_code == 400 and api.code == "mm_cache_miss"
    await _nothing_reserved(setup.shard)


def test_a_near_cache_hit_handed_to_prepare_does_not_renew_its_own_ttl(setup: Setup) -> None:
    asyncio.run(_near_hit_through_prepare_keeps_its_deadline(setup))


async def _near_hit_through_prepare_keeps_its_deadline(setup: Setup) -> None:
    clock = Clock()
    hit_path = _with_near_cache(setup, clock)
    await setup.orch.prepare("r1", _chat(_image(15)))  # X is remembered at t=0
    clock.now = 20.0
    await setup.orch.prepare("r2", _chat(_image(15), _image(16)))  # X from the near cache, Y new
    assert hit_path.near.stats()["hits"] == 1
    clock.now = 31.0  # X's deadline (t=30) passed: the index is asked again
    calls = setup.shard.lookup_calls
    await setup.orch.prepare("r3", _chat(_image(15)))
    assert setup.shard.lookup_calls == calls + 1
    await _nothing_reserved(setup.shard)
