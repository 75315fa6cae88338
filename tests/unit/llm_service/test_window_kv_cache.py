"""The window group's books (``WindowKVCacheManager``, pure): sliding-window layers give back the blocks
their window no longer reads, prefix hits are trimmed to where those layers' blocks are still cached,
and admission counts both pools. Driven through the real ``Scheduler``."""

from __future__ import annotations

from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler
from llm_service.sequence import Request
from llm_service.window_kv_cache_manager import WindowKVCacheManager, window_blocks_needed

BS, WINDOW = 4, 8


def req(rid: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def run_to_end(sched: Scheduler, kv: WindowKVCacheManager, held: dict[str, list[int]]) -> None:
    """Step until nothing is left, sampling token 7; record each request's window blocks held."""
    while sched.has_unfinished():
        out = sched.schedule()
        for c in out.chunks:
            held.setdefault(c.request.request_id, []).append(kv.num_window_blocks_held(c.request.request_id))
            assert c.window_table is not None and len(c.window_table) == len(c.block_table)
            first = max(0, (c.start - WINDOW + 1) // BS)  # what the chunk's queries read
            assert all(b != kv.null_block.block_id for b in c.window_table[first:])
            assert all(b == kv.null_block.block_id for b in c.window_table[:first])
        sched.update(out, {c.request.request_id: (7, None) for c in out.chunks if c.samples})


def test_a_long_generation_holds_only_its_window() -> None:
    kv = WindowKVCacheManager(num_blocks=64, block_size=BS, num_window_blocks=16, window=WINDOW)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=16)
    sched.add_request(req("a", list(range(10, 30)), max_tokens=40))  # 20 prompt tokens, 60 in all
    held: dict[str, list[int]] = {}
    run_to_end(sched, kv, held)
    # the prompt's two chunks (16 + 4 tokens), then decodes: never more than window/bs + 2 once decoding
    assert max(held["a"][2:]) <= WINDOW // BS + 2 < 60 // BS
    assert kv.num_free_window_blocks == kv.num_window_blocks and kv.num_free_blocks == 64  # all back


def test_a_hit_is_trimmed_to_the_cached_window_blocks() -> None:
    kv = WindowKVCacheManager(num_blocks=64, block_size=BS, num_window_blocks=32, window=WINDOW)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = list(range(100, 140))  # 10 blocks
    sched.add_request(req("a", prompt, max_tokens=1))
    run_to_end(sched, kv, {})
    # the same prompt: every block of both groups is cached (freed blocks keep their hashes)
    again = req("b", prompt, max_tokens=1)
    assert len(kv.get_computed_blocks(again)) == 9  # (40 - 1) // 4
    # the window blocks the hit's next chunk reads are reused by other work: the hit shrinks to
    # where they are all still cached (the full group still has every block)
    kv.window_pool.allocate(kv.window_pool.num_free)  # takes (and evicts) every cached window block
    assert kv.get_computed_blocks(req("c", prompt, max_tokens=1)) == []


def test_a_hit_takes_only_the_window_blocks_it_reads() -> None:
    kv = WindowKVCacheManager(num_blocks=64, block_size=BS, num_window_blocks=32, window=WINDOW)
    sched = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=64)
    prompt = list(range(200, 240))
    sched.add_request(req("a", prompt, max_tokens=1))
    run_to_end(sched, kv, {})
    sched.add_request(req("b", [*prompt, 5, 6, 7], max_tokens=2))
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.start == 40  # 10 blocks hit
    # it reads keys >= 40 - 8 + 1 = 33: blocks 8.. (the rest of the table is the null block)
    assert chunk.window_table is not None and chunk.window_table[:8] == [kv.null_block.block_id] * 8
    assert kv.num_window_blocks_held("b") == len(chunk.window_table) - 8
    sched.update(out, {"b": (7, None)})
    run_to_end(sched, kv, {})
    assert kv.num_free_window_blocks == kv.num_window_blocks


def test_admission_waits_for_window_blocks_and_frees_both_on_abort() -> None:
    kv = WindowKVCacheManager(num_blocks=64, block_size=BS, num_window_blocks=6, window=WINDOW)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    sched.add_request(req("a", list(range(20)), max_tokens=8))  # 20 tokens in one chunk: 5 window blocks
    sched.add_request(req("b", list(range(50, 70)), max_tokens=8))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"]  # b would need 5 more of the 6
    sched.abort("a")
    assert kv.num_free_window_blocks == 6 and kv.num_free_blocks == 64


def test_a_pool_of_window_blocks_needed_never_holds_up_the_batch() -> None:
    """A full batch (4 sequences, 16-token chunks, long prompts and generations) is scheduled step for
    step the same with a window pool of ``window_blocks_needed`` blocks as with an unbounded one."""

    def schedule(num_window_blocks: int) -> list[list[tuple[str, int, int]]]:
        kv = WindowKVCacheManager(256, BS, num_window_blocks, WINDOW)
        sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
        for i in range(6):
            sched.add_request(req(f"r{i}", list(range(100 * i, 100 * i + 10 + 7 * i)), max_tokens=12 + i))
        steps = []
        while sched.has_unfinished():
            out = sched.schedule()
            steps.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
            sched.update(out, {c.request.request_id: (7, None) for c in out.chunks if c.samples})
        return steps

    sized = window_blocks_needed(max_num_seqs=4, max_num_batched_tokens=16, window=WINDOW, block_size=BS)
    assert sized < 256 and schedule(sized) == schedule(256)


def test_an_import_takes_only_the_window_blocks_its_first_decode_reads() -> None:
    """E/P/D's decode side: a 22-token prompt computed elsewhere gets full blocks for all of it, and
    window blocks only from (22 - 8 + 1) // 4 = 3 on (the entries before are the null block); a
    second import of the same prompt finds both groups' blocks in the cache once the first was
    registered, and allocates nothing new."""
    kv = WindowKVCacheManager(num_blocks=64, block_size=BS, num_window_blocks=16, window=WINDOW)
    prompt = list(range(200, 222))
    a = req("a", prompt)
    assert kv.allocate_import(a, len(prompt)) == 0
    assert kv.num_window_blocks_held("a") == 6 - 3 and len(kv.block_table("a")) == 6
    start, ids = kv.import_window("a", 0)
    assert start == 3 and ids == kv.window_table("a")[3:] and kv.null_block.block_id not in ids
    a.num_computed_tokens = len(prompt)
    kv.cache_computed_blocks(a)
    free_full, free_window = kv.num_free_blocks, kv.num_free_window_blocks
    b = req("b", prompt)
    hits = kv.allocate_import(b, len(prompt))
    assert hits == 5  # every full block; the window blocks [3, 5) it reads are the cached ones
    assert kv.import_window("b", hits) == (5, kv.window_table("b")[5:])  # only the partial block to pull
    assert kv.num_free_blocks == free_full - 1 and kv.num_free_window_blocks == free_window - 1
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 64 and kv.num_free_window_blocks == 16
