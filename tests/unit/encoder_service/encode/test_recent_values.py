"""RecentValues: an encoder replica's last small outputs, by ObjectRef id, for forwarded requests."""

from __future__ import annotations

from encoder_service.encode.recent_values import RecentValues


def test_keeps_small_values_and_lets_the_oldest_go() -> None:
    recent = RecentValues(max_entries=2, max_bytes=100)
    recent.put("a", "A", 100)
    recent.put("big", "B", 101)  # over the inline bound: fetched by whoever needs it, never kept
    recent.put("b", "B", 10)
    assert recent.get("a") == "A" and recent.get("big") is None
    recent.put("c", "C", 10)  # the oldest entry goes
    assert recent.get("a") is None and recent.get("b") == "B" and recent.get("c") == "C"
    assert len(recent) == 2 and recent.taken == 3  # A, then B and C: what was handed out


def test_nothing_is_kept_with_no_room() -> None:
    recent = RecentValues(max_entries=0)
    recent.put("a", "A", 1)
    assert recent.get("a") is None and len(recent) == 0 and recent.taken == 0
