"""The state cache's books, pure Python (no model): running slots, snapshots filed under block hashes,
their budget, and their eviction together with the KV blocks they end, driven by the real scheduler."""

from __future__ import annotations

import pytest

from llm_service.hybrid_kv_cache_manager import HybridKVCacheManager
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler
from llm_service.sequence import Request
from llm_service.state_cache import SnapshotIndex, StatePool

BS = 4


def request(rid: str, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_to_end(sched: Scheduler, reqs: list[Request], token: int = 7) -> None:
    """Schedule and update (every sampling chunk 'samples' ``token``) until every request finished."""
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {c.request.request_id: (token, None) for c in out.chunks if c.samples})


def hybrid(num_blocks: int = 64, slots: int = 2, snapshots: int = 3, interval: int = 2) -> Scheduler:
    return Scheduler(HybridKVCacheManager(num_blocks, BS, slots, snapshots, interval), 2, 64)


def books(sched: Scheduler) -> HybridKVCacheManager:
    assert isinstance(sched.kv, HybridKVCacheManager)
    return sched.kv


def assert_consistent(kv: HybridKVCacheManager) -> None:
    """No slot leaks; every snapshot's block is still in the prefix cache."""
    snaps = kv.snapshots
    assert snaps.num_free + snaps.num_registered == snaps.num_slots
    assert all(h in kv.pool._by_hash for h in snaps._by_hash)


def test_state_pool_slots() -> None:
    pool = StatePool(2)
    assert [pool.allocate("a"), pool.allocate("b")] == [0, 1] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.allocate("c")
    pool.free("a")
    pool.free("a")  # a second free is a no-op
    assert pool.allocate("c") == 0 and pool.slot_of("c") == 0


def test_snapshot_lru_skips_pinned_and_dedupes() -> None:
    idx = SnapshotIndex(2, base=10)
    a, b = idx.reserve(), idx.reserve()
    assert (a, b) == (10, 11) and idx.num_free == 0
    idx.register(b"A", a)
    idx.register(b"B", b)
    idx.pin(b"A")
    c = idx.reserve()  # evicts the least recently used unpinned one: B
    assert c == b and idx.lookup(b"B") is None and idx.num_evicted == 1
    assert idx.reserve() is None  # A is pinned, c is reserved: nothing to give
    idx.register(b"A", c)  # A already filed: the new slot goes back
    assert idx.num_free == 1 and idx.lookup(b"A") == a
    idx.unpin(b"A")
    idx.drop(b"A")
    assert idx.num_free == 2 and idx.num_registered == 0


def test_capture_points_policy() -> None:
    kv = HybridKVCacheManager(64, BS, 1, 4, snapshot_interval_blocks=4)
    r = request("r", list(range(23)))
    # prompt of 23: (23-1)//4*4 = 20 = 23//4*4; every 4th block: 16; generation: every boundary
    assert kv.capture_points(r, 0, 16) == [16]
    assert kv.capture_points(r, 16, 7) == [20]
    assert kv.capture_points(r, 23, 1) == [24]
    assert kv.capture_points(r, 24, 1) == []
    off = HybridKVCacheManager(64, BS, 1, 0)  # no snapshot slots: no prefix caching, no captures
    assert off.capture_points(r, 0, 23) == [] and not off.enable_caching


def test_hit_ends_at_the_last_snapshot_and_restores_it() -> None:
    sched = hybrid()
    kv = books(sched)
    first = request("a", list(range(100, 110)))  # 10 tokens: snapshots at 8 and, generating, at 12
    run_to_end(sched, [first])
    assert kv.snapshots.num_registered == 2
    again = request("b", list(range(100, 110)))
    hits = kv.get_computed_blocks(again)
    assert len(hits) * BS == 8  # (10 - 1) // 4 blocks, the snapshot at 8
    longer = request("c", [*range(100, 110), 7, 7, 7, 1, 2, 3])  # the first turn and its answer
    assert len(kv.get_computed_blocks(longer)) * BS == 12  # the generation snapshot at 12
    sched.add_request(longer)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 12 and longer.state is not None
    assert longer.state.restore_from == kv.snapshots.lookup(longer.block_hashes[2])
    assert kv.snapshots._pins == {longer.block_hashes[2]: 1}  # not evictable while restoring
    sched.update(out, {"c": (7, None)})
    assert longer.state.restore_from is None and kv.snapshots._pins == {}  # its own slot has them now
    run_to_end(sched, [])
    assert_consistent(kv)
    assert kv.states.num_free == 2 and kv.num_free_blocks == 64


