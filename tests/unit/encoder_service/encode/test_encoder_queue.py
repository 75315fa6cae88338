"""EncoderQueue: FIFO steps under the compute budget, cancelled entries skipped, counts exact."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from encoder_service.encode.encoder_queue import EncoderQueue


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


def test_fifo_bound_refuses_a_request_that_would_overflow_it_unless_empty() -> None:
    from encoder_service.encode.encoder_queue import EncoderOverloaded

    q: EncoderQueue[E] = EncoderQueue(100, lambda e: False, max_queued_embeds=150)
    q.admit([E("x", 120), E("x", 80)])  # empty FIFO: taken whatever its size
    for e in (E("x", 120), E("x", 80)):
        q.push(e)
    with pytest.raises(EncoderOverloaded) as err:
        q.admit([E("x", 1)])
    assert err.value.status_code == 503 and "max_queued_embeddings=150" in str(err.value)
    step = q.next_step()
    q.done(step)  # 120 computed: 80 left
    q.admit([E("x", 70)])
    with pytest.raises(EncoderOverloaded):
        q.admit([E("x", 71)])


def test_step_embeds_ends_a_step_early_but_never_splits_or_refuses_an_item() -> None:
    q: EncoderQueue[E] = EncoderQueue(100, lambda e: False, step_embeds=8)
    for e in (E("a", 3), E("b", 3), E("c", 3), E("d", 30), E("e", 1)):
        q.check(e, e.name)  # admission still against the budget: d (30 > 8) is admitted
        q.push(e)
    steps = []
    while step := q.next_step():
        steps.append([e.name for e in step])
        q.done(step)
    # a+b = 6 < 8: c joins (9); d alone is past the target but goes (the first always goes)
    assert steps == [["a", "b", "c"], ["d"], ["e"]]
    assert q.queued_embeds == 0
    assert EncoderQueue(10, lambda e: False, step_embeds=50).step_embeds == 10  # never past the budget
    with pytest.raises(ValueError, match="step_embeds"):
        EncoderQueue(10, lambda e: False, step_embeds=0)


@dataclass
class R:
    request: str
    num_embeds: int
    apart: bool = False
    cancelled: bool = False


def test_a_request_that_takes_its_items_apart_gets_one_per_step_in_fifo_order() -> None:
    """Overlap prefill's requests: a step ends before a second item of the same such request; other
    requests' items still share steps, and FIFO order is never broken to fill a step."""
    q: EncoderQueue[R] = EncoderQueue(
        100, lambda e: e.cancelled, step_embeds=64, apart=lambda e: e.request if e.apart else None
    )
    entries = [
        R("a", 4, apart=True),
        R("a", 4, apart=True),
        R("b", 4),  # shares freely: never split from its own items
        R("b", 4),
        R("a", 4, apart=True, cancelled=True),  # skipped: does not end a step
        R("c", 4, apart=True),
        R("a", 4, apart=True),
        R("c", 4, apart=True),
    ]
    for e in entries:
        q.push(e)
    steps = []
    while step := q.next_step():
        steps.append([e.request for e in step])
        q.done(step)
    assert steps == [["a"], ["a", "b", "b", "c"], ["a", "c"]]
    assert q.queued_embeds == 0 and len(q) == 0


def test_without_apart_a_request_shares_its_steps() -> None:
    q: EncoderQueue[R] = EncoderQueue(100, lambda e: False, step_embeds=64, apart=lambda e: None)
    for _ in range(4):
        q.push(R("a", 4, apart=True))
    assert [e.request for e in q.next_step()] == ["a"] * 4
