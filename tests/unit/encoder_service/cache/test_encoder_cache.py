"""EncoderCacheBooks and ProcessorCache against hand-computed outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from encoder_service.cache.encoder_cache import CacheReply, EncoderCacheBooks
from encoder_service.preprocess.errors import EncoderCacheFull
from encoder_service.preprocess.processor_cache import ProcessorCache
from encoder_service.types import EmbeddingMeta, EncoderInput


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 8, "float32", (1, 2, 2))


def _fill(books: EncoderCacheBooks, req: str, h: str, n: int, now: float = 0.0) -> None:
    assert books.lookup_or_reserve(req, h, now) == CacheReply.COMPUTE
    books.commit(h, _meta(h, n))


def test_commit_evicts_least_recently_used_first_and_only_when_needed():
    books = EncoderCacheBooks(10)
    for h in "abc":
        _fill(books, "r", h, 3)
    assert books.lookup_or_reserve("s", "a", 0.0) == CacheReply.HIT  # a is now the most recently used
    _fill(books, "s", "d", 1)  # 1 free embedding: no eviction
    assert books.evictions == 0 and books.take_freed() == []
    _fill(books, "s", "e", 4)  # needs 4: evict b (3) then c (3), not a
    assert books.take_freed() == ["b", "c"] and set(books.entries) == {"a", "d", "e"}
    assert books.used == 3 + 1 + 4


def test_reservations_are_single_flight_cost_nothing_until_commit_and_too_large_refused():
    books = EncoderCacheBooks(10)
    assert books.lookup_or_reserve("r1", "a", 0.0) == CacheReply.COMPUTE
    assert books.lookup_or_reserve("r2", "a", 1.0) == CacheReply.WAIT  # r1 computes it
    assert books.lookup_or_reserve("r1", "a", 1.0) == CacheReply.COMPUTE  # asked again by its holder
    assert books.used == 0 and books.num_reserved == 1 and books.holder("a") == "r1"
    books.commit("a", _meta("a", 4))
    assert (
        books.lookup_or_reserve("r2", "a", 2.0) == CacheReply.HIT
        and books.used == 4
        and books.num_reserved == 0
    )
    assert books.lookup_or_reserve("r3", "big", 2.0) == CacheReply.COMPUTE
    with pytest.raises(EncoderCacheFull, match="capacity of 10") as e:
        books.commit("big", _meta("big", 11))
    assert e.value.status_code == 400


def test_released_reservation_is_dropped_and_counters():
    books = EncoderCacheBooks(10)
    assert books.lookup_or_reserve("r1", "a", 0.0) == CacheReply.COMPUTE
    assert books.lookup("a") is None  # reserved, not committed: a miss
    assert books.release("r1") == ["a"]
    assert "a" not in books.entries and books.take_freed() == []
    _fill(books, "r2", "b", 2)
    books.lookup("b")
    assert books.lookup("b", count=False) is not None and books.lookup("zz", count=False) is None  # peeks
    assert books.stats() == {
        "capacity": 10,
        "used": 2,
        "entries": 1,
        "reserved": 0,
        "hits": 1,
        "misses": 3,
        "evictions": 0,
        "expired": 0,
    }
    with pytest.raises(KeyError):
        books.commit("a", _meta("a", 7))


def test_a_dead_holders_reservation_expires_and_a_live_one_renews():
    books = EncoderCacheBooks(10, lease_s=5.0)
    assert books.lookup_or_reserve("dead", "a", 0.0) == CacheReply.COMPUTE
    assert books.lookup_or_reserve("live", "b", 0.0) == CacheReply.COMPUTE
    assert books.renew("live", 4.0) == 1  # b now runs until 9.0
    assert books.lookup_or_reserve("other", "a", 4.9) == CacheReply.WAIT
    assert books.lookup_or_reserve("other", "a", 5.0) == CacheReply.COMPUTE  # taken over at the lease's end
    assert books.holder("a") == "other" and books.expired == 1
    assert books.release("dead") == []  # nothing left to the dead holder
    assert books.expire(8.9) == [] and books.expire(9.0) == ["b"]
    assert books.release("live") == [] and books.renew("live", 9.0) == 0
    with pytest.raises(KeyError):
        books.commit("b", _meta("b", 2))  # the expired holder's late commit finds nothing


def _inp(h: str, nbytes: int) -> EncoderInput:
    return EncoderInput(h, "image", 1, None, {"pixel_values": np.zeros(nbytes, dtype=np.uint8)})


def test_processor_cache_lru_in_bytes():
    cache = ProcessorCache(100)
    assert cache.put(_inp("a", 40)) and cache.put(_inp("b", 40))
    assert cache.get("a") is not None  # b is now least recently used
    assert cache.put(_inp("c", 40))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert not cache.put(_inp("huge", 101))
    assert cache.get("b") is None
    assert cache.stats() | {} == {
        "entries": 2,
        "used_bytes": 80,
        "capacity_bytes": 100,
        "hits": 1,
        "misses": 1,
        "evictions": 1,
    }


def test_processor_cache_counts_and_copies_out_a_view_of_a_larger_buffer():
    """A [1, 3000] int32 view of a 1.9 MB storage (Qwen2-Audio's feature_attention_mask) would keep the
    whole storage alive: the cache stores a compact copy and counts its 12 KB, for torch and numpy."""
    import torch

    from encoder_service.preprocess.processor_cache import encoder_input_nbytes, held_nbytes

    big = torch.zeros(160, 3000, dtype=torch.int32)
    view = big[:1]
    assert held_nbytes(view) == 160 * 3000 * 4  # what a cache counting view.nbytes would miss
    arr = np.zeros((160, 3000), dtype=np.int32)[:1]
    inp = EncoderInput("a", "audio", 1, None, {"feature_attention_mask": view, "np_mask": arr})
    cache = ProcessorCache(1 << 20)
    assert cache.put(inp)
    kept = cache.get("a")
    assert kept is not None
    mask, np_mask = kept.tensors["feature_attention_mask"], kept.tensors["np_mask"]
    assert mask.untyped_storage().nbytes() == 3000 * 4 and torch.equal(mask, view)
    assert np_mask.base is None and np.array_equal(np_mask, arr)
    assert cache.used_bytes == encoder_input_nbytes(kept) == 2 * 3000 * 4
