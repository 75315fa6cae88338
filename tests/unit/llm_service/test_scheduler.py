"""Scheduler: chunking, budgets, FCFS, preemption (pure Python, a fake model step)."""

from __future__ import annotations

from llm_service.kv_cache_manager import KVCacheManager
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler, SchedulerOutput
from llm_service.sequence import Request


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, block_size, caching), max_num_seqs, budget)


def req(rid: str, n: int, max_tokens: int = 4, base: int = 0, stop=frozenset()) -> Request:
    return Request(
        rid, [base + i for i in range(n)], SamplingParams(max_tokens=max_tokens), stop_token_ids=stop
    )


def fake_step(s: Scheduler, token: int = 1) -> SchedulerOutput:
    out = s.schedule()
    sampled = {c.request.request_id: (token, None) for c in out.chunks if c.samples}
    s.update(out, sampled)
    return out


def run_all(s: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while s.has_unfinished():
        fake_step(s)
        steps += 1
        assert steps < limit
    return steps


def test_chunked_prefill_within_budget() -> None:
    s = make(budget=8)
    r = req("a", 20, max_tokens=2)
    s.add_request(r)
    sizes = []
    while s.has_unfinished():
        out = fake_step(s)
        sizes.append([(c.start, c.num_tokens, c.samples) for c in out.chunks])
    assert sizes == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)], [(20, 1, True)]]
    assert r.output_token_ids == [1, 1] and r.status.value == "length"


def test_budget_shared_running_first_then_fcfs() -> None:
    s = make(budget=10)
    a, b, c = req("a", 6), req("b", 6), req("c", 3)
    for r in (a, b, c):
        s.add_request(r)
    out = fake_step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.chunks] == [("a", 6), ("b", 4)]
    out = fake_step(s)
    # a decodes (1), b finishes its prompt (2), c is admitted with the rest (3)
    assert [(x.request.request_id, x.start, x.num_tokens) for x in out.chunks] == [
        ("a", 6, 1),
        ("b", 4, 2),
        ("c", 0, 3),
    ]


def test_max_num_seqs() -> None:
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, base=10 * i))
    out = fake_step(s)
    assert [x.request.request_id for x in out.chunks] == ["r0", "r1"]
    assert len(s.waiting) == 1


def test_preempts_most_recent_and_recomputes() -> None:
    # 6 blocks of 4: a and b each take 2 blocks for their prompt, decodes need more
    s = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8, base=100)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    while s.has_unfinished():
        out = fake_step(s)
        preempted += out.preempted
    assert preempted and set(preempted) == {"b"}  # the newest one goes
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert s.num_preemptions == len(preempted)
    assert len(a.output_token_ids) == len(b.output_token_ids) == 8
    assert s.kv.num_free_blocks == 6


def test_preempted_request_goes_back_to_front_of_queue() -> None:
    s = make(num_blocks=4, block_size=4, budget=64, max_num_seqs=8)
    a, b, c = req("a", 8, max_tokens=6), req("b", 8, max_tokens=6, base=50), req("c", 3, base=90)
    for r in (a, b):
        s.add_request(r)
    fake_step(s)  # both admitted, 2 blocks each
    s.add_request(c)
    out = fake_step(s)  # a decodes into a 3rd block: b is preempted
    assert out.preempted == ["b"]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_stop_token_and_abort_free_blocks() -> None:
    s = make()
    a = req("a", 5, max_tokens=10, stop=frozenset({1}))
    b = req("b", 9, max_tokens=10, base=40)
    s.add_request(a)
    s.add_request(b)
    fake_step(s)
    assert a.status.value == "stop" and a.output_token_ids == [1]
    assert s.abort("b") is b and b.status.value == "abort"
    assert s.abort("b") is None  # idempotent
    assert not s.has_unfinished() and s.kv.num_free_blocks == 64


def test_abort_waiting_request() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5))
    fake_step(s)
    s.abort("b")
    assert len(s.waiting) == 0
    run_all(s)
    assert s.kv.num_free_blocks == 64


def test_prefix_hit_makes_recompute_cheap() -> None:
    s = make(num_blocks=64, block_size=4)
    a = req("a", 18, max_tokens=1)
    s.add_request(a)
    run_all(s)
    b = req("b", 18, max_tokens=1)
    s.add_request(b)
    out = fake_step(s)
    assert out.chunks[0].start == 16 and out.chunks[0].num_tokens == 2
    assert b.num_cached_tokens == 16
    assert s.kv.prefix_hit_tokens == 16 and s.kv.prefix_query_tokens == 36
    assert s.kv.num_free_blocks == 64


