"""cache_salt (vLLM's semantics): one more extra key of the first block only; the KV cache and the
router's affinity index share blocks only between requests of the same salt."""

from __future__ import annotations

from llm_service.kv_cache_manager import KVCacheManager
from llm_service.prefix_hash import block_extra_keys, compute_block_hashes, hash_block, salt_key
from llm_service.sampling_params import SamplingParams
from llm_service.sequence import Request
from router.routing.prefix_affinity import PrefixAffinityIndex

TOKENS = list(range(1, 15))  # 14 tokens: 3 full blocks of 4, the last one recomputed
H = "ab" * 32  # an mm_hash (hex)


def test_salt_enters_the_first_block_and_so_every_hash() -> None:
    plain = compute_block_hashes(TOKENS, [], 4)
    assert plain[0] == hash_block(None, TOKENS[:4])  # no salt: the hashes of before
    a = compute_block_hashes(TOKENS, [], 4, cache_salt="a")
    assert compute_block_hashes(TOKENS, [], 4, cache_salt="a") == a
    b = compute_block_hashes(TOKENS, [], 4, cache_salt="b")
    assert all(x != y != z != x for x, y, z in zip(plain, a, b, strict=True))
    assert block_extra_keys(0, 4, [(2, 4, H)], "a") == (salt_key("a"), (H, -2))
    assert block_extra_keys(4, 4, [(2, 4, H)], "a") == ((H, 2),)  # later blocks: media keys only


def test_a_salt_cannot_imitate_other_extra_keys() -> None:
    """Keys are length-prefixed in the hash: a salt spelling out "x" followed by a media key's
    encoding is not the salt "x" with that media item."""
    zero = "\x00" * 8
    crafted = f"x:{zero}|m{H}"
    assert hash_block(None, TOKENS[:4], [salt_key("x"), (H, 0)]) != hash_block(
        None, TOKENS[:4], [salt_key(crafted)]
    )


def _serve(kv: KVCacheManager, rid: str, salt: str | None) -> int:
    """Prefill a request of TOKENS; returns the blocks it found in the prefix cache."""
    req = Request(rid, list(TOKENS), SamplingParams(), cache_salt=salt)
    hits = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - 4 * len(hits), hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    kv.free(req)
    return len(hits)


def test_kv_cache_hits_only_under_the_same_salt() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    assert _serve(kv, "a1", "a") == 0
    assert _serve(kv, "b1", "b") == 0
    assert _serve(kv, "none1", None) == 0
    assert _serve(kv, "a2", "a") == 3
    assert _serve(kv, "b2", "b") == 3
    assert _serve(kv, "none2", None) == 3


def test_affinity_keys_agree_with_the_cache() -> None:
    index = PrefixAffinityIndex()
    index.record("r1", compute_block_hashes(TOKENS, [], 4, cache_salt="a"))
    index.record("r2", compute_block_hashes(TOKENS, [], 4))
    matched = index.matched_blocks(compute_block_hashes(TOKENS, [], 4, cache_salt="a"), ["r1", "r2"])
    assert matched == {"r1": 3, "r2": 0}
    matched = index.matched_blocks(compute_block_hashes(TOKENS, [], 4, cache_salt="b"), ["r1", "r2"])
    assert matched == {"r1": 0, "r2": 0}