def test_a_long_answer_keeps_the_prompt_snapshot() -> None:
    """Two snapshot slots: the prompt's and the answer's latest; each new generated boundary replaces
    the request's previous one instead of evicting the prompt's."""
    sched = hybrid(snapshots=2, interval=0)
    kv = books(sched)
    r = request("a", list(range(100, 110)), max_tokens=12)  # generated boundaries at 12, 16, 20
    run_to_end(sched, [r])
    prompt_end = kv.snapshots.lookup(r.block_hashes[1])  # the block ending at 8
    assert prompt_end is not None and kv.snapshots.num_registered == 2
    assert kv.snapshots.lookup(r.block_hashes[4]) is not None  # the one ending at 20
    assert_consistent(kv)


def test_filling_the_budget_evicts_blocks_with_their_snapshots() -> None:
    """Distinct prompts fill 3 snapshot slots (LRU makes room); then a request that needs every KV
    block evicts all cached blocks, and every snapshot goes with its block."""
    sched = hybrid(num_blocks=16, snapshots=3)
    kv = books(sched)
    for i in range(4):
        run_to_end(sched, [request(f"r{i}", [200 + 10 * i + j for j in range(10)])])
        assert kv.snapshots.num_registered <= 3
        assert_consistent(kv)
    assert kv.snapshots.num_evicted > 0 and kv.snapshots.num_registered == 3
    old = set(kv.snapshots._by_hash)
    big = request("big", [500 + j for j in range(63)], max_tokens=1)  # 16 blocks: all of them
    sched.add_request(big)
    out = sched.schedule()
    assert out.chunks and kv.pool.num_cached() == 0
    assert kv.snapshots.num_registered == 0 and not old & set(kv.snapshots._by_hash)
    assert kv.snapshots.num_free == 3 - len(big.state.captures if big.state else [])
    sched.update(out, {c.request.request_id: (7, None) for c in out.chunks if c.samples})
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update(out, {c.request.request_id: (7, None) for c in out.chunks if c.samples})
    assert_consistent(kv)
    assert kv.states.num_free == 2 and kv.num_free_blocks == 16


def test_an_import_takes_a_state_slot_and_any_cached_blocks_without_a_snapshot() -> None:
    """E/P/D's decode side: the state comes with the KV, so an import restores nothing and takes a hit
    of cached blocks even where no snapshot ends; it reserves one snapshot slot, for the prefill
    side's snapshot at the prompt's last full block (filed with the blocks, or given back when none
    came); no free state slot: no import (the caller answers Overloaded)."""
    sched = hybrid(slots=1)
    kv = books(sched)
    prompt = list(range(30, 50))
    a = request("a", prompt)
    assert kv.allocate_import(a, len(prompt)) == 0
    assert a.state is not None and a.state.restore_from is None
    slot = kv.import_snapshot(a)
    assert slot is not None and a.state.captures == [(20, slot)]
    assert kv.allocate_import(request("x", prompt), len(prompt)) is None  # the one slot is held
    kv.drop_import_snapshot(a)  # the prefill side sent none
    a.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(a)
    assert kv.snapshots.num_registered == 0
    kv.free(a)
    b = request("b", prompt)
    b.append_output(7, None)  # its first token, sampled on the prefill side (as reserve_import does)
    assert kv.get_computed_blocks(b) == []  # a colocated hit needs a snapshot: none was filed
    assert kv.allocate_import(b, len(prompt)) == 5  # an import needs none
    assert kv.import_snapshot(b) is None  # the hit covers the last full block: nothing to file
    b.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(b)
    kv.free(b)
    assert_consistent(kv)
