"""EncoderCacheBooks.invalidate: a lost entry leaves at once and gives its space back."""

from __future__ import annotations

from encoder_service.cache.encoder_cache import CacheReply, EncoderCacheBooks
from encoder_service.types import EmbeddingMeta


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 8, "float32", (1, 2, 2))


def test_invalidate_drops_a_committed_entry_and_returns_its_space() -> None:
    books = EncoderCacheBooks(10)
    assert books.lookup_or_reserve("r1", "a", 0.0) == CacheReply.COMPUTE
    books.commit("a", _meta("a", 6))
    assert books.invalidate("a")
    assert "a" not in books.entries and books.used == 0 and books.invalidations == 1
    assert books.take_freed() == []  # not an eviction: the caller drops the ref itself
    assert books.evictions == 0
    assert books.lookup_or_reserve("r2", "a", 0.0) == CacheReply.COMPUTE  # a miss now: computed again


def test_invalidate_leaves_a_reservation_alone() -> None:
    books = EncoderCacheBooks(10)
    assert books.lookup_or_reserve("r1", "a", 0.0) == CacheReply.COMPUTE
    assert not books.invalidate("a")  # its computing request commits a fresh tensor
    assert books.holder("a") == "r1"
    books.commit("a", _meta("a", 3))
    assert books.used == 3 and not books.invalidate("zz")
