"""EncoderQueue: FIFO steps under the compute budget, cancelled entries skipped, counts exact."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from encoder_service.encoder_queue import EncoderQueue


@dataclass
class E:
    name: str
    num_embeds: int
    cancelled: bool = False


def test_steps_fill_the_budget_in_arrival_order_and_skip_cancelled() -> None:
    q: EncoderQueue[E] = EncoderQueue(10, lambda e: e.cancelled)
    entries = [E("a", 4), E("b", 4, cancelled=True), E("c", 5), E("d", 1), E("e", 10)]
    for e in entries:
        q.check(e, e.name)
        q.push(e)
    assert q.queued_embeds == 24
    first = q.next_step()
    assert [e.name for e in first] == ["a", "c", "d"]  # b cancelled (dropped, uncounted), 4+5+1 = 10
    assert q.queued_embeds == 20
    q.done(first)
    assert q.queued_embeds == 10
    second = q.next_step()
    assert [e.name for e in second] == ["e"] and q.next_step() == []
    q.done(second)
    assert q.queued_embeds == 0 and len(q) == 0


def test_an_item_larger_than_a_step_is_refused_at_admission() -> None:
    q: EncoderQueue[E] = EncoderQueue(8, lambda e: False)
    with pytest.raises(
        ValueError, match="image 3 needs 9 embeddings, more than max_num_encoder_input_tokens=8"
    ):
        q.check(E("x", 9), "image 3")