def test_no_prefix_hits_when_caching_disabled() -> None:
    s = make(caching=False)
    s.add_request(req("a", 18, max_tokens=1))
    run_all(s)
    b = req("b", 18, max_tokens=1)
    s.add_request(b)
    fake_step(s)
    assert b.num_cached_tokens == 0 and s.kv.prefix_query_tokens == 0


def test_a_request_lacking_its_first_item_is_parked_not_blocking_the_queue() -> None:
    """An item without embeddings must not be computed: a request that cannot compute a token
    without it is parked (reported once), the ones behind it are admitted, and it goes first again
    when unparked; an abort while parked frees it."""
    s = make()
    a = req("a", 12)
    a.missing = [(0, 8)]  # nothing is cached: its first token is the item's
    b = req("b", 12, base=100)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["b"]
    assert s.take_parked() == ["a"] and s.take_parked() == []
    assert "a" in s.parked and a not in s.waiting and s.has_unfinished()
    a.missing = []  # what LLMEngine.supply_embeddings does before it unparks
    s.unpark("a")
    assert s.waiting[0] is a and "a" not in s.parked
    s.update(out, {})
    out = s.schedule()
    assert "a" in [c.request.request_id for c in out.chunks]

    c = req("c", 12, base=200)
    c.missing = [(0, 4)]
    s.add_request(c)
    s.schedule()
    assert s.take_parked() == ["c"]
    assert s.abort("c") is c and "c" not in s.parked and "c" not in s.requests


def test_a_request_computes_up_to_each_item_as_it_arrives_in_any_order() -> None:
    """Text before the first missing item is computed at once; the request then waits, holding its
    blocks and its seat but no budget (the others go on, and an empty engine has no step to run);
    each arrival lets it compute up to the next item it lacks, whatever order they come in."""
    s = make(budget=32)
    r = req("r", 30, max_tokens=2)
    r.missing = [(4, 10), (12, 20), (22, 26)]
    other = req("o", 6, base=100, max_tokens=3)
    s.add_request(r)
    s.add_request(other)
    out = fake_step(s)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("r", 0, 4), ("o", 0, 6)]
    assert s.take_parked() == ["r"] and r.blocked and len(s.kv.block_table("r")) == 1
    while other.request_id in s.requests:
        assert [c.request.request_id for c in fake_step(s).chunks] == ["o"]
    assert not s.has_unfinished() and s.running == [r]  # nothing to step until an item comes
    r.missing = [(4, 10), (12, 20)]  # the last item first: still held up by the first
    s.unpark("r")
    assert not s.has_unfinished()
    r.missing = [(12, 20)]
    s.unpark("r")
    assert [(c.start, c.num_tokens) for c in fake_step(s).chunks] == [(4, 8)]
    assert not s.has_unfinished()
    r.missing = []
    s.unpark("r")
    out = fake_step(s)
    assert [(c.start, c.num_tokens, c.samples) for c in out.chunks] == [(12, 18, True)]
    run_all(s)
    assert r.output_token_ids == [1, 1] and s.take_parked() == []
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_a_blocked_request_is_preempted_first_and_resumes_from_the_cache() -> None:
    """A request waiting for an item is the most recent admission when blocks run out: preempted,
    it frees its blocks for the others and, once its items are in, is admitted again over its
    cached prefix."""
    s = make(num_blocks=6, block_size=4, budget=32)
    first = req("first", 12, max_tokens=8)
    s.add_request(first)
    fake_step(s)  # first holds 3 blocks and decodes
    r = req("r", 12, base=100, max_tokens=1)
    r.missing = [(8, 12)]
    s.add_request(r)
    out = fake_step(s)
    assert ("r", 0, 8) in [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]
    assert r.blocked and s.num_preemptions == 0
    while not s.num_preemptions:  # first's decode needs r's blocks
        fake_step(s)
    assert r.status.value == "waiting" and r in s.waiting and not s.kv.block_table("r")
    r.missing = []
    s.unpark("r")
    run_all(s)
    assert first.status.value == "length" and r.status.value == "length"
    assert r.num_preemptions == 1 and r.num_cached_tokens == 0


def test_a_request_whose_unfetched_item_is_cached_is_admitted_past_it() -> None:
    s = make()
    first = req("first", 12)
    s.add_request(first)
    run_all(s)  # its full blocks (0..7 of 12 prompt tokens + outputs) stay in the prefix cache
    again = req("again", 12)
    again.missing = [(0, 8)]
    s.add_request(again)
    out = s.schedule()
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("again", 8)]
    assert s.take_parked() == []
