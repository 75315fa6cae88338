"""EncoderCacheBooks.invalidate: a lost entry leaves at once, pins and all, and gives its space back."""

from __future__ import annotations

from encoder_service.encoder_cache import EncoderCacheBooks
from encoder_service.types import EmbeddingMeta


def _meta(h: str, n: int) -> EmbeddingMeta:
    return EmbeddingMeta(h, "image", n, 8, "float32", (1, 2, 2))


def test_invalidate_drops_a_pinned_entry_and_returns_its_space() -> None:
    books = EncoderCacheBooks(10)
    assert books.try_allocate("r1", "a", 6)
    books.commit("a", _meta("a", 6))
    assert books.try_allocate("r2", "a", 6)  # a second running request pins it too
    assert not books.try_allocate("r3", "b", 5)  # 4 free, a pinned: no room
    assert books.invalidate("a")
    assert "a" not in books.entries and books.used == 0 and books.num_pinned == 0
    assert books.invalidations == 1 and books.evictions == 0 and books.take_freed() == []
    assert books.lookup("a") is None
    assert books.try_allocate("r3", "b", 5)  # the space came back
    assert not books.invalidate("a")  # already gone: nothing to do


def test_release_after_invalidate_never_touches_the_new_entry() -> None:
    books = EncoderCacheBooks(10)
    assert books.try_allocate("old", "a", 4)
    books.commit("a", _meta("a", 4))
    books.invalidate("a")
    assert books.try_allocate("new", "a", 4)  # re-reserved under the same hash by another request
    books.commit("a", _meta("a", 4))
    assert books.release("old") == []  # the old pin went with the lost entry
    assert books.entries["a"].pins == {"new"} and books.used == 4
    books.release("new")
    assert books.num_pinned == 0 and books.num_freeable == 4


def test_a_reservation_is_not_invalidated() -> None:
    books = EncoderCacheBooks(10)
    assert books.try_allocate("r1", "a", 3)
    assert not books.invalidate("a")  # its compute is running: the commit will bring a fresh tensor
    assert books.is_reserved("a") and books.used == 3
    books.commit("a", _meta("a", 3))
    assert books.lookup("a") is not None
