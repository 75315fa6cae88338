"""BlockPool, prefix hashing and KVCacheManager: pure Python, no torch."""

from __future__ import annotations

import sys

from llm_service.block_pool import BlockPool
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.prefix_hash import block_extra_keys, compute_block_hashes, hash_block
from llm_service.sampling_params import SamplingParams
from llm_service.sequence import Request


def make_req(rid: str, tokens: list[int], spans=()) -> Request:
    return Request(rid, list(tokens), SamplingParams(), mm_spans=list(spans))


def test_pure_modules_do_not_import_torch() -> None:
    import subprocess

    code = (
        "import sys; import llm_service.scheduler, llm_service.prefix_hash, llm_service.kv_cache_manager;"
        "import llm_service.state_cache, llm_service.hybrid_kv_cache_manager;"
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_ref_counts_and_free_queue() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free == 2 and a.ref_count == b.ref_count == 1
    pool.touch([a])
    assert a.ref_count == 2
    pool.free([a])
    assert pool.num_free == 2 and a.ref_count == 1
    pool.free([a, b])
    assert pool.num_free == 4 and a.ref_count == b.ref_count == 0


def test_lru_eviction_takes_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]), (None, (i,), ()))
    pool.free([blocks[1]])
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    (first,) = pool.allocate(1)
    assert first is blocks[1]
    assert pool.lookup(bytes([1]), (None, (1,), ())) is None  # evicted on reuse
    assert pool.lookup(bytes([0]), (None, (0,), ())) is blocks[0]  # freed blocks keep their hash
    assert pool.lookup(bytes([2]), (None, (2,), ())) is blocks[2]


def test_lookup_rechecks_key_not_just_hash() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.cache(blk, b"h", (None, (1, 2), ()))
    assert pool.lookup(b"h", (None, (1, 2), ())) is blk
    assert pool.lookup(b"h", (None, (1, 3), ())) is None
    assert pool.lookup(b"h", (None, (1, 2), (("x", 0),))) is None


def test_extra_keys_offsets_relative_to_block_start() -> None:
    # item at [3, 13) with block_size 5: blocks start at 0, 5, 10
    items = [(3, 10, "img")]
    assert block_extra_keys(0, 5, items) == (("img", -3),)
    assert block_extra_keys(5, 5, items) == (("img", 2),)
    assert block_extra_keys(10, 5, items) == (("img", 7),)
    assert block_extra_keys(15, 5, items) == ()
    assert block_extra_keys(0, 3, items) == ()  # [0, 3) ends where the item starts


def test_block_hashes_chain_and_include_mm_hash() -> None:
    tokens = list(range(10)) + [7] * 6 + list(range(4))
    a = compute_block_hashes(tokens, [(10, 6, "A")], 4)
    b = compute_block_hashes(tokens, [(10, 6, "B")], 4)
    assert len(a) == 5  # 20 tokens, 5 full blocks
    assert a[:2] == b[:2]  # blocks before the item are shared
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))  # from the item on: different
    assert a[0] == hash_block(None, tokens[:4])
    assert a[1] == hash_block(a[0], tokens[4:8])
    # same tokens, no media: differs from both
    assert compute_block_hashes(tokens, [], 4)[2] not in (a[2], b[2])
    # continuing a chain gives the same tail
    assert compute_block_hashes(tokens, [(10, 6, "A")], 4, start_block=2, parent=a[1]) == a[2:]
    assert len(compute_block_hashes(tokens[:3], [], 4)) == 0


def test_kv_manager_prefix_hit_and_all_blocks_return() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    tokens = list(range(14))
    r1 = make_req("r1", tokens)
    assert kv.get_computed_blocks(r1) == []
    assert kv.allocate_slots(r1, 14)
    r1.num_computed_tokens = 14
    kv.cache_computed_blocks(r1)
    assert len(kv.block_table("r1")) == 4
    kv.free(r1)
    assert kv.num_free_blocks == 10
    r2 = make_req("r2", tokens)
    hits = kv.get_computed_blocks(r2)
    assert len(hits) == 3  # 14 tokens: 3 full blocks
    assert kv.allocate_slots(r2, 14 - 12, hits)
    assert kv.block_table("r2")[:3] == kv.block_table("r2")[:3]
    assert [b.block_id for b in hits] == kv.block_table("r2")[:3]
    # a prompt of exactly 3 full blocks keeps its last block to recompute
    r3 = make_req("r3", tokens[:12])
    assert len(kv.get_computed_blocks(r3)) == 2
    kv.free(r2)
    assert kv.num_free_blocks == 10


def test_kv_manager_mm_hash_changes_hits() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    tokens = [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 7, 8, 1, 2, 3]
    r1 = make_req("r1", tokens, [(6, 6, "A")])
    kv.allocate_slots(r1, len(tokens))
    r1.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(r1)
    kv.free(r1)
    assert len(kv.get_computed_blocks(make_req("same", tokens, [(6, 6, "A")]))) == 4
    # the block [4, 8) already holds part of the other image: only block 0 is shared
    assert len(kv.get_computed_blocks(make_req("other", tokens, [(6, 6, "B")]))) == 1


def test_allocate_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r1 = make_req("r1", list(range(8)))
    assert kv.allocate_slots(r1, 8)
    r2 = make_req("r2", list(range(100, 108)))
    assert not kv.allocate_slots(r2, 8)
    assert kv.num_free_blocks == 1 and kv.block_table("r2") == []
    kv.free(r1)
    assert kv.num_free_blocks == 3


def test_hit_on_freed_block_counts_against_free_pool() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    r1 = make_req("r1", list(range(9)))
    assert kv.allocate_slots(r1, 9)
    r1.num_computed_tokens = 9
    kv.cache_computed_blocks(r1)
    kv.free(r1)
    r2 = make_req("r2", list(range(9)))
    hits = kv.get_computed_blocks(r2)
    assert len(hits) == 2
    assert kv.allocate_slots(r2, 1, hits)
    assert kv.num_free_blocks == 0
    assert all(b.ref_count == 1 for b in hits)


def test_a_held_duplicate_takes_the_hash_from_a_free_one() -> None:
    """A block computed again while its cached twin sits free takes over the hash, so the prefix
    stays findable after the free twin is reused (the twin's reuse drops nothing)."""
    pool = BlockPool(3)
    evicted: list[bytes] = []
    pool.on_evict = evicted.append
    a, b = pool.allocate(2)
    key = (None, (1, 2), ())
    pool.cache(a, b"h", key)
    pool.free([a])
    pool.cache(b, b"h", key)  # a is free: b takes the hash
    assert pool.lookup(b"h", key) is b and a.block_hash is None
    pool.allocate(2)  # reuses the free ones, a among them
    assert pool.lookup(b"h", key) is b and evicted == []
    c = BlockPool(2)
    x, y = c.allocate(2)
    c.cache(x, b"h", key)
    c.cache(y, b"h", key)  # x is held: the first writer keeps it
    assert c.lookup(b"h", key) is x and y.block_hash is None
