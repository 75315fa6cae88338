"""EncoderCacheBooks and ProcessorCache against hand-computed outcomes."""

from __future__ import annotations

import numpy as np
import pytest

from encoder_service.encoder_cache import EncoderCacheBooks
from encoder_service.errors import EncoderCacheFull
from encoder_service.processor_cache import ProcessorCache
from encoder_service.types import EmbeddingMeta, EncoderInput


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 8, "float32", (1, 2, 2))


def _fill(books: EncoderCacheBooks, req: str, h: str, n: int) -> None:
    assert books.try_allocate(req, h, n)
    books.commit(h, _meta(h, n))


def test_pinned_entries_are_never_evicted():
    books = EncoderCacheBooks(10)
    _fill(books, "r1", "a", 6)
    assert not books.try_allocate("r2", "b", 5)  # a is pinned: no space can be made
    assert books.entries.keys() == {"a"} and books.evictions == 0
    books.release("r1")
    assert books.try_allocate("r2", "b", 5)
    assert books.take_freed() == ["a"] and books.evictions == 1


def test_eviction_oldest_first_and_only_when_needed():
    books = EncoderCacheBooks(10)
    for h in "abc":
        _fill(books, "r", h, 3)
    books.release("r")
    assert books.lookup("a") is not None  # a is now the most recently used
    assert books.try_allocate("s", "d", 1)  # 1 free embedding: no eviction
    assert books.evictions == 0 and books.take_freed() == []
    assert books.try_allocate("s", "e", 4)  # needs 4: evict b (3) then c (3), not a
    assert books.take_freed() == ["b", "c"] and set(books.entries) == {"a", "d", "e"}
    assert books.used == 3 + 1 + 4


def test_existing_entry_is_pinned_not_duplicated_and_too_large_refused():
    books = EncoderCacheBooks(10)
    _fill(books, "r1", "a", 4)
    assert books.try_allocate("r2", "a", 4)
    assert books.used == 4 and books.entries["a"].pins == {"r1", "r2"}
    books.release("r1", "a")
    assert books.num_pinned == 1
    with pytest.raises(EncoderCacheFull, match="encoder_cache_size=10") as e:
        books.try_allocate("r3", "big", 11)
    assert e.value.status_code == 400


def test_failed_reservation_is_dropped_and_counters():
    books = EncoderCacheBooks(10)
    assert books.try_allocate("r1", "a", 7)
    assert books.lookup("a") is None  # reserved, not committed: a miss
    assert books.release("r1") == ["a"]
    assert books.used == 0 and "a" not in books.entries and books.take_freed() == []
    _fill(books, "r2", "b", 2)
    books.lookup("b")
    assert books.lookup("b", count=False) is not None and books.lookup("zz", count=False) is None  # peeks
    assert books.stats() == {
        "capacity": 10,
        "used": 2,
        "entries": 1,
        "pinned": 1,
        "hits": 1,
        "misses": 1,
        "evictions": 0,
    }
    with pytest.raises(KeyError):
        books.commit("a", _meta("a", 7))


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
