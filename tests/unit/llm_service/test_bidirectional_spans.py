"""Gemma 3's attention rules in the engine's pure parts: the scheduler never cuts a bidirectional
span across chunks, and the attention masks (causal, + span, + sliding window) are the hand-written
ones of transformers' ``token_type_ids`` / sliding-window masks."""

from __future__ import annotations

import torch

from llm_service.attention import build_metadata
from llm_service.kv_cache_manager import KVCacheManager
from llm_service.sampling_params import SamplingParams
from llm_service.scheduler import Scheduler, chunk_size
from llm_service.sequence import Request


def req(rid: str, n: int, spans: list[tuple[int, int]], max_tokens: int = 2) -> Request:
    r = Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=max_tokens))
    r.attention_spans = spans
    return r


def test_chunk_size_ends_before_a_span_it_cannot_finish() -> None:
    r = req("a", 30, [(5, 6), (20, 8)])
    assert chunk_size(r, 0, 8) == 5  # [0, 8) would cut [5, 11): stop at 5
    assert chunk_size(r, 5, 8) == 8  # [5, 13) holds the whole span
    assert chunk_size(r, 0, 11) == 11  # ends exactly at the span's end
    assert chunk_size(r, 13, 8) == 7  # [13, 21) would cut [20, 28): stop at 20
    assert chunk_size(r, 20, 7) == 0  # the span does not fit this step's budget at all
    assert chunk_size(r, 22, 3) == 0  # a chunk starting inside a span (after a cache hit) must finish it
    assert chunk_size(r, 22, 6) == 6
    assert chunk_size(req("b", 30, []), 0, 8) == 8


def test_scheduler_chunks_around_spans_and_waits_for_budget() -> None:
    s = Scheduler(KVCacheManager(64, 4, True), max_num_seqs=4, max_num_batched_tokens=8)
    a = req("a", 20, [(6, 8)])
    s.add_request(a)
    seen = []
    while s.has_unfinished():
        out = s.schedule()
        seen.append([(c.request.request_id, c.start, c.num_tokens) for c in out.chunks])
        s.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    assert seen[:3] == [[("a", 0, 6)], [("a", 6, 8)], [("a", 14, 6)]]


def test_decodes_ahead_delay_a_span_to_a_later_step() -> None:
    """Budget 8, span 8: while another request decodes (1 token) the span waits; it runs whole."""
    s = Scheduler(KVCacheManager(64, 4, True), max_num_seqs=4, max_num_batched_tokens=8)
    b = req("b", 3, [], max_tokens=3)
    s.add_request(b)
    a = req("a", 12, [(2, 8)])
    s.add_request(a)
    chunks = []
    while s.has_unfinished():
        out = s.schedule()
        chunks += [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]
        s.update(out, {c.request.request_id: (1, None) for c in out.chunks if c.samples})
    a_chunks = [(st, n) for rid, st, n in chunks if rid == "a"]
    # step 1: b's prompt (3) and a's text before the span (2); steps 2-3: b decodes, the span (8)
    # does not fit the 7 left and waits; step 4: b is done, the span runs whole
    assert a_chunks[:3] == [(0, 2), (2, 8), (10, 2)]
    assert [rid for rid, st, n in chunks[:4]] == ["b", "a", "b", "b"]


def _allowed(q: int, k: int, spans: list[tuple[int, int]], window: int | None) -> bool:
    same = any(o <= q < o + n and o <= k < o + n for o, n in spans)
    ok = k <= q or same
    return ok and (window is None or k > q - window)


def test_masks_equal_the_rules() -> None:
    spans = [(3, 5), (10, 4)]
    start, n = 2, 14  # a chunk [2, 16) after a 2-token prefix
    meta = build_metadata([(start, n, list(range(8)))], 4, torch.device("cpu"), [spans])
    s = meta.seqs[0]
    for window in (None, 3, 6):
        mask = s.mask_for(window)
        assert mask is not None
        want = torch.tensor(
            [[_allowed(q, k, spans, window) for k in range(start + n)] for q in range(start, start + n)]
        )
        assert torch.equal(mask, want), window
    assert bool(
        s.mask_for(3)[3 - start, 7]
    )  # in a local layer too, an image token sees its image's later ones
    assert not bool(s.mask_for(3)[13 - start, 3])  # text sees the image only within the window


def test_decode_masks() -> None:
    meta = build_metadata([(9, 1, [0, 1, 2])], 4, torch.device("cpu"), [[(2, 4)]])
    s = meta.seqs[0]
    assert s.mask is None  # a decode sees everything before it
    assert s.mask_for(16) is None  # the window covers the whole context
    assert s.mask_for(4).tolist() == [[k > 5 for k in range(10)]]
