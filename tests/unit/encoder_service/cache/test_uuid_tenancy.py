"""uuids are names in their tenant's namespace; a part with bytes is keyed by its bytes (the real
Preprocessor on the tiny Qwen2-VL, names in-process as one preprocessor replica keeps them)."""

from __future__ import annotations

import asyncio

import pytest

from encoder_service.cache.uuid_aliases import LocalAliases, UuidAliases
from encoder_service.preprocess.errors import MMCacheMiss
from encoder_service.preprocess.media import MediaLimits
from encoder_service.preprocess.processing import Preprocessor
from encoder_service.types import EmbeddingMeta, MediaRef
from tests.media import make_image_bytes

RED, BLUE, GREEN = (make_image_bytes(64, 48, seed=s) for s in (1, 2, 3))


@pytest.fixture(scope="module")
def vl(tiny_vl_dir):
    return Preprocessor(tiny_vl_dir, MediaLimits(), {"image": 4}, 16 * 1024 * 1024)


class Cache:
    """The committed entries a lookup finds: whatever this test's requests processed."""

    def __init__(self) -> None:
        self.metas: dict[str, EmbeddingMeta] = {}

    def lookup(self, hashes: list[str]) -> dict[str, EmbeddingMeta]:
        return {h: self.metas[h] for h in hashes if h in self.metas}


def _send(vl: Preprocessor, cache: Cache, tenant: str | None, data: bytes | None, uuid: str | None) -> str:
    ref = MediaRef("image", data=data, uuid=uuid, tenant=tenant)
    out = vl.preprocess_sync([{"role": "user", "content": [{"type": "image", "media": ref}]}], cache.lookup)
    (item,) = out.items
    if item.data is not None:  # processed: it is in the cache from now on
        cache.metas[item.mm_hash] = EmbeddingMeta(item.mm_hash, "image", item.length, 8, "float32")
    return item.mm_hash


def test_bytes_win_and_names_stay_in_their_tenant(vl: Preprocessor) -> None:
    vl.aliases = LocalAliases()
    cache = Cache()
    red = _send(vl, cache, None, RED, None)
    blue = _send(vl, cache, None, BLUE, None)
    assert red != blue
    # A names its red image "cat"; B sends blue bytes under the same name: each part is its own bytes
    assert _send(vl, cache, "A", RED, "cat") == red
    assert _send(vl, cache, "B", BLUE, "cat") == blue
    # the name alone: each tenant gets its own content, a third tenant and the keyless server nothing
    assert _send(vl, cache, "A", None, "cat") == red
    assert _send(vl, cache, "B", None, "cat") == blue
    for stranger in ("C", None):
        with pytest.raises(MMCacheMiss) as e:
            _send(vl, cache, stranger, None, "cat")
        assert e.value.status_code == 400 and "uuid 'cat'" in str(e.value)
    # A re-points its own name: A's later uuid-only parts follow, B's do not, red bytes stay red
    green = _send(vl, cache, "A", GREEN, "cat")
    assert green not in (red, blue)
    assert _send(vl, cache, "A", None, "cat") == green
    assert _send(vl, cache, "B", None, "cat") == blue
    assert _send(vl, cache, "B", RED, None) == red


def test_a_name_and_its_bytes_in_one_request(vl: Preprocessor) -> None:
    vl.aliases = LocalAliases()
    cache = Cache()
    parts = [
        {"type": "image", "media": MediaRef("image", data=GREEN, uuid="g", tenant="A")},
        {"type": "image", "media": MediaRef("image", uuid="g", tenant="A")},
    ]
    out = vl.preprocess_sync([{"role": "user", "content": parts}], cache.lookup)
    assert out.items[0].mm_hash == out.items[1].mm_hash == _send(vl, cache, None, GREEN, None)


def test_names_are_bounded_least_recently_used_first() -> None:
    books = UuidAliases(max_entries=2)
    books.point({"a": "h1", "b": "h2"})
    assert books.resolve(["a"]) == {"a": "h1"}  # a is now the most recent
    books.point({"c": "h3"})
    assert books.resolve(["a", "b", "c"]) == {"a": "h1", "c": "h3"}
    books.point({"a": "h4"})  # re-pointed
    assert asyncio.run(LocalAliases(books).resolve(["a"])) == {"a": "h4"} and len(books) == 2


def test_one_tenant_cannot_flush_another_tenants_names(vl: Preprocessor) -> None:
    """B names 30 images; A then names 100, past its quota of 32 and past the table's 64: A's oldest
    names go, B's all stay (one shared LRU for all tenants flushed all 30 of B's)."""
    vl.aliases = LocalAliases(UuidAliases(max_entries=64, max_per_tenant=32))
    cache = Cache()
    images = [make_image_bytes(32, 32, seed=100 + i) for i in range(30)]
    b_hashes = [_send(vl, cache, "B", img, f"b{i}") for i, img in enumerate(images)]
    for i in range(100):
        _send(vl, cache, "A", RED, f"a{i}")
    left = []
    for i, want in enumerate(b_hashes):
        try:
            left.append(_send(vl, cache, "B", None, f"b{i}") == want)
        except MMCacheMiss:
            left.append(False)
    assert sum(left) == 30, f"{sum(left)} of B's 30 names left"
    assert _send(vl, cache, "A", None, "a99") == _send(vl, cache, None, RED, None)  # A keeps its newest


def test_a_tenant_past_its_quota_drops_its_own_oldest_names() -> None:
    books = UuidAliases(max_entries=100, max_per_tenant=10)
    books.point({f"b{i}": f"hb{i}" for i in range(5)}, tenant="B")
    for i in range(50):
        books.point({f"a{i}": f"ha{i}"}, tenant="A")
    assert books.names_of("A") == 10 and books.names_of("B") == 5 and len(books) == 15
    assert books.resolve([f"a{i}" for i in range(50)]) == {f"a{i}": f"ha{i}" for i in range(40, 50)}
    assert len(books.resolve([f"b{i}" for i in range(5)])) == 5
    books.point({"n": "h"})  # the keyless server's names are one more tenant (None)
    assert books.names_of(None) == 1 and books.resolve(["n"]) == {"n": "h"}
    with pytest.raises(ValueError, match="max_per_tenant"):
        UuidAliases(max_entries=4, max_per_tenant=0)


def test_the_quota_comes_from_the_config_and_each_shard_keeps_it() -> None:
    from cluster.config import EncoderConfig
    from encoder_service.cache.cache_index import CacheIndexShard

    assert EncoderConfig().uuid_names_per_tenant == 65_536
    with pytest.raises(ValueError, match="uuid_names_per_tenant"):
        EncoderConfig(uuid_names_per_tenant=0)
    shard = CacheIndexShard(64, max_aliases_per_tenant=3)

    async def go() -> dict[str, str]:
        await shard.alias_point({"b": "hb"}, "B")
        for i in range(10):
            await shard.alias_point({f"a{i}": "ha"}, "A")
        return await shard.alias_resolve(["b"] + [f"a{i}" for i in range(10)])

    assert sorted(asyncio.run(go())) == ["a7", "a8", "a9", "b"]
